"""The decode attention alone on a GPU, the 8B shape's layer: a row's positions in pieces at once (flash-decoding)
against one program walking them all, by context length and rows.

    python3 bench/gpu_attention.py [--rows 1,16,64] [--contexts 128,1024,4096,16384] [--split-from 256]
                                   [--out FILE.json]

``TritonOps.paged_decode`` over a bfloat16 paged cache (32 query heads, 8 KV heads of 128, blocks of 16), every
row at the same length, block tables as wide as the longest context (as the decode graphs hold them);
microseconds per call, each timed as a CUDA graph of 50 calls (the best of 5 replays, ``gpu_linears.timed``),
and the K/V GB/s that makes. "pieces": the shipped ``split_from`` (rows longer than 256 positions in up to 16
pieces); "whole": ``split_from`` past the longest row (one program per row and head group, as before).
``--split-from 32,64,128,256`` times each threshold in the same run ("from N"), to choose the shipped one: at one
row a short context walked by one program per head is a chain of dependent loads, in pieces it is a few at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_linears import timed  # noqa: E402
from services.engine.triton_ops import SPLIT_FROM, TritonOps  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def case(rows: int, context: int) -> tuple[tuple, int]:
    """paged_decode's arguments for ``rows`` rows of ``context`` positions, and the K/V bytes they read."""
    blocks = rows * context // BLOCK + 1
    k_cache, v_cache = (torch.randn(KV_HEADS, blocks * BLOCK, DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    tables = torch.randperm(blocks - 1, device="cuda", dtype=torch.int32)[: rows * context // BLOCK]
    tables = tables.reshape(rows, context // BLOCK)
    lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, tables, lens, BLOCK, HEADS, KV_HEADS, DIM, DIM ** -0.5)
    return args, 2 * rows * context * KV_HEADS * DIM * 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--contexts", default="128,1024,4096,16384")
    p.add_argument("--split-from", default=str(SPLIT_FROM), help="thresholds to time besides whole rows")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    modes = {f"from {n}": int(n) for n in args.split_from.split(",") if n} | {"whole": 1 << 30}
    ops, results = TritonOps(), []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            for context in [int(c) for c in args.contexts.split(",") if c]:
                call, nbytes = case(rows, context)
                want = ops.paged_decode(*call, split_from=1 << 30)
                times = {}
                for name, split_from in modes.items():
                    got = ops.paged_decode(*call, split_from=split_from)
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                    times[name] = timed(lambda: ops.paged_decode(*call, split_from=split_from))
                best = min(times, key=times.get)
                results.append(dict(rows=rows, context=context, us=times, best=best,
                                    gb_s=nbytes / times[best] / 1e3))
                print(f"rows {rows:3} context {context:6}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
                      + f"; best {best} ({nbytes / times[best] / 1e3:.0f} GB/s)", flush=True)
                torch.cuda.empty_cache()
    print("| rows | context | " + " | ".join(f"{k} us" for k in modes) + " | best | K/V GB/s (best) |")
    print("|---:|---:|" + "---:|" * len(modes) + "---|---:|")
    for r in results:
        print(f"| {r['rows']} | {r['context']} | " + " | ".join(f"{r['us'][k]:.1f}" for k in modes)
              + f" | {r['best']} | {r['gb_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
