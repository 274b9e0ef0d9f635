"""Engine benchmark: Switchboard vs `transformers serve --continuous-batching` vs one static HF batch.

    .venv/bin/python bench/engine_bench.py [--requests 32] [--concurrency 16] [--tokens 64] [--quick]

One run, one machine, the same SmolLM2-135M-Instruct weights (float32, CPU), greedy decoding:

(a) Switchboard over HTTP: started here as ``switchboard serve`` on free ports, driven with TGI
    ``POST /generate_stream``.
(b) ``transformers serve --continuous-batching`` (transformers' OpenAI-compatible server), installed
    on first use into .cache/bench/tf-serve-venv, driven with streaming ``POST /v1/completions``
    (raw prompt, no chat template, like (a)); EOS is switched off so every request makes N tokens.
(c) HF ``generate`` in-process on one left-padded static batch of all prompts (min_new_tokens = N).

(a) and (b) run the requests at concurrency 1 and at --concurrency, each after a warm-up. Per
request: TTFT (time to the first SSE event) and end-to-end latency; per batch: output tokens/s =
all output tokens / wall time of the batch. The Markdown table (for docs/benchmarks.md) is printed
and written to .cache/bench/last.md. Every server started here is stopped when the script ends,
also on Ctrl-C or an error. ``--quick`` is a fast sanity run (8 requests, concurrency 4, 16 tokens).

``--baseline CHECKOUT [--rounds N]`` compares this tree's Switchboard with another checkout's
instead (before vs after a change, in one run): N alternations of both, the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from results import BASELINE, HF_STATIC, Run, Sample, baseline_report, render  # bench/results.py
from processes import OFFLINE_ENV, Blocked, free_port, http_ok, log_tail, run_main, server  # bench/processes.py

os.environ.update(OFFLINE_ENV)

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
CONFIG = ROOT / "config" / "config.json"
WORK = ROOT / ".cache" / "bench"
TF_VENV = WORK / "tf-serve-venv"
TF_REQUIREMENTS = ["torch==2.13.0", "transformers[serving]==5.23.0"]
REPORT = WORK / "last.md"

SWITCHBOARD_READY = "Switchboard ready on"
REQUEST_TIMEOUT_S = 1800.0

# TGI has no ignore-EOS option, so these are prompts whose greedy continuation runs at least 64
# tokens without EOS: at the default settings every system makes the same number of tokens.
PROMPTS = [
    "The history of the printing press began",
    "My favourite way to spend a rainy afternoon is",
    "The city of Sydney is famous for",
    "def quicksort(items):",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics say that",
    "To bake a loaf of sourdough bread, first",
    "The most important thing I learned at school was",
    "Photosynthesis is the process by which",
    "In 1969, the Apollo 11 mission",
    "A good password should",
    "Viruses and bacteria both cause disease, but",
    "Dear hiring manager, I am writing to",
    "The rules of chess are simple:",
    "Water boils at a lower temperature on a mountain because",
    "The best advice my grandmother ever gave me was",
    "A database index speeds up queries by",
    "The Great Wall of China was built",
    "Here is a short poem about autumn:",
    "Electric cars differ from petrol cars in that",
    "The stock market fell sharply today after",
    "To change a flat tyre on a bicycle, you",
    "The human heart has four chambers:",
    "My name is Olivier and I work as",
    "Jupiter is the largest planet in the solar system, and",
    "The old lighthouse keeper looked out at",
    "In a distributed system, consensus means",
    "The train to Edinburgh was delayed because",
    "Bees are important for agriculture because",
    "The first rule of writing clear code is",
    "On the morning of the election, the candidates",
    "The Pythagorean theorem states that",
]


# ---- streaming clients -----------------------------------------------------------------------


@dataclass(frozen=True)
class Api:
    """How to ask one server for a streamed greedy completion and count the tokens it sent."""

    path: str
    body: Callable[[str, int], dict[str, Any]]
    count_tokens: Callable[[list[dict[str, Any]]], int]
    keep_alive: bool = True  # reuse connections (llama.cpp's server closes one after a few requests: not there)


def tgi_body(prompt: str, tokens: int) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "do_sample": False}}


def tgi_tokens(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if "token" in e)


def openai_body(prompt: str, tokens: int) -> dict[str, Any]:
    # transformers serve reads per-request generation settings from a JSON `generation_config`;
    # eos_token_id -1 never matches, so each request makes exactly `tokens` tokens.
    generation = {"do_sample": False, "max_new_tokens": tokens, "eos_token_id": -1}
    return {"model": str(MODEL), "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "generation_config": json.dumps(generation)}


def openai_tokens(events: list[dict[str, Any]]) -> int:
    usage = [e["usage"]["completion_tokens"] for e in events if e.get("usage")]
    if usage:
        return usage[-1]
    return sum(1 for e in events if any(c.get("text") for c in e.get("choices", [])))


async def stream_one(client: httpx.AsyncClient, url: str, api: Api, prompt: str, tokens: int) -> Sample:
    start = time.perf_counter()
    first = None
    events: list[dict[str, Any]] = []
    async with client.stream("POST", url + api.path, json=api.body(prompt, tokens)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}{api.path}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            first = first or time.perf_counter()
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                continue
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"{url}{api.path}: error event {event}")
            events.append(event)
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}{api.path}: the stream ended without an event")
    return Sample(first - start, end - start, api.count_tokens(events))


async def run_batch(url: str, api: Api, prompts: list[str], tokens: int, concurrency: int) -> tuple[float, list[Sample]]:
    """Send every prompt with at most ``concurrency`` in flight; the wall time and the samples."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency if api.keep_alive else 0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def one(prompt: str) -> Sample:
            async with gate:
                return await stream_one(client, url, api, prompt, tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, list(samples)


def bench_server(name: str, url: str, api: Api, prompts: list[str], tokens: int, levels: list[int]) -> list[Run]:
    """Warm up (one request, then one full-width burst), then time each concurrency level."""
    widest = max(levels)
    asyncio.run(run_batch(url, api, ["Warm-up: hello"], tokens, 1))
    asyncio.run(run_batch(url, api, [f"Warm-up request {i}:" for i in range(widest)], tokens, widest))
    runs = []
    for level in levels:
        wall, samples = asyncio.run(run_batch(url, api, prompts, tokens, level))
        runs.append(Run(name, level, wall, samples))
        print(f"[{name}] concurrency {level}: {runs[-1].tokens} tokens in {wall:.1f}s "
              f"= {runs[-1].tok_s:.1f} tok/s", flush=True)
    return runs


# ---- (a) Switchboard -------------------------------------------------------------------------


def switchboard_config(folder: Path) -> tuple[Path, str]:
    """A copy of config/config.json on free ports with an absolute model path; its path and URL."""
    cfg = json.loads(CONFIG.read_text())
    server_cfg = cfg["ServerConfig"]
    server_cfg["port"], server_cfg["managementPort"], server_cfg["metricsPort"] = (free_port() for _ in range(3))
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(MODEL)
    path = folder / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path, f"http://{server_cfg['ipAddress']}:{server_cfg['port']}"


def bench_switchboard(prompts: list[str], tokens: int, levels: list[int], checkout: Path | None = None,
                      name: str = "switchboard") -> list[Run]:
    """The Switchboard of this script's tree, or of another ``checkout``, run from its own folder with
    this interpreter (so a worktree of another commit runs its own code)."""
    log = WORK / f"{name.replace(' ', '-')}.log"
    checkout = checkout or ROOT
    with tempfile.TemporaryDirectory(prefix="sb-bench-") as tmp:
        config, url = switchboard_config(Path(tmp))
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)]
        env = {"PYTHONPATH": str(checkout)}
        with server(name, cmd, log, lambda: SWITCHBOARD_READY in log_tail(log, 200), cwd=checkout, env=env):
            api = Api("/generate_stream", tgi_body, tgi_tokens)
            return bench_server(name, url, api, prompts, tokens, levels)


