"""The Markdown report of bench/peers_bench.py: machine, ceilings, each system, round-by-round ratios."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timezone
from statistics import median
from typing import TYPE_CHECKING, Iterable

from ceiling import Ceiling  # bench/ceiling.py
from engine_bench import CONFIG, ROOT  # bench/engine_bench.py
from results import MODEL_NAME  # bench/results.py

if TYPE_CHECKING:
    from peers_bench import Result, Table, Watch
    from peers_workloads import Plan, Prefix, Prompts

SYSTEMS = ("switchboard", "vllm")
IDLE_LIMIT = 0.05  # cores: more than this from the idle server while the other is measured gets a warning

def cpu() -> tuple[str, list[str]]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return fields.get("Model name", "?").strip(), [f for f in flags if re.match(r"avx|amx|fma$|f16c$", f)]


def schedule() -> str:
    cfg = json.loads(CONFIG.read_text())["BackendConfig"]["ScheduleConfig"]
    return ", ".join(f"{k} {cfg[k]}" for k in ("templateType", "prefillChunkSize", "maxPrefillTokens") if k in cfg)


def git_head() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.stdout.strip() else "")



COLUMNS = [("tok_s_n", "c{n} tok/s", ".1f"), ("frac_n", "÷ ceiling", ".2f"), ("tok_s_1", "c1 tok/s", ".1f"),
           ("frac_1", "÷ ceiling", ".2f"), ("ttft_n", "TTFT p50 c{n} (s)", ".3f"),
           ("latency_n", "latency p50 c{n} (s)", ".2f"), ("ttft_1", "TTFT p50 c1 (s)", ".3f"),
           ("latency_1", "latency p50 c1 (s)", ".2f"), ("long_ttft", "long-prompt TTFT (s)", ".2f"),
           ("stall", "stall (max ÷ median gap)", ".1f"), ("prefix_on", "prefix TTFT p50, cache on (s)", ".3f"),
           ("prefix_off", "cache off (s)", ".3f"), ("prefix_gain", "off ÷ on", ".2f")]
ROUND_KEYS = ("tok_s_n", "ttft_n", "latency_n", "tok_s_1", "ttft_1", "latency_1")  # measured every round
ROUND_COLUMNS = [("tok_s_n", "c{n} tok/s", ".1f"), ("tok_s_1", "c1 tok/s", ".1f"),
                 ("ttft_n", "TTFT p50 c{n} (s)", ".3f"), ("ttft_1", "TTFT p50 c1 (s)", ".3f")]
RATIOS = [("tok_s_n", "c{n} tok/s"), ("tok_s_1", "c1 tok/s"), ("ttft_n", "TTFT p50 c{n} (≤ 1 good)"),
          ("long_ttft", "long-prompt TTFT"), ("stall", "stall"), ("prefix_on", "prefix TTFT p50, cache on")]


def div(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def median_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return median(present) if present else None


def cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def same_texts(a: Prefix | None, b: Prefix | None) -> str:
    return "—" if not (a and b) else f"{sum(x == y for x, y in zip(a.texts, b.texts))}/{len(a.texts)}"


def round_metrics(t: Table, n: int) -> dict[str, float | None]:
    hi, one = t.runs.get(n), t.runs.get(1)
    return {"tok_s_n": hi and hi.tok_s, "ttft_n": hi and hi.ttft(50), "latency_n": hi and hi.latency(50),
            "tok_s_1": one and one.tok_s, "ttft_1": one and one.ttft(50), "latency_1": one and one.latency(50)}


def metrics(r: Result, n: int, ceiling: Ceiling) -> dict[str, float | None]:
    """The table metrics as medians over the rounds; the long-prompt and shared-prefix ones as measured."""
    per_round, on, off = [round_metrics(t, n) for t in r.tables], r.prefix.get(True), r.prefix.get(False)
    m = {**{k: median_of(x[k] for x in per_round) for k in ROUND_KEYS},
         "long_ttft": r.long and r.long.ttft, "stall": r.long and r.long.stall,
         "prefix_on": on and on.ttft_p50, "prefix_off": off and off.ttft_p50}
    return {**m, "frac_n": div(m["tok_s_n"], ceiling.cn(r.dtype, n)), "frac_1": div(m["tok_s_1"], ceiling.c1(r.dtype)),
            "prefix_gain": div(m["prefix_off"], m["prefix_on"])}


def round_ratios(sb: Result, vl: Result, n: int) -> dict[int, dict[str, float | None]]:
    """Switchboard ÷ vLLM in every round both ran (the two measurements adjacent in time), by round."""
    theirs = {t.round: round_metrics(t, n) for t in vl.tables}
    ratios = {}
    for t in sb.tables:
        if t.round in theirs:
            mine = round_metrics(t, n)
            ratios[t.round] = {k: div(mine[k], theirs[t.round][k]) for k in ROUND_KEYS}
    return ratios


def pair_of(results: list[Result], dtype: str) -> list[Result]:
    """This dtype's results, Switchboard before vLLM."""
    return [r for s in SYSTEMS for r in results if r.system == s and r.dtype == dtype]


