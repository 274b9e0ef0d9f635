"""fp8 e4m3 as Triton kernels (``TorchOps`` signatures; ``TritonOps`` takes them as its own): a row's
quantization to e4m3 with its scale, and the products of a decode step's few rows with e4m3 weights.

``fp8_mm`` is a GEMV more than a GEMM: at a few rows a product's time is its weights' bytes, so its programs
are the output tiles times enough splits of the columns to give each of the device's processors two (a
GEMM kernel made for many rows leaves most of them idle at one row), the parts' float32 sums added after.

``to_dtype``, ``rounded`` and ``pow2`` are the helpers the other kernels (``triton_ops.py``) share with these.
``TRITON_INTERPRET=1`` must be set before this module is imported, as for ``triton_ops``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.engine.kernels import FP8_GROUP, FP8_MAX, FP8_TINY

FP8_MM_N, FP8_MM_K = 64, FP8_GROUP  # fp8_mm, fp8_gemv: output channels per program, columns per iteration
LOCKS = 1 << 16  # arrival counters a device has (fp8_gemv: output tiles, up to 4M channels; paged_decode: programs)


class GemvTile(NamedTuple):
    """How ``fp8_gemv`` cuts a product: output channels per program, warps per program, programs per processor
    (the column splits make up the rest). ``bench/gpu_linears.py --sweep`` times the choices on a GPU."""

    block_n: int = FP8_MM_N
    warps: int = 4
    per_processor: int = 2


def fp8_split(n: int, k: int, device: torch.device, block_n: int = FP8_MM_N, per_processor: int = 2) -> tuple[int, int]:
    """How many parts ``fp8_mm`` (``fp8_gemv``) splits the columns into (and the columns of each, whole
    iterations): enough that the output tiles times the parts give each processor ``per_processor`` programs,
    each part at least four iterations long."""
    processors = _processors(device.index or 0) if device.type == "cuda" else 2
    tiles = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(per_processor * processors, tiles), k // (4 * FP8_MM_K)))
    return splits, triton.cdiv(triton.cdiv(k, splits), FP8_MM_K) * FP8_MM_K


@functools.cache
def _processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    # x in dtype, through float32 where they differ (an fp8 cache: sm89 has no direct e4m3 <-> bfloat16)
    if x.dtype != dtype:
        x = x.to(tl.float32).to(dtype)
    return x


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, width, fp8_max, tiny, BLOCK: tl.constexpr):
    # one program per row: its largest |x|, then the row over its scale in q's dtype (e4m3 on a GPU)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    start = 0
    while start < width:  # (``while``, as in _paged_decode_kernel, for the interpreter)
        ok = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
        start += BLOCK
    scale = tl.maximum(tl.max(top, axis=0), tiny) / fp8_max
    tl.store(scale_ptr + row, scale)
    start = 0
    while start < width:
        ok = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + start + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=ok)
        start += BLOCK


@triton.jit
def _tiles(x_ptr, w_ptr, m, cols_n, cols_k, rows, n, last, stride_x, stride_w):
    # an fp8 product's next tiles: x's rows m at columns cols_k [BLOCK_M, BLOCK_K], W^T's [BLOCK_K, BLOCK_N]
    x = tl.load(x_ptr + m[:, None] * stride_x + cols_k[None, :],
                mask=(m[:, None] < rows) & (cols_k[None, :] < last), other=0.0)
    w = tl.load(w_ptr + cols_n[None, :] * stride_w + cols_k[:, None],
                mask=(cols_n[None, :] < n) & (cols_k[:, None] < last), other=0.0)
    return x, w


@triton.jit
def _fp8_mm_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, rows, n, k, k_per_split, stride_x, stride_w,
                   stride_out, stride_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROW_SCALES: tl.constexpr, UPCAST: tl.constexpr):
    # program (n tile, k split): its split's partial sums of x [rows, k] times W [n, k]^T, W's e4m3 codes times
    # its channels' scales. ROW_SCALES: x is e4m3 too, with a scale per row (W8A8: the tensor cores take both
    # as they are); else x is 16-bit and W's codes are converted as they load (W8A16)
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * k_per_split
    last = tl.minimum(first + k_per_split, k)
    m = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = first
    while start < last:
        cols_k = start + ks
        x, w = _tiles(x_ptr, w_ptr, m, cols_n, cols_k, rows, n, last, stride_x, stride_w)
        if UPCAST:  # (Triton's CPU interpreter multiplies bfloat16 matrices wrongly)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif ROW_SCALES:
            acc += tl.dot(x, w)
        else:
            acc += tl.dot(x, to_dtype(w, x.dtype))
        start += BLOCK_K
    acc *= tl.load(scale_ptr + cols_n, mask=cols_n < n, other=0.0)[None, :]
    if ROW_SCALES:
        acc *= tl.load(x_scale_ptr + m, mask=m < rows, other=0.0)[:, None]
    tl.store(out_ptr + tl.program_id(1) * stride_split + m[:, None] * stride_out + cols_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < rows) & (cols_n[None, :] < n))


@triton.jit
def rounded(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    # float32 x in dtype, rounded to the nearest value, ties to even, as a GPU's cast and PyTorch's round (and held
    # at e4m3's largest value, as PyTorch's cast holds it). EMULATE: rounded in float32 arithmetic first, where the
    # interpreter's casts would not (its bfloat16 casts truncate; its e4m3 casts drop a carry)
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        if EMULATE:
            x = _e4m3_round(x)
    elif dtype == tl.bfloat16:
        if EMULATE:
            bits = x.to(tl.int32, bitcast=True)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _e4m3_round(v):
    # float32 v (|v| <= 448) rounded to e4m3's nearest value, ties to even, kept in float32: what a GPU's cast
    # does (Triton's CPU interpreter casts to e4m3 wrongly when a mantissa rounds up into the next power of 2)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # below 2^-6: multiples of 2^-9 (24576's float32 spacing)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr, rows, n, k, k_per_split, splits,
                     stride_x, stride_w, stride_out, fp8_max, tiny, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    # program (n tile, k split): x [rows, k] (16-bit) times W [n, k]^T over its split's columns, each BLOCK_K
    # columns of each row quantized to e4m3 over their own scale on the way into the tensor cores. With one
    # split it writes the product; with more, its partial sums, and the tile's last program to arrive adds the
    # splits' parts in split order and writes the product (one launch either way). EMULATE: the interpreter's
    # float32 arithmetic instead of e4m3 casts and an fp8 dot
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * k_per_split
    last = tl.minimum(first + k_per_split, k)
    m = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = first
    while start < last:
        cols_k = start + ks
        x, w = _tiles(x_ptr, w_ptr, m, cols_n, cols_k, rows, n, last, stride_x, stride_w)
        x = x.to(tl.float32)
        group_scale = tl.maximum(tl.max(tl.abs(x), axis=1), tiny) / fp8_max
        if EMULATE:
            part = tl.dot(_e4m3_round(x / group_scale[:, None]), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot((x / group_scale[:, None]).to(w.dtype), w)
        acc += part * group_scale[:, None]
        start += BLOCK_K
    acc *= tl.load(scale_ptr + cols_n, mask=cols_n < n, other=0.0)[None, :]
    inside = (m[:, None] < rows) & (cols_n[None, :] < n)
    out = out_ptr + m[:, None] * stride_out + cols_n[None, :]
    if splits == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        offsets = m[:, None] * n + cols_n[None, :]
        tl.store(part_ptr + split * rows * n + offsets, acc, mask=inside)
        tl.debug_barrier()  # every thread's part stored before the arrival is counted (released at gpu scope)
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            j = 0
            while j < splits:  # (``while``: the interpreter's scalars are arrays)
                total += tl.load(part_ptr + j * rows * n + offsets, mask=inside, other=0.0, cache_modifier=".cg")
                j += 1
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)
            tl.atomic_xchg(lock_ptr + tile, 0)  # counted from zero again by the next product


def fp8_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchOps.fp8_rows in one launch (fp8 W8A8's activations: one kernel per product, not seven)."""
    m, k = rows.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=rows.device) if out is None else out
    scale = torch.empty(m, 1, dtype=torch.float32, device=rows.device)
    if m:
        _fp8_rows_kernel[(m,)](rows, q, scale, rows.stride(0), q.stride(0), k, FP8_MAX, FP8_TINY,
                               BLOCK=min(1024, pow2(k)))
    return q, scale


