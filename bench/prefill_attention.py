"""The CPU paged prefill attention (services/engine/csrc/prefill.cpp) against what the engine ran before it
(the cached positions gathered, SDPA with an offset causal mask), side by side in one run:

    .venv/bin/python bench/prefill_attention.py [--threads 1]

1. The kernel alone, at SmolLM2-135M's shape (9 query and 3 KV heads of 64) and Llama-8B's (32 and 8 of 128):
   prompt pieces after a cached prefix, bfloat16 and float32; the largest difference from float32 SDPA.
2. In process, the default model: a conversation's turns (60 new tokens on a 550-790-token cached history, Mix
   steps of 128 prompt tokens), timed with the kernel and with SDPA per chunk, alternating.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers_report import cpu  # noqa: E402

SHAPES = [(98, 550, 9, 3, 64), (300, 1000, 9, 3, 64), (128, 2048, 32, 8, 128)]  # rows, cached, heads, KV heads, dim


def timed(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def kernel_rows(ops, dtype: torch.dtype) -> list[str]:
    rows = []
    for n, ctx, heads, kv_heads, dim in SHAPES:
        torch.manual_seed(0)
        block, length = 128, ctx + n
        blocks = -(-length // block) + 4
        k = torch.randn(kv_heads, blocks * block, dim, dtype=dtype)
        v = torch.randn_like(k)
        table = torch.randperm(blocks)[: -(-length // block)].tolist()
        q = torch.randn(n, (heads + 2 * kv_heads) * dim, dtype=dtype)[:, : heads * dim]
        out = torch.empty(n, heads * dim, dtype=dtype)
        plan = ops.prefill_plan([(0, ctx, n, table)], block, q.device)
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in table])[:length]
        mask = torch.arange(length)[None, :] <= (ctx + torch.arange(n))[:, None]
        scale = dim ** -0.5

        def sdpa(q=q, dt=dtype):
            query = q.to(dt).reshape(n, heads, dim).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(query, k[:, slots].to(dt)[None], v[:, slots].to(dt)[None],
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1).reshape(n, heads * dim)

        ops.paged_prefill(q, k, v, plan, out, block, heads, kv_heads, dim, scale)
        err = (out.float() - sdpa(dt=torch.float32)).abs().max().item()
        ours = timed(lambda: ops.paged_prefill(q, k, v, plan, out, block, heads, kv_heads, dim, scale))
        theirs = timed(sdpa)
        rows.append(f"| {str(dtype).split('.')[-1]} | {n} rows after {ctx} | {heads}/{kv_heads} x {dim} | "
                    f"{ours:.2f} ms | {theirs:.2f} ms | **{theirs / ours:.2f}x** | {err:.1e} |")
    return rows


def hit_turns(threads: int) -> list[str]:
    from services.engine.devices import resolve_device
    from services.engine.engine import Engine, Limits
    from services.engine.model_runner import ModelRunner
    from shared.messages import EngineRequest, Sampling
    from tests.conftest import SMOL_DIR

    runner = ModelRunner(str(SMOL_DIR), resolve_device("cpu", "bfloat16"), block_size=128,
                         kv_budget_bytes=256 << 20, max_blocks=1000, batch_hint=128)
    engine = Engine(runner, Limits(128, 128, 8192, 2048, mix=True, prefill_chunk_size=128), {2}, prefix_cache=True)
    count = [0]

    def request(ids: list[int]) -> float:
        count[0] += 1
        engine.add_request(EngineRequest(id=f"r{count[0]}", prompt_ids=ids, reply_to="x",
                                         sampling=Sampling(do_sample=False, max_new_tokens=1)))
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start

    means = {True: [], False: []}
    for rnd in range(4):
        kernel = rnd % 2 == 0
        runner.plans_prefill = kernel and runner.ops.prefills(runner.dtype, runner.head_dim, runner.kv.quantized)
        history = [100 + (i * 7 + rnd * 31) % 5000 for i in range(550)]  # a new conversation each round
        request(history)
        turns = []
        for t in range(1, 6):
            history = history + [200 + t * 13 + j + rnd for j in range(60)]
            turns.append(request(history))
        means[kernel].append(sum(turns) / len(turns) * 1e3)
    ours, theirs = min(means[True]), min(means[False])
    return [f"| kernel | {ours:.1f} ms |", f"| SDPA per chunk | {theirs:.1f} ms |", "",
            f"kernel vs SDPA: hit turns **{theirs / ours:.2f}x** faster (best of 2 rounds each, 5 turns a round)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from services.engine import kernels

    ops = kernels.for_device(torch.device("cpu"))
    model, flags = cpu()
    lines = [f"CPU: {model}; {' '.join(flags)}; {args.threads} torch thread(s)", "",
             "| dtype | piece | heads | kernel | gather + SDPA | ratio | max abs diff vs float32 SDPA |",
             "|---|---|---|---:|---:|---:|---:|"]
    for dtype in (torch.bfloat16, torch.float32):
        if getattr(ops, "fused", False) and ops.module.prefill_supported(dtype, 64):
            lines += kernel_rows(ops, dtype)
        else:
            lines.append(f"| {dtype} | this CPU's build has no kernel for it | | | | | |")
    lines += ["", "SmolLM2-135M, bfloat16, in process: mean time of a hit turn (60 new tokens, 550-790 cached)", "",
              "| prompt attention | hit turn |", "|---|---:|"]
    lines += hit_turns(args.threads)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
