"""Structured output's cost: throughput at concurrency 16 with every request JSON-constrained against the
same requests unconstrained, in one run on one deployment.

Each round sends ``--concurrency`` chat requests at once (SmolLM2-135M-Instruct, sampling at temperature 0.9,
a seed each) and measures generated tokens per second from the first request to the last answer. The
constrained requests carry a ``json_schema`` ``response_format`` (a list of at least 40 people: the grammar
never completes within ``--max-tokens``), the free ones ``ignore_eos``, so both generate exactly
``--max-tokens`` tokens each: the difference is the grammar's masks alone. Rounds alternate (the order
reversed every other round) and the ratio is the median of per-round ratios.

    .venv/bin/python bench/structured_bench.py [--rounds 3]

Prints a Markdown report (also written to .cache/bench/structured.md).
"""

from __future__ import annotations

import argparse
import asyncio
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
OUT = ROOT / ".cache" / "bench" / "structured.md"
PEOPLE = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"], "additionalProperties": False}}
MODES = {
    "unconstrained": {"ignore_eos": True},
    "JSON-constrained": {"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}},
}


async def one(client: httpx.AsyncClient, base: str, prompt: str, seed: int, tokens: int, extra: dict) -> int:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.9, "seed": seed, **extra}
    r = await client.post(base + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def round_(base: str, args, mode: str, nonce: str) -> float:
    """Generated tokens per second of one round of ``args.concurrency`` requests at once."""
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, base, f"{nonce} {i}: list some people with their age and city.",
                                            i, args.max_tokens, MODES[mode]) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    assert all(c == args.max_tokens for c in counts), counts  # like for like: every request ran to max_tokens
    return sum(counts) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    from tests.conftest import SMOL_DIR
    from tests.integration.cluster import Cluster

    folder = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    cluster = Cluster(folder, SMOL_DIR, engines=1, tokenizers=1, Switchboard={"kvCacheMemoryMb": 512})
    try:
        cluster.wait_ready(600)
        results = alternate(list(MODES), args.rounds,
                            lambda mode, label: asyncio.run(round_(cluster.base, args, mode, label)),
                            lambda rate: f"{rate:.1f} tok/s")
    finally:
        cluster.stop()
    report(args, results)
    return 0


def report(args, results: dict[str, list[float]]) -> None:
    model, flags = cpu()
    free, constrained = results["unconstrained"], results["JSON-constrained"]
    lines = [f"# Structured output throughput (git {git_head()})", "", f"CPU: {model}; flags: {' '.join(flags)}",
             f"Workload: {args.concurrency} concurrent chat requests, {args.max_tokens} tokens each, temperature 0.9; "
             f"SmolLM2-135M float32, one engine; {args.rounds} rounds, alternating.", "",
             "| requests | tok/s per round | median |", "|---|---|---|"]
    for mode, rates in results.items():
        lines.append(f"| {mode} | {', '.join(f'{r:.1f}' for r in rates)} | {statistics.median(rates):.1f} |")
    ratio = statistics.median(c / f for c, f in zip(constrained, free))
    lines += ["", f"JSON-constrained ÷ unconstrained: **{ratio:.2f}×** (target ≥ 0.9×)"]
    publish(OUT, lines)


if __name__ == "__main__":
    run_main(main)
