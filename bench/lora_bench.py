"""LoRA throughput: concurrency 16 with 0, 1 and 4 distinct adapters in the batch, in one run, as ratios.

One Switchboard server per dtype holds four PEFT adapters (made with the ``peft`` test dependency for
the default model: rank ``--rank`` on all seven projections; loaded at start through ``LoraModules``).
The same workload (streaming ``/v1/completions``, ``--tokens`` greedy tokens with ``ignore_eos``,
``--requests`` requests at concurrency ``--concurrency``) runs with every request on the base model,
every request on adapter x0, and the requests spread round-robin over x0..x3. This VM's speed drifts,
so each round measures the three back to back (the order reversed every other round) and each ratio
is the median over rounds of (adapter tok/s ÷ the base tok/s of the same round).

    .venv/bin/python bench/lora_bench.py [--rounds 5] [--dtypes float32 bfloat16] [--rank 16]

Needs `make install-test` (peft). Prints a Markdown report (also written to .cache/bench/lora.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_bench import MODEL, ROOT, SWITCHBOARD_READY, WORK, switchboard_config  # noqa: E402
from peers_report import cpu, git_head  # noqa: E402
from processes import log_tail, run_main, server  # noqa: E402
from results import MODEL_NAME  # noqa: E402

ADAPTERS = ["x0", "x1", "x2", "x3"]
SCENARIOS = {"base": [MODEL_NAME], "1 adapter": ADAPTERS[:1], "4 adapters": ADAPTERS}
PROMPTS = [f"Write a short note about {topic}, in plain words." for topic in (
    "rivers", "bread", "printing presses", "bicycles", "glaciers", "libraries", "tea", "lighthouses",
    "bees", "maps", "clocks", "volcanoes", "violins", "harbours", "salt", "kites")]


@dataclass
class Scenario:
    tok_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def make_adapters(rank: int) -> Path:
    from tests.lora_adapters import make_adapter

    folder = WORK / f"loras-r{rank}"
    for i, name in enumerate(ADAPTERS):
        if not (folder / name / "adapter_model.safetensors").exists():
            make_adapter(MODEL, folder / name, seed=i, r=rank, alpha=2 * rank)
    return folder


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    generated = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(f"error event {event}")
                if event.get("usage"):
                    generated = event["usage"]["completion_tokens"]
    return generated


async def load(url: str, models: list[str], args: argparse.Namespace) -> float:
    """Tokens per second of ``args.requests`` streams, request i on ``models[i % len(models)]``."""
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> int:
            async with gate:
                return await stream(client, url, models[i % len(models)], PROMPTS[i % len(PROMPTS)], args.tokens)

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - start
    if sum(counts) != args.requests * args.tokens:
        raise RuntimeError(f"{sum(counts)} tokens generated, expected {args.requests * args.tokens}")
    return sum(counts) / wall


def bench_dtype(dtype: str, adapters: Path, args: argparse.Namespace) -> dict[str, Scenario]:
    with tempfile.TemporaryDirectory(prefix="sb-lora-") as tmp:
        config, url = switchboard_config(Path(tmp))
        cfg = json.loads(config.read_text())
        cfg["Switchboard"]["dtype"] = dtype
        deploy = cfg["BackendConfig"]["ModelDeployConfig"]
        deploy["LoraModules"] = [{"name": n, "path": str(adapters / n), "baseModelName": MODEL_NAME} for n in ADAPTERS]
        deploy["maxLoraRank"] = max(args.rank, 16)
        config.write_text(json.dumps(cfg, indent=2))
        log = WORK / f"lora-{dtype}.log"
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)]
        with server(f"switchboard {dtype}", cmd, log, lambda: SWITCHBOARD_READY in log_tail(log, 200), cwd=ROOT,
                    env={"PYTHONPATH": str(ROOT)}):
            for name, models in SCENARIOS.items():  # warm-up: every adapter and shape once
                asyncio.run(load(url, models, argparse.Namespace(**{**vars(args), "requests": args.concurrency})))
            return measure(url, args, dtype)


def measure(url: str, args: argparse.Namespace, dtype: str) -> dict[str, Scenario]:
    results = {name: Scenario() for name in SCENARIOS}
    for round_no in range(args.rounds):
        order = list(SCENARIOS) if round_no % 2 == 0 else list(reversed(SCENARIOS))
        measured = {name: asyncio.run(load(url, SCENARIOS[name], args)) for name in order}
        for name, tok_s in measured.items():
            results[name].tok_s.append(tok_s)
            results[name].ratios.append(tok_s / measured["base"])
        print(f"[{dtype}] round {round_no + 1}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in measured.items()),
              flush=True)
    return results


def report(runs: dict[str, dict[str, Scenario]], args: argparse.Namespace, elapsed: float) -> str:
    model, flags = cpu()
    lines = [f"LoRA throughput, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_head()}, "
             f"{elapsed / 60:.1f} min", "",
             f"- CPU: {model}; flags: {' '.join(flags)}",
             f"- workload: {args.requests} streaming /v1/completions at c{args.concurrency}, {args.tokens} greedy "
             f"tokens each (ignore_eos), {args.rounds} rounds; adapters rank {args.rank} on q/k/v/o/gate/up/down",
             f"- command: `.venv/bin/python bench/lora_bench.py {' '.join(sys.argv[1:])}`", "",
             "| dtype | scenario | tok/s (median) | ÷ base, per-round median | per-round ratios |",
             "|---|---|---|---|---|"]
    for dtype, results in runs.items():
        for name, s in results.items():
            lines.append(f"| {dtype} | {name} | {statistics.median(s.tok_s):.1f} | "
                         f"{statistics.median(s.ratios):.3f} | {' '.join(f'{r:.3f}' for r in s.ratios)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    adapters = make_adapters(args.rank)
    if "bfloat16" in args.dtypes and not {"avx512_bf16", "amx_bf16"} & set(cpu()[1]):
        print("bfloat16 skipped: lscpu shows neither avx512_bf16 nor amx_bf16", flush=True)
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"]
    runs = {dtype: bench_dtype(dtype, adapters, args) for dtype in args.dtypes}
    text = report(runs, args, time.monotonic() - started)
    (WORK / "lora.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