def ceiling_table(ceilings: dict[str, Ceiling], n: int) -> list[str]:
    lines = [row(["measured", "dtype", "memory read GB/s", "matmul GFLOP/s", "weight MB/step", "GFLOP/token",
                  "c1 ceiling tok/s", f"c{n} ceiling tok/s"]), "|---|---|" + "---:|" * 6]
    for when, c in ceilings.items():
        for d, peak in c.peak.items():
            lines.append(row([when, d, f"{c.bandwidth / 1e9:.1f}", f"{peak / 1e9:.0f}",
                              f"{c.weight_bytes(d) / 1e6:.0f}", f"{2 * c.params / 1e9:.3f}", f"{c.c1(d):.0f}",
                              f"{c.cn(d, n):.0f}"]))
    return lines


def system_table(results: list[Result], n: int, ceiling: Ceiling) -> list[str]:
    lines = [row(["system", "dtype", *(h.format(n=n) for _, h, _ in COLUMNS), "texts on = off"]),
             "|---|---|" + "---:|" * (len(COLUMNS) + 1)]
    for r in results:
        m = metrics(r, n, ceiling)
        lines.append(row([r.system, r.dtype, *(cell(m[k], fmt) for k, _, fmt in COLUMNS),
                          same_texts(r.prefix.get(True), r.prefix.get(False))]))
    return lines + [f"\n{r.name}: blocked: {b}" for r in results for b in r.blocked]


def rounds_table(results: list[Result], dtype: str, n: int) -> list[str]:
    """Per round: each system's table metrics, Switchboard ÷ vLLM and the matmul probe; then the medians."""
    shown = [r for r in pair_of(results, dtype) if r.tables]
    if not shown:
        return []
    both = len(shown) == 2
    ratios = round_ratios(*shown, n) if both else {}
    head = ["round", "order"]
    for _, h, _ in ROUND_COLUMNS:
        head += [f"{r.system} {h.format(n=n)}" for r in shown] + (["÷"] if both else [])
    lines = [f"{dtype}, round by round{' (÷ = Switchboard ÷ vLLM within the round)' if both else ''}:", "",
             row([*head, f"{dtype} matmul GFLOP/s before"]), "|---:|---|" + "---:|" * (len(head) - 1)]
    for k in sorted({t.round for r in shown for t in r.tables}):
        tables = [next((t for t in r.tables if t.round == k), None) for r in shown]
        per = [t and round_metrics(t, n) for t in tables]
        cells = [str(k), " → ".join(s for _, s in sorted((t.position, r.system) for r, t in zip(shown, tables) if t))]
        for key, _, fmt in ROUND_COLUMNS:
            cells += [cell(m and m[key], fmt) for m in per]
            cells += [cell(ratios.get(k, {}).get(key), ".2f")] if both else []
        lines.append(row([*cells, f"{next(t.probe for t in tables if t) / 1e9:.0f}"]))
    cells = ["median", ""]
    for key, _, fmt in ROUND_COLUMNS:
        cells += [cell(median_of(round_metrics(t, n)[key] for t in r.tables), fmt) for r in shown]
        cells += [cell(median_of(x[key] for x in ratios.values()), ".2f")] if both else []
    return [*lines, row([*cells, ""]), ""]