def bench_against_baseline(prompts: list[str], tokens: int, levels: list[int], checkout: Path,
                           rounds: int) -> list[Run]:
    """Alternate the baseline checkout and this tree, ``rounds`` times each, so drift hits both alike."""
    runs: list[Run] = []
    for round_no in range(1, rounds + 1):
        runs += bench_switchboard(prompts, tokens, levels, checkout, f"{BASELINE} (round {round_no})")
        runs += bench_switchboard(prompts, tokens, levels, None, f"switchboard (round {round_no})")
    return runs


# ---- (b) transformers serve ------------------------------------------------------------------


def ensure_tf_venv() -> Path:
    """The `transformers` CLI of a venv holding transformers[serving]; created on first use."""
    exe, marker = TF_VENV / "bin" / "transformers", TF_VENV / ".installed"
    if exe.exists() and marker.exists():
        return exe
    print(f"[transformers serve] installing {' '.join(TF_REQUIREMENTS)} into {TF_VENV} ...", flush=True)
    log = WORK / "tf-serve-install.log"
    with open(log, "wb") as out:
        steps = [[sys.executable, "-m", "venv", str(TF_VENV)]] if not (TF_VENV / "bin" / "python").exists() else []
        steps.append([str(TF_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", *TF_REQUIREMENTS])
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise Blocked(f"`{' '.join(step)}` failed:\n{log_tail(log)}")
    if not exe.exists():
        raise Blocked(f"{exe} missing after the install:\n{log_tail(log)}")
    marker.touch()
    return exe


def bench_transformers_serve(prompts: list[str], tokens: int, levels: list[int]) -> list[Run]:
    exe = ensure_tf_venv()
    port, log = free_port(), WORK / "tf-serve.log"
    cmd = [str(exe), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32", str(MODEL)]
    url = f"http://127.0.0.1:{port}"
    with server("transformers serve", cmd, log, lambda: http_ok(url + "/health")):
        api = Api("/v1/completions", openai_body, openai_tokens)
        return bench_server("transformers serve", url, api, prompts, tokens, levels)


# ---- (c) HF generate, one static batch -------------------------------------------------------


def bench_hf_static(prompts: list[str], tokens: int) -> Run:
    """One left-padded batch of all prompts; TTFT is the time to the batch's first new token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.puts, self.at = 0, None

        def put(self, value) -> None:  # the first put is the prompt, the second the first new tokens
            self.puts += 1
            if self.puts == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    tok = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

    def generate(batch: list[str], new: int, streamer=None) -> int:
        enc = tok(batch, return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tok.pad_token_id, streamer=streamer)
        return (out.shape[1] - enc.input_ids.shape[1]) * len(batch)

    with torch.inference_mode():
        generate(prompts, 4)  # warm-up
        first = FirstToken()
        start = time.perf_counter()
        total = generate(prompts, tokens, first)
        wall = time.perf_counter() - start
    ttft = (first.at or start + wall) - start
    per_row = total // len(prompts)
    run = Run(HF_STATIC, len(prompts), wall, [Sample(ttft, wall, per_row) for _ in prompts])
    print(f"[HF generate] static batch of {len(prompts)}: {total} tokens in {wall:.1f}s = {run.tok_s:.1f} tok/s",
          flush=True)
    return run


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per batch (default 32)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy new tokens per request (default 64)")
    parser.add_argument("--quick", action="store_true", help="sanity run: 8 requests, concurrency 4, 16 tokens")
    parser.add_argument("--skip-transformers-serve", action="store_true", help="leave out system (b)")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="instead of (b) and (c): compare with the Switchboard of another checkout "
                             "(e.g. a `git worktree` of an older commit), alternating with this tree")
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline: alternations (default 2)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.tokens = 8, 4, 16
    if min(args.requests, args.concurrency, args.tokens) < 1:
        parser.error("--requests, --concurrency and --tokens must be at least 1")
    return args


def make_prompts(n: int) -> list[str]:
    """``n`` distinct prompts: the list above, numbered once it runs out."""
    return [PROMPTS[i % len(PROMPTS)] + (f" ({i // len(PROMPTS)})" if i >= len(PROMPTS) else "") for i in range(n)]


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers' cleanup runs."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_on_sigterm()
    WORK.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "bench/engine_bench.py", *sys.argv[1:]])
    prompts = make_prompts(args.requests)
    levels = sorted({1, args.concurrency})
    started = time.monotonic()
    if args.baseline is not None:
        runs = bench_against_baseline(prompts, args.tokens, levels, args.baseline.resolve(), args.rounds)
        report = baseline_report(runs, args, command, time.monotonic() - started)
        REPORT.write_text(report)
        print(f"\n{report}\n(written to {REPORT})")
        return 0

    runs = bench_switchboard(prompts, args.tokens, levels)
    tf_blocker = "--skip-transformers-serve" if args.skip_transformers_serve else ""
    if not tf_blocker:
        try:
            runs += bench_transformers_serve(prompts, args.tokens, levels)
        except (Blocked, RuntimeError, httpx.HTTPError, OSError) as exc:
            tf_blocker = f"{type(exc).__name__}: {exc}"
            print(f"[transformers serve] NOT BENCHMARKED, because:\n{tf_blocker}", flush=True)
    runs.append(bench_hf_static(prompts, args.tokens))

    report = render(runs, args, command, time.monotonic() - started, tf_blocker)
    REPORT.write_text(report)
    print(f"\n{report}\n(written to {REPORT})")
    if tf_blocker:
        print(f"\ntransformers serve was not benchmarked: {tf_blocker}")
    return 0


if __name__ == "__main__":
    run_main(main)
