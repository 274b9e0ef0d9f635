"""Benchmark results: per-request samples, per-batch runs, and the Markdown report."""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone

HF_STATIC = "HF generate, static batch"
BASELINE = "baseline"
MODEL_NAME = "SmolLM2-135M-Instruct"


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request: seconds to the first streamed event, seconds to the end, output tokens."""

    ttft: float
    latency: float
    tokens: int


@dataclass(frozen=True)
class Run:
    """One batch of requests sent to one system at one concurrency."""

    system: str
    concurrency: int
    wall: float
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall

    def ttft(self, q: float) -> float:
        return percentile([s.ttft for s in self.samples], q)

    def latency(self, q: float) -> float:
        return percentile([s.latency for s in self.samples], q)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in [0, 100])."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---- report ----------------------------------------------------------------------------------


def find(runs: list[Run], system: str, concurrency: int) -> Run | None:
    return next((r for r in runs if r.system == system and r.concurrency == concurrency), None)


def ratio_line(label: str, num: float | None, den: float | None, target: str, why_missing: str = "") -> str:
    if num is None or den is None or den == 0:
        return f"| {label} | n/a{f' ({why_missing})' if why_missing else ''} | {target} |"
    value = num / den
    return f"| {label} | {value:.2f} | {target} |"


def tok_s(run: Run | None) -> float | None:
    return run.tok_s if run else None


def ratios(runs: list[Run], concurrency: int, tf_blocker: str) -> list[str]:
    sb_hi, sb_1 = find(runs, "switchboard", concurrency), find(runs, "switchboard", 1)
    tf_hi = find(runs, "transformers serve", concurrency)
    hf = next((r for r in runs if r.system == HF_STATIC), None)
    return [
        "| ratio | value | target |",
        "|---|---:|---|",
        ratio_line(f"Switchboard tok/s ÷ transformers serve tok/s (concurrency {concurrency})",
                   tok_s(sb_hi), tok_s(tf_hi), "≥ 1.5", "transformers serve did not run" if tf_blocker else ""),
        ratio_line(f"Switchboard tok/s (concurrency {concurrency}) ÷ HF static batch tok/s",
                   tok_s(sb_hi), tok_s(hf), "≥ 1.0"),
        ratio_line(f"Switchboard TTFT p50, concurrency {concurrency} ÷ concurrency 1",
                   sb_hi.ttft(50) if sb_hi else None, sb_1.ttft(50) if sb_1 else None, "≤ 3"),
    ]


def header(args: argparse.Namespace, command: str, elapsed: float) -> list[str]:
    import torch
    import transformers

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"`{command}` — {args.requests} requests (distinct short prompts), {args.tokens} greedy new tokens each, "
        f"{MODEL_NAME}, float32, CPU ({os.cpu_count()} cores, {platform.machine()}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {when}, run time {elapsed / 60:.1f} min:",
        "",
        "| system | concurrency | output tokens | output tok/s | TTFT p50 (s) | TTFT p90 (s) | latency p50 (s) | latency p90 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]


def baseline_report(runs: list[Run], args: argparse.Namespace, command: str, elapsed: float) -> str:
    """Every run, then this tree ÷ baseline per round and concurrency (tok/s and TTFT p50)."""
    lines = header(args, command, elapsed)
    for r in runs:
        lines.append(f"| {r.system} | {r.concurrency} | {r.tokens} | {r.tok_s:.1f} | {r.ttft(50):.2f} "
                     f"| {r.ttft(90):.2f} | {r.latency(50):.2f} | {r.latency(90):.2f} |")
    lines += ["", "| round | concurrency | tok/s this tree ÷ baseline | TTFT p50 this tree ÷ baseline |",
              "|---:|---:|---:|---:|"]
    for r in runs:
        if not r.system.startswith("switchboard (round"):
            continue
        round_no = r.system.split("round ")[1].rstrip(")")
        base = find(runs, f"{BASELINE} (round {round_no})", r.concurrency)
        if base:
            lines.append(f"| {round_no} | {r.concurrency} | {r.tok_s / base.tok_s:.3f} | "
                         f"{r.ttft(50) / base.ttft(50):.3f} |")
    return "\n".join([*lines, ""])


def render(runs: list[Run], args: argparse.Namespace, command: str, elapsed: float, tf_blocker: str) -> str:
    lines = header(args, command, elapsed)
    for r in runs:
        shown = f"{r.concurrency} (one batch)" if r.system == HF_STATIC else str(r.concurrency)
        lines.append(f"| {r.system} | {shown} | {r.tokens} | {r.tok_s:.1f} | {r.ttft(50):.2f} | {r.ttft(90):.2f} "
                     f"| {r.latency(50):.2f} | {r.latency(90):.2f} |")
    if tf_blocker:
        lines.append(f"| transformers serve | — | did not run: {tf_blocker.splitlines()[0]} | | | | | |")
    return "\n".join([*lines, *short_runs(runs, args.requests * args.tokens), "",
                      *ratios(runs, args.concurrency, tf_blocker), ""])


def short_runs(runs: list[Run], expected: int) -> list[str]:
    """A note for each run whose requests ended early (EOS), so its token count is lower."""
    notes = [f"Note: {r.system} at concurrency {r.concurrency} made {r.tokens} of {expected} tokens "
             f"(some requests ended at EOS)." for r in runs if r.tokens < expected]
    return ["", *notes] if notes else []
