"""The 8B shape's projections alone on a GPU, in each weight format, at a few rows: which kernel wins where.

    python3 bench/gpu_linears.py [--rows 1,4,16,32,64] [--out FILE.json]
    python3 bench/gpu_linears.py --sweep [--rows 1,16]    # fp8_gemv's tiles (triton_fp8.GemvTile) instead

A decode step's time is mostly its products, and at a few rows each product's time is its weights' bytes
over the memory's bandwidth. Per projection of Llama-3.1-8B's layer (qkv 6144 x 4096, o 4096 x 4096,
gate_up 28672 x 4096, down 4096 x 14336) and per row count: bfloat16 (cuBLAS), int4 (``Int4Linear``,
PyTorch's tinygemm kernel), and fp8 four ways: the rows quantized by ``fp8_rows`` then ``torch._scaled_mm``
(cuBLASLt: prompts); ``TritonOps.fp8_gemv`` (decode rows: one launch, the rows quantized as they load and
the column splits summed by the last to finish); the same GEMV in the launches it took before, ``fp8_rows``
then ``fp8_mm`` then the splits' sum ("rows first"); and the rows as they are through ``fp8_mm`` (W8A16:
each weight converted as it loads). Microseconds per call (each timed as a CUDA graph of 50 calls, the best
of 5 replays) and the weights' GB/s that makes. ``quant_cuda.FP8_GEMV_ROWS`` belongs where the GEMV stops
beating cuBLASLt; "rows first" says what the launches cost; W8A16 whether converting the weights costs more
than quantizing the rows. ``--sweep`` times ``fp8_gemv`` alone over its tiles (output channels per program,
warps, programs per processor) and prints the fastest per projection and row count, against the shipped one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.engine.quant_cuda import Fp8Linear, Int4Linear  # noqa: E402
from services.engine.triton_fp8 import GemvTile  # noqa: E402
from services.engine.triton_ops import TritonOps  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS, REPLAYS = 50, 5
FORMATS = ("bfloat16", "int4", "fp8 cuBLASLt", "fp8 GEMV", "fp8 rows first", "fp8 W8A16")


def timed(fn) -> float:
    """Microseconds per call of ``fn`` (no arguments), captured as a graph of CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    best = float("inf")
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def layers(n: int, k: int) -> dict:
    """One projection in each format, from the same random weight."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ops = TritonOps()
    fp8 = Fp8Linear.from_float(weight, None, ops)
    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    dense.weight.data = weight
    return {
        "bfloat16": (dense, weight.numel() * 2),
        "int4": (Int4Linear.from_float(weight), None),
        "fp8 cuBLASLt": (fp8.gemm, fp8.nbytes),
        "fp8 GEMV": (fp8.gemv, fp8.nbytes),
        "fp8 rows first": (lambda x: rows_first(ops, fp8, x), fp8.nbytes),
        "fp8 W8A16": (lambda x: ops.fp8_mm(x, fp8.weight_t.T, fp8.scale.reshape(-1)), fp8.nbytes),
    }


def rows_first(ops: TritonOps, fp8: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The decode rows' fp8 product as it ran before ``fp8_gemv``: the rows quantized (a scale each), then the
    GEMV, then its splits' sum (and the cast)."""
    q, scale = ops.fp8_rows(x)
    return ops.fp8_mm(q, fp8.weight_t.T, fp8.scale.reshape(-1), scale, torch.bfloat16)


TILES = [GemvTile(n, w, p) for n in (32, 64, 128) for w in (4, 8) for p in (2, 4, 8)]


def sweep(rows: list[int]) -> list[dict]:
    """``fp8_gemv`` per tile, projection and row count (checked against the shipped tile's numbers)."""
    ops, results = TritonOps(), []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            fp8 = Fp8Linear.from_float(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None, ops)
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = ops.fp8_gemv(x, fp8.weight_t.T, fp8.scale.reshape(-1), torch.float32)
                for tile in TILES:
                    got = ops.fp8_gemv(x, fp8.weight_t.T, fp8.scale.reshape(-1), torch.float32, tile)
                    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
                    us = timed(lambda: ops.fp8_gemv(x, fp8.weight_t.T, fp8.scale.reshape(-1), torch.bfloat16, tile))
                    results.append(dict(shape=name, rows=m, tile=tuple(tile), us=us, gb_s=fp8.nbytes / us / 1e3))
                mine = [r for r in results if r["shape"] == name and r["rows"] == m]
                best = min(mine, key=lambda r: r["us"])
                shipped = next(r for r in mine if r["tile"] == tuple(GemvTile()))
                print(f"{name:8} rows {m:3}: best {best['tile']} {best['us']:7.1f} us {best['gb_s']:6.0f} GB/s; "
                      f"shipped {shipped['tile']} {shipped['us']:7.1f} us", flush=True)
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,32,64")
    p.add_argument("--sweep", action="store_true", help="fp8_gemv's tiles instead of the formats")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.sweep:
        results = sweep(rows)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
        return 0
    results = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            for fmt, (layer, nbytes) in layers(n, k).items():
                nbytes = nbytes or layer.nbytes
                for m in rows:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    us = timed(lambda: layer(x))
                    results.append(dict(shape=name, format=fmt, rows=m, us=us, gb_s=nbytes / us / 1e3))
                    print(f"{name:8} {fmt:10} rows {m:3}: {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s", flush=True)
            torch.cuda.empty_cache()
    print("| projection | rows | " + " | ".join(f"{f} us" for f in FORMATS) + " |")
    print("|---|---:|" + "---:|" * len(FORMATS))
    for name in SHAPES:
        for m in rows:
            cells = [next(r for r in results if r["shape"] == name and r["rows"] == m and r["format"] == f)["us"]
                     for f in FORMATS]
            print(f"| {name} | {m} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
