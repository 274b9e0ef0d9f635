"""Prefill/decode disaggregation: 1 prefill + 1 decode engine against 2 co-located engines, in one run.

Workload (the one disaggregation is for): ``--decoders`` streams with short prompts decode
``--decode-tokens`` tokens each, and while they run, ``--long`` requests with ~``--prompt-tokens``-token
prompts arrive every ``--gap`` seconds (``--long-tokens`` new tokens each). Measured per deployment:
the long requests' time to first token (median), the short streams' decode tokens/s (all their tokens
over the time from the first to the last), and, for the PD deployment, the K/V transfer time per
1,000 prompt tokens from the ``kv_transfer_seconds`` histogram. Both deployments are separate
processes on their own nats-server with one torch thread per engine; rounds alternate between them
(the order reversed every other round) and ratios are medians of per-round ratios.

    .venv/bin/python bench/pd_bench.py [--rounds 3]

Prints a Markdown report (also written to .cache/bench/pd.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peers_report import cpu, git_head  # noqa: E402
from processes import run_main  # noqa: E402
from results import MODEL_NAME  # noqa: E402
from rounds import alternate, publish  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench" / "pd.md"
DEPLOYMENTS = {
    "2 co-located engines": {"engine-0": ["--role", "both", "--torch-threads", "1"],
                             "engine-1": ["--role", "both", "--torch-threads", "1"]},
    "1 prefill + 1 decode": {"engine-0": ["--role", "prefill", "--torch-threads", "1"],
                             "engine-1": ["--role", "decode", "--torch-threads", "1"]},
}


async def stream(client: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, arrival times of every token) of one streaming /v1/completions."""
    started = time.perf_counter()
    times: list[float] = []
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                if choices[0].get("text"):
                    times.append(time.perf_counter())
    return times[0] - started, times


async def round_(base: str, args, nonce: str) -> tuple[float, float]:
    """(median TTFT of the long prompts, decode tokens/s of the short streams) of one round; ``nonce``
    starts every prompt, so no round finds another's prompts in the prefix cache."""
    long_prompt = "Summarise this: " + "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 10)
    async with httpx.AsyncClient(timeout=600) as client:
        decoders = [asyncio.create_task(stream(client, base, f"{nonce} Story {i}: once upon a time", args.decode_tokens))
                    for i in range(args.decoders)]
        await asyncio.sleep(1.0)
        longs = []
        for i in range(args.long):
            longs.append(asyncio.create_task(stream(client, base, f"{nonce} {i} {long_prompt}", args.long_tokens)))
            await asyncio.sleep(args.gap)
        long_results = await asyncio.gather(*longs)
        decode_results = await asyncio.gather(*decoders)
    stamps = sorted(t for _, times in decode_results for t in times)
    rate = len(stamps) / (stamps[-1] - stamps[0])
    return statistics.median(ttft for ttft, _ in long_results), rate


def transfer_per_1000(cluster, prompt_tokens: int) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    port = json.loads(cluster.config.read_text())["ServerConfig"].get("metricsPort", 1027)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == "kv_transfer_seconds"
              for s in f.samples if s.name.endswith(("_sum", "_count"))}
    count = values.get("kv_transfer_seconds_count", 0)
    return None if not count else values["kv_transfer_seconds_sum"] / count / prompt_tokens * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decoders", type=int, default=6)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--long-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=1.0)
    args = parser.parse_args()

    from tests.conftest import SMOL_DIR
    from tests.integration.cluster import Cluster

    work = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    clusters = {}
    try:
        for n, (name, engine_args) in enumerate(DEPLOYMENTS.items()):
            folder = work / f"d{n}"
            folder.mkdir()
            clusters[name] = Cluster(folder, SMOL_DIR, engines=2, tokenizers=1, args=engine_args,
                                     Switchboard={"kvCacheMemoryMb": 512}).wait_ready(600)
            clusters[name].wait_started("engine-1", 1)
        results = alternate(list(DEPLOYMENTS), args.rounds,
                            lambda name, label: asyncio.run(round_(clusters[name].base, args, label)),
                            lambda r: f"long-prompt TTFT {r[0]:.2f} s, decode {r[1]:.1f} tok/s")
        transfer = transfer_per_1000(clusters["1 prefill + 1 decode"], args.prompt_tokens)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    report(args, results, transfer)
    return 0


def report(args, results: dict[str, list[tuple[float, float]]], transfer: float | None) -> None:
    model, flags = cpu()
    co, pd = results["2 co-located engines"], results["1 prefill + 1 decode"]
    lines = [f"# Prefill/decode disaggregation (git {git_head()})", "", f"CPU: {model}; flags: {' '.join(flags)}",
             f"Workload: {args.decoders} streams decoding {args.decode_tokens} tokens; meanwhile {args.long} prompts "
             f"of ~{args.prompt_tokens} tokens ({args.long_tokens} new tokens) every {args.gap:g} s; SmolLM2-135M "
             f"float32, one torch thread per engine; {args.rounds} rounds, alternating.", "",
             "| deployment | long-prompt TTFT (median) | decode tok/s (median) |", "|---|---|---|"]
    for name, rows in results.items():
        lines.append(f"| {name} | {statistics.median(t for t, _ in rows):.2f} s | "
                     f"{statistics.median(r for _, r in rows):.1f} |")
    lines += ["", f"PD ÷ co-located: TTFT **{statistics.median(p[0] / c[0] for p, c in zip(pd, co)):.2f}×**, "
                  f"decode tok/s **{statistics.median(p[1] / c[1] for p, c in zip(pd, co)):.2f}×**",
              f"K/V transfer per 1,000 prompt tokens: {transfer * 1000:.1f} ms" if transfer is not None else
              "K/V transfer: no transfer recorded"]
    publish(OUT, lines)


if __name__ == "__main__":
    run_main(main)