def peer_ratios(results: list[Result], n: int, ceiling: Ceiling) -> list[str]:
    lines = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        pair = pair_of(results, dtype)
        if len(pair) == 2:
            (sb, vl), per_round = pair, round_ratios(*pair, n)
            a, b = metrics(sb, n, ceiling), metrics(vl, n, ceiling)
            values = [median_of(x[k] for x in per_round.values()) if k in ROUND_KEYS else div(a[k], b[k])
                      for k, _ in RATIOS]
            lines.append(row([dtype, *(cell(v, ".2f") for v in values), str(len(per_round) or "—"),
                              same_texts(sb.prefix.get(True), vl.prefix.get(True))]))
    header = row(["Switchboard ÷ vLLM", *(h.format(n=n) for _, h in RATIOS), "rounds paired",
                  "prefix texts Switchboard = vLLM"])
    note = (f"c{n} tok/s, c1 tok/s and TTFT p50 c{n}: the median of the per-round ratios; the others: one "
            "measurement each.")
    return [header, "|---|" + "---:|" * (len(RATIOS) + 2), *lines, "", note, ""] if lines else []


def idle_summary(watches: list[Watch]) -> list[str]:
    """Per server: the most and the mean of a core it took while idle; a loud warning above IDLE_LIMIT."""
    shares: dict[str, list[float]] = {}
    for w in watches:
        for system in w.idle:
            shares.setdefault(f"{system} {w.dtype}", []).append(w.cores(system))
    lines = []
    for name, values in shares.items():
        top, mean = max(values), sum(values) / len(values)
        lines.append(f"Idle {name} server, while the other was measured: at most {100 * top:.1f}% of a core, "
                     f"mean {100 * mean:.1f}%, over {len(values)} measurement(s).")
        if top > IDLE_LIMIT:
            lines.append(f"**WARNING: the idle {name} server took up to {100 * top:.1f}% of a core (limit "
                         f"{100 * IDLE_LIMIT:.0f}%) while the other system was measured: it competes for the CPU, "
                         "so the interleaved measurements are biased against the measured system.**")
    return lines


def cpu_table(watches: list[Watch]) -> list[str]:
    if not watches:
        return []
    lines = ["CPU seconds of each server's process tree over each measurement ÷ its wall time:", "",
             row(["dtype", "measured", "workload", "waited for quiet (s)", "wall (s)", "measured tree (cores)",
                  "idle server", "idle tree (% of a core)"]), "|---|---|---|---:|---:|---:|---|---:|"]
    for w in watches:
        lines.append(row([w.dtype, w.measured, w.what, f"{w.settled:.1f}", f"{w.wall:.1f}",
                          f"{w.cores(w.measured):.2f}",
                          ", ".join(w.idle) or "—", ", ".join(f"{100 * w.cores(s):.1f}" for s in w.idle) or "—"]))
    return [*lines, ""]


def render(results: list[Result], ceilings: dict[str, Ceiling], plan: Plan, prompts: Prompts, notes: list[str],
           command: str, rounds: int, watches: list[Watch]) -> str:
    n, model, flags = plan.concurrency, *cpu()
    lengths = [prompts.count(p) for p in prompts.table]
    lines = [f"`{command}` — {MODEL_NAME}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, git {git_head()}",
             f"CPU: {model}; vector flags: {' '.join(flags)}", "",
             f"table: {plan.requests} requests at c{n} then {plan.single} at c1, prompts of {min(lengths)}-"
             f"{max(lengths)} tokens, {plan.tokens} tokens each (ignore_eos), in {rounds} rounds with the servers up "
             "together, the order alternating each round; the systems' table columns are medians over the rounds, "
             f"\"÷ ceiling\" against the start ceiling. long: {plan.decoders} decoders of {plan.decoder_tokens} "
             f"tokens + one {prompts.count(prompts.long[1])}-token prompt. prefix: {plan.prefix_requests} requests "
             f"at c{plan.prefix_concurrency}, {prompts.count(prompts.shared[0])}-token prompts sharing "
             f"{plan.prefix_len} tokens, {plan.prefix_tokens} tokens each.",
             f"Switchboard: config/config.json with the dtype and enablePrefixCache set ({schedule()}); vLLM: "
             "`serve --max-model-len 4096`, VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND=0-1.", *notes,
             *idle_summary(watches), "", *ceiling_table(ceilings, n), "",
             *system_table(results, n, ceilings["start"]), ""]
    for dtype in dict.fromkeys(r.dtype for r in results):
        lines += rounds_table(results, dtype, n)
    return "\n".join([*lines, *peer_ratios(results, n, ceilings["start"]), *cpu_table(watches)])
