"""The decode attention alone on a GPU, the 8B shape's layer: a row's positions in pieces at once (flash-decoding)
against one program walking them all, by context length and rows.

    python3 bench/gpu_attention.py [--rows 1,16,64] [--contexts 128,1024,4096,16384] [--out FILE.json]

``TritonOps.paged_decode`` over a bfloat16 paged cache (32 query heads, 8 KV heads of 128, blocks of 16), every
row at the same length, block tables as wide as the longest context (as the decode graphs hold them);
microseconds per call, each timed as a CUDA graph of 50 calls (the best of 5 replays, ``gpu_linears.timed``),
and the K/V GB/s that makes. "pieces": the shipped ``split_from`` (rows longer than 256 positions in up to 16
pieces); "whole": ``split_from`` past the longest row (one program per row and head group, as before).
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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ops, results = TritonOps(), []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            for context in [int(c) for c in args.contexts.split(",") if c]:
                call, nbytes = case(rows, context)
                want = ops.paged_decode(*call, split_from=1 << 30)
                times = {}
                for name, split_from in (("pieces", SPLIT_FROM), ("whole", 1 << 30)):
                    got = ops.paged_decode(*call, split_from=split_from)
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                    times[name] = timed(lambda: ops.paged_decode(*call, split_from=split_from))
                results.append(dict(rows=rows, context=context, **{f"{k}_us": v for k, v in times.items()},
                                    gb_s=nbytes / times["pieces"] / 1e3))
                print(f"rows {rows:3} context {context:6}: pieces {times['pieces']:8.1f} us, whole "
                      f"{times['whole']:8.1f} us ({times['whole'] / times['pieces']:.2f}x), "
                      f"{nbytes / times['pieces'] / 1e3:6.0f} GB/s", flush=True)
                torch.cuda.empty_cache()
    print("| rows | context | pieces us | whole us | whole / pieces | K/V GB/s (pieces) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']} | {r['context']} | {r['pieces_us']:.1f} | {r['whole_us']:.1f} | "
              f"{r['whole_us'] / r['pieces_us']:.2f}x | {r['gb_s']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