def fp8_mm(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """TorchOps.fp8_mm in one launch (two when the columns are split): a decode step's few rows against
    every weight once, so the programs are the output tiles times enough splits of the columns to give
    each of the device's processors two (``fp8_split``)."""
    m, k = rows.shape
    n = q.shape[0]
    dtype = out_dtype or rows.dtype
    if m == 0:
        return torch.empty(0, n, device=rows.device, dtype=dtype)
    splits, k_per_split = fp8_split(n, k, rows.device)
    out = torch.empty(splits, m, n, device=rows.device, dtype=dtype if splits == 1 else torch.float32)
    grid = (triton.cdiv(n, FP8_MM_N), splits)
    # (without row scales the kernel reads none: any float32 pointer stands in for them)
    _fp8_mm_kernel[grid](rows, scale if row_scale is None else row_scale, q, scale, out, m, n, k, k_per_split,
                         rows.stride(0), q.stride(0), out.stride(1), out.stride(0), BLOCK_M=max(16, pow2(m)),
                         BLOCK_N=FP8_MM_N, BLOCK_K=FP8_MM_K, ROW_SCALES=row_scale is not None,
                         UPCAST=rows.device.type == "cpu")
    return out[0] if splits == 1 else out.sum(dim=0).to(dtype)


def fp8_gemv(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None,
             tile: GemvTile = GemvTile()) -> torch.Tensor:
    """TorchOps.fp8_gemv in one launch: the rows' quantization to e4m3 (a scale per 128 columns of a row), the
    product and, when the columns are split (``fp8_split``), the parts' sum. The split tiles count their
    arrivals in ``arrival_counters`` (split only when there are few tiles: far fewer than LOCKS)."""
    m, k = rows.shape
    n = q.shape[0]
    dtype = out_dtype or rows.dtype
    out = torch.empty(m, n, device=rows.device, dtype=dtype)
    if m == 0:
        return out
    splits, k_per_split = fp8_split(n, k, rows.device, tile.block_n, tile.per_processor)
    parts = torch.empty(splits if splits > 1 else 0, m, n, device=rows.device, dtype=torch.float32)
    grid = (triton.cdiv(n, tile.block_n), splits)
    _fp8_gemv_kernel[grid](rows, q, scale, out, parts, arrival_counters(rows.device), m, n, k, k_per_split, splits,
                           rows.stride(0), q.stride(0), out.stride(0), FP8_MAX, FP8_TINY, BLOCK_M=max(16, pow2(m)),
                           BLOCK_N=tile.block_n, BLOCK_K=FP8_MM_K, EMULATE=rows.device.type == "cpu",
                           num_warps=tile.warps)
    return out


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, need: int = LOCKS) -> torch.Tensor:
    """At least ``need`` of the device's arrival counters (``fp8_gemv``'s column splits, ``paged_decode``'s
    pieces; ``LOCKS`` unless more are needed), all zero between kernels: the last program of a group to arrive
    sets its counter back. Made on first use, before any graph is captured (the engine runs each graph's step
    eagerly first), and kept while the process lives (a captured graph holds their address); kernels that use
    them run one after another (one stream, as the engine's)."""
    size = max(LOCKS, triton.next_power_of_2(need))
    if (device, size) not in _COUNTERS:
        _COUNTERS[device, size] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[device, size]
