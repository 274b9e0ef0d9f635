"""The engine's step in process on cuda (no NATS, no HTTP), for bench/gpu_bench.py: decode steps at a few row
counts (step time, launches from the host, the GPU's busy share) and a Mix step as step graphs against eagerly."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def step_profile(model_dir: Path, rows_list: list[int], graphs: bool = True) -> list[dict]:
    from services.engine.devices import Device, kv_budget_bytes
    from services.engine.engine import Engine
    from services.engine.graphs import GraphPlan
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import Limits
    from shared.messages import EngineRequest, Sampling

    device = Device("cuda", torch.bfloat16)
    top = max(rows_list)
    runner = ModelRunner(str(model_dir), device, block_size=16, kv_budget_bytes=lambda: kv_budget_bytes(device, 0, -1),
                         max_blocks=top * 128, batch_hint=top,
                         graphs=GraphPlan(top, 2048, max_tokens=MIX_CHUNK + top) if graphs else None)
    engine = Engine(runner, Limits(top, top, 1 << 16, 2048), set(), steps_ahead=graphs)
    ahead = engine.ahead  # each step read back first; then, with graphs, launched ahead
    results = []
    for rows in rows_list:
        engine.ahead = None
        for i in range(rows):
            ids = [100 + (i * 37 + j * 11) % 40000 for j in range(32)]
            engine.add_request(EngineRequest(id=f"p{rows}-{i}", prompt_ids=ids, reply_to="x",
                                             sampling=Sampling(do_sample=False, max_new_tokens=400, ignore_eos=True)))
        for _ in range(5):  # the prefill, then decode steps
            engine.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            engine.step()
        step_s = (time.perf_counter() - started) / 20
        launches, kernel_s = profile_steps(engine, 5)
        replay_s = replay_time(runner, rows)
        busy = (replay_s if replay_s is not None else kernel_s) / step_s
        results.append({"rows": rows, "step_ms": step_s * 1000, "launches_per_step": launches,
                        "gpu_busy": min(1.0, busy), "kernel_ms_profiled": kernel_s * 1000, "graph": graphs,
                        "replay_ms": None if replay_s is None else replay_s * 1000})
        print(f"[step] {rows} rows{' (graphs)' if graphs else ' (eager)'}: {step_s * 1000:.2f} ms, "
              f"{launches:.0f} launches, GPU busy {100 * busy:.0f}%", flush=True)
        if ahead is not None:
            results.append(ahead_profile(engine, ahead, rows, replay_s))
        for i in range(rows):
            engine.abort(f"p{rows}-{i}")
        engine.step()
    if graphs:
        results += mixed_profile(runner)
    del engine, runner
    torch.cuda.empty_cache()
    return results


MIX_CHUNK = 128  # the shipped prefillChunkSize


def ahead_profile(engine, ahead, rows: int, replay_s: float | None) -> dict:
    """The same decode steps, each launched before the last one's tokens are read back (ahead.py): wall time
    per step, launches from the host and the GPU's busy share. The last flight lands when the rows are cancelled."""
    engine.ahead = ahead
    launched = ahead.launches
    engine.step()
    started = time.perf_counter()
    for _ in range(20):
        engine.step()
    step_s = (time.perf_counter() - started) / 20
    launches, kernel_s = profile_steps(engine, 5)
    assert ahead.launches - launched == 26, "a decode step was not launched ahead"
    busy = (replay_s if replay_s is not None else kernel_s) / step_s
    print(f"[step] {rows} rows (graphs, launched ahead): {step_s * 1000:.2f} ms, {launches:.0f} launches, "
          f"GPU busy {100 * busy:.0f}%", flush=True)
    return {"rows": rows, "step_ms": step_s * 1000, "launches_per_step": launches, "gpu_busy": min(1.0, busy),
            "kernel_ms_profiled": kernel_s * 1000, "graph": True, "ahead": True,
            "replay_ms": None if replay_s is None else replay_s * 1000}


def mixed_profile(runner, decodes: int = 16, prompts: int = 4, prompt_len: int = 32, steps: int = 8) -> list[dict]:
    """A Mix step (``decodes`` decode rows beside ``prompts`` new prompts in one chunk), as step graphs
    between the attentions and eagerly (the same runner with its step graphs set aside): wall time per
    step and launches from the host."""
    from services.engine.engine import Engine
    from services.engine.scheduler import Limits
    from shared.messages import EngineRequest, Sampling

    engine = Engine(runner, Limits(64, 64, 1 << 16, 2048, mix=True, prefill_chunk_size=MIX_CHUNK), set())

    def add(rid, n, tokens):
        ids = [100 + (hash(rid) + j * 11) % 40000 for j in range(n)]
        engine.add_request(EngineRequest(id=rid, prompt_ids=ids, reply_to="x",
                                         sampling=Sampling(do_sample=False, max_new_tokens=tokens, ignore_eos=True)))

    for i in range(decodes):
        add(f"d{i}", 32, 4000)
    for _ in range(4):
        engine.step()
    pieces, results = runner.pieces, []
    for mode in ("graphs", "eager"):
        runner.pieces = pieces if mode == "graphs" else None
        times, launches = [], []
        for k in range(steps + 1):
            new = [f"{mode}{k}-{j}" for j in range(prompts)]
            for rid in new:
                add(rid, prompt_len, 1)
            torch.cuda.synchronize()
            if k == steps:
                launches.append(profile_steps(engine, 1)[0])
            else:
                started = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            engine.step()  # the new prompts' one token is out: they finish
        step_ms = 1000 * statistics.median(times)
        results.append({"rows": f"{decodes}+{prompts}x{prompt_len}", "step_ms": step_ms, "graph": mode == "graphs",
                        "launches_per_step": launches[0], "gpu_busy": 0.0, "mixed": True})
        print(f"[mixed] {decodes} decodes + {prompts} prompts of {prompt_len} ({mode}): {step_ms:.2f} ms, "
              f"{launches[0]:.0f} launches", flush=True)
    runner.pieces = pieces
    for i in range(decodes):
        engine.abort(f"d{i}")
    engine.step()
    return results


def replay_time(runner, rows: int) -> float | None:
    """Seconds of GPU work of the step's graph: replays queued back to back keep the GPU busy, so
    their time is the graph's own (None without graphs)."""
    graphs = runner.graphs
    if graphs is None or not graphs.graphs:
        return None
    graph, _ = graphs.graphs[graphs.bucket(rows)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / 20


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC",
            "cudaMemcpyAsync", "cudaMemsetAsync")


def profile_steps(engine, steps: int) -> tuple[float, float]:
    """Launches from the host (kernels, graphs, copies) and seconds of GPU kernel time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    launches = kernel_us = 0.0
    by_name: dict[str, float] = {}
    for event in prof.events():
        if event.name in LAUNCHES:
            launches += 1
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += event.device_time
            by_name[event.name[:60]] = by_name.get(event.name[:60], 0.0) + event.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    print("[step] GPU time per step by kernel: " + "; ".join(f"{name} {us / steps:.0f} us" for name, us in top), flush=True)
    return launches / steps, kernel_us / 1e6 / steps
