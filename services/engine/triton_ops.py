"""The decoder step's small operations as Triton kernels: what cuda runs (``TorchOps`` signatures).

On a GPU the PyTorch versions of a layer's small operations are ~45 kernel launches, and the
decode attention gathered every row's whole context with ``index_select`` each step. Here each is
one kernel:

- ``paged_decode``: one program per (row, KV head) walks the row's positions through its block
  table (no gather), all query heads of the KV group at once, with an online softmax in float32; a long
  row's positions in pieces walked at once, their states added by the last piece (flash-decoding);
- ``rms_norm`` and ``add_rms_norm`` (residual += x, then the norm): one program per row;
- ``silu_mul``: SiLU(gate) * up of the merged gate/up output;
- ``rope_store``: rotates q and k in place and writes k and v into the paged cache;
- ``fp8_rows``, ``fp8_mm`` and ``fp8_gemv`` (fp8 weights): ``triton_fp8.py``.

Every kernel reads only device memory its arguments name (lengths and block tables included), so
a step made of them can be captured as a CUDA graph and replayed with new inputs.

``TRITON_INTERPRET=1`` (set before this module is imported) runs the same kernels on CPU tensors
through numpy: how CI checks them against ``TorchOps`` without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.engine import triton_fp8
from services.engine.kernels import TorchOps
from services.engine.triton_fp8 import pow2, rounded, to_dtype


PREFILL_ROWS, PREFILL_TILE = 32, 32  # paged prefill: query rows per program, keys per iteration


class PrefillPlan(NamedTuple):
    """A step's prompt chunks as ``paged_prefill`` reads them, on the device."""

    info: torch.Tensor  # [chunks * 3]: first row in the step, first position, rows
    tiles: torch.Tensor  # [tiles * 2]: chunk, first row within it (PREFILL_ROWS rows each)
    tables: torch.Tensor  # [chunks, width] block tables, zero-padded
    num_tiles: int


SPREAD_PROGRAMS = 256  # paged decode: fewer (row, KV head) programs than this run one per query head instead
SPLIT_FROM, DECODE_SPLITS = 256, 16  # paged decode: rows longer than this many positions split in up to 16 pieces
SPLIT_PROGRAMS = 1024  # paged decode: a row's pieces walked at once while the programs stay within this many


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, stats_ptr, lock_ptr,
                         stride_q, stride_out, stride_kv_head, stride_table, scale, block_size, split_from,
                         GROUP: tl.constexpr, PER_PROGRAM: tl.constexpr, PER_PROGRAM_P: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, TILE: tl.constexpr,
                         MAX_PIECES: tl.constexpr):
    # program (row, j, split) takes query heads [j * PER_PROGRAM, (j + 1) * PER_PROGRAM), all of one KV head's
    # group. A row of up to split_from positions is one piece; a longer one, up to MAX_PIECES pieces of whole
    # tiles, at least split_from each: its length alone decides them, not the batch or the grid. The grid's
    # last axis walks a row's pieces at once (pieces split, split + splits, ...); each piece's online softmax
    # goes to part/stats, and the program that stores the last of them adds them up, in piece order (one
    # launch either way)
    row = tl.program_id(0)
    first = tl.program_id(1) * PER_PROGRAM
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row)
    piece = tl.maximum(split_from, tl.cdiv(tl.cdiv(length, MAX_PIECES), TILE) * TILE)
    pieces = tl.cdiv(length, piece)
    if split < pieces:  # (programs past a row's pieces have nothing to do)
        g = tl.arange(0, PER_PROGRAM_P)
        d = tl.arange(0, DIM_P)
        out_ok = (g < PER_PROGRAM)[:, None] & (d < HEAD_DIM)[None, :]
        heads = first + g
        q = tl.load(q_ptr + row * stride_q + heads[:, None] * HEAD_DIM + d[None, :], mask=out_ok,
                    other=0.0).to(tl.float32)
        out = out_ptr + row * stride_out + heads[:, None] * HEAD_DIM + d[None, :]
        program = row * tl.num_programs(1) + tl.program_id(1)
        base = program * MAX_PIECES
        last = 0  # whether this program stored the row's last piece
        at = split
        while at < pieces:
            begin = at * piece
            best, total, acc = _decode_piece(q, k_ptr + (first // GROUP) * stride_kv_head,
                                             v_ptr + (first // GROUP) * stride_kv_head,
                                             tables_ptr + row * stride_table, begin,
                                             tl.minimum(begin + piece, length), scale, block_size, d,
                                             PER_PROGRAM_P, HEAD_DIM, DIM_P, TILE)
            if pieces == 1:
                tl.store(out, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
            else:
                here = base + at
                tl.store(part_ptr + here * PER_PROGRAM_P * DIM_P + g[:, None] * DIM_P + d[None, :], acc)
                tl.store(stats_ptr + here * 2 * PER_PROGRAM_P + g, best)
                tl.store(stats_ptr + here * 2 * PER_PROGRAM_P + PER_PROGRAM_P + g, total)
                tl.debug_barrier()  # every thread's part stored before the arrival is counted (released at gpu scope)
                if tl.atomic_add(lock_ptr + program, 1, sem="acq_rel", scope="gpu") == pieces - 1:
                    last = 1
            at += tl.num_programs(2)
        if last == 1:
            tl.debug_barrier()
            _add_pieces(out, part_ptr, stats_ptr, base, pieces, g, d, out_ok, PER_PROGRAM_P, DIM_P)
            tl.atomic_xchg(lock_ptr + program, 0)  # counted from zero again by the next step


@triton.jit
def _decode_piece(q, k_base, v_base, table, begin, end, scale, block_size, d, PER_PROGRAM_P: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, TILE: tl.constexpr):
    # q [PER_PROGRAM_P, DIM_P] against positions [begin, end) of a row (block table ``table``): the online
    # softmax's running max, sum of weights and weighted sum of values
    best = tl.full([PER_PROGRAM_P], float("-inf"), tl.float32)
    total = tl.zeros([PER_PROGRAM_P], tl.float32)
    acc = tl.zeros([PER_PROGRAM_P, DIM_P], tl.float32)
    d_ok = d < HEAD_DIM
    start = begin
    while start < end:  # (a ``for`` over range(length) does not run in the interpreter)
        pos = start + tl.arange(0, TILE)
        p_ok = pos < end
        block = tl.load(table + pos // block_size, mask=p_ok, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [PER_PROGRAM_P, TILE]
        scores = tl.where(p_ok[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        alpha = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * alpha + tl.sum(weights, axis=1)
        v = tl.load(v_base + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        best = new_best
        start += TILE
    return best, total, acc


@triton.jit
def _add_pieces(out, part_ptr, stats_ptr, base, pieces, g, d, out_ok, PER_PROGRAM_P: tl.constexpr,
                DIM_P: tl.constexpr):
    # a row's pieces' softmax states (at base, base + 1, ...), rescaled to their common max and added in piece
    # order: the attention (``triton_fp8.fp8_gemv`` counts its column splits' arrivals the same way)
    top = tl.full([PER_PROGRAM_P], float("-inf"), tl.float32)
    j = 0
    while j < pieces:
        top = tl.maximum(top, tl.load(stats_ptr + (base + j) * 2 * PER_PROGRAM_P + g, cache_modifier=".cg"))
        j += 1
    weights = tl.zeros([PER_PROGRAM_P], tl.float32)
    values = tl.zeros([PER_PROGRAM_P, DIM_P], tl.float32)
    j = 0
    while j < pieces:
        stats = stats_ptr + (base + j) * 2 * PER_PROGRAM_P
        factor = tl.exp(tl.load(stats + g, cache_modifier=".cg") - top)
        weights += tl.load(stats + PER_PROGRAM_P + g, cache_modifier=".cg") * factor
        part = tl.load(part_ptr + (base + j) * PER_PROGRAM_P * DIM_P + g[:, None] * DIM_P + d[None, :],
                       cache_modifier=".cg")
        values += part * factor[:, None]
        j += 1
    tl.store(out, (values / weights[:, None]).to(out.dtype.element_ty), mask=out_ok)


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, info_ptr, tiles_ptr, out_ptr,
                          stride_q, stride_out, stride_kv_head, stride_table, scale, block_size,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, ROWS: tl.constexpr,
                          TILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # program (tile, head): rows [first, first + ROWS) of one chunk, one query head; keys from position 0 in
    # tiles of TILE, so a row's sums run in the same order however its prompt was cut into chunks
    chunk = tl.load(tiles_ptr + 2 * tl.program_id(0))
    first = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    head = tl.program_id(1)
    row0 = tl.load(info_ptr + 3 * chunk)
    pos0 = tl.load(info_ptr + 3 * chunk + 1)
    n = tl.load(info_ptr + 3 * chunk + 2)
    m = first + tl.arange(0, ROWS)
    d = tl.arange(0, DIM_P)
    m_ok = m < n
    d_ok = d < HEAD_DIM
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q + head * HEAD_DIM + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:  # (Triton's CPU interpreter multiplies bfloat16 matrices wrongly: it gets float32 ones)
        q = q.to(tl.float32)
    seen = pos0 + m  # each row's own position: it sees keys [0, seen]
    limit = pos0 + tl.minimum(first + ROWS, n)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_P], tl.float32)
    k_base = k_ptr + (head // GROUP) * stride_kv_head
    v_base = v_ptr + (head // GROUP) * stride_kv_head
    start = 0
    while start < limit:  # (the first tile holds position 0, which every row sees: ``best`` is finite after it)
        pos = start + tl.arange(0, TILE)
        p_ok = pos < limit
        block = tl.load(tables_ptr + chunk * stride_table + pos // block_size, mask=p_ok, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = to_dtype(tl.load(k_base + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0), q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, TILE] float32
        scores = tl.where((pos[None, :] <= seen[:, None]) & p_ok[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        alpha = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * alpha + tl.sum(weights, axis=1)
        v = tl.load(v_base + slot[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0)
        v = to_dtype(v, out_ptr.dtype.element_ty)  # the model's dtype
        p = weights.to(v.dtype)  # (rounded to bfloat16 for the tensor cores, as flash attention does)
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        best = new_best
        start += TILE
    out = acc / total[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + head * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, width, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # residual += x (rounded to the residual's dtype, as the in-place add is), then its norm
        h = (tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32) + h)
        h = h.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, h, mask=ok)
        h = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / width + eps)
    normed = (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_ptr, v_ptr,
                       stride_qkv, stride_table, stride_kv_head,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       HALF_P: tl.constexpr, EMULATE: tl.constexpr):
    # each product and sum rounded to the rows' dtype as TorchOps.rotate's operations round them (HF's rotary
    # embedding too), so the values, and the e4m3 codes of an fp8 cache, are PyTorch's exactly
    row = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    i = tl.arange(0, HALF_P)
    ok = i < HALF
    base = qkv_ptr + row * stride_qkv + head * (2 * HALF)
    a = tl.load(base + i, mask=ok, other=0.0)
    b = tl.load(base + HALF + i, mask=ok, other=0.0)
    dt = a.dtype
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if head < NUM_HEADS + NUM_KV_HEADS:
        pos = tl.load(pos_ptr + row).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_table + i, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_table + i, mask=ok, other=0.0).to(tl.float32)
        c, s = rounded(c, dt, EMULATE).to(tl.float32), rounded(s, dt, EMULATE).to(tl.float32)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        a = rounded(_product(af, c, dt, EMULATE) - _product(bf, s, dt, EMULATE), dt, EMULATE)
        b = rounded(_product(bf, c, dt, EMULATE) + _product(af, s, dt, EMULATE), dt, EMULATE)
        tl.store(base + i, a, mask=ok)
        tl.store(base + HALF + i, b, mask=ok)
        if head >= NUM_HEADS:  # the cache in its own dtype (fp8 e4m3: rounded from the rows' dtype)
            dest = k_ptr + (head - NUM_HEADS) * stride_kv_head + slot * (2 * HALF)
            tl.store(dest + i, rounded(a.to(tl.float32), k_ptr.dtype.element_ty, EMULATE), mask=ok)
            tl.store(dest + HALF + i, rounded(b.to(tl.float32), k_ptr.dtype.element_ty, EMULATE), mask=ok)
    else:
        dest = v_ptr + (head - NUM_HEADS - NUM_KV_HEADS) * stride_kv_head + slot * (2 * HALF)
        tl.store(dest + i, rounded(a.to(tl.float32), v_ptr.dtype.element_ty, EMULATE), mask=ok)
        tl.store(dest + HALF + i, rounded(b.to(tl.float32), v_ptr.dtype.element_ty, EMULATE), mask=ok)


@triton.jit
def _product(x, y, dt: tl.constexpr, EMULATE: tl.constexpr):
    # x * y rounded to dt, back in float32 (in 16 bits, a product rounded also keeps a GPU from fusing the sum that
    # takes it into an fma)
    return rounded(x * y, dt, EMULATE).to(tl.float32)


class TritonOps(TorchOps):
    """The Triton kernels, with TorchOps' signatures (LoRA stays TorchOps')."""

    fused = True

    def prefills(self, dtype: torch.dtype, head_dim: int, kv_quantized: bool) -> bool:
        return True

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        if rows.shape[0]:
            _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, rows.stride(0), rows.stride(0), out.stride(0),
                                               rows.shape[1], eps, ADD=False, BLOCK=pow2(rows.shape[1]))
        return out.view(x.shape)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(residual)
        if residual.shape[0]:
            _rms_norm_kernel[(residual.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0),
                                                   out.stride(0), residual.shape[1], eps, ADD=True,
                                                   BLOCK=pow2(residual.shape[1]))
        return out

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] // 2
        out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            block = min(1024, pow2(width))
            _silu_mul_kernel[(x.shape[0], triton.cdiv(width, block))](x, out, x.stride(0), out.stride(0), width,
                                                                      BLOCK=block)
        return out

    fp8_rows = staticmethod(triton_fp8.fp8_rows)
    fp8_mm = staticmethod(triton_fp8.fp8_mm)
    fp8_gemv = staticmethod(triton_fp8.fp8_gemv)

    @staticmethod
    def rope_store(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim) -> None:
        if not qkv.shape[0]:
            return
        half = head_dim // 2
        _rope_store_kernel[(qkv.shape[0], num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, positions, slots, k_cache, v_cache, qkv.stride(0), cos.stride(0), k_cache.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_P=pow2(half),
            EMULATE=qkv.device.type == "cpu", enable_fp_fusion=False)  # (a product fused into an fma skips a rounding)

    @staticmethod
    def prefill_plan(chunks, block_size: int, device) -> PrefillPlan:
        """One launch's description of a step's prompt chunks: ``chunks`` is (first row, first position, rows,
        the sequence's block table) each."""
        width = max(-(-(pos + n) // block_size) for _, pos, n, _ in chunks)
        tables = [(table + [0] * width)[:width] for *_, table in chunks]
        tiles = [(c, first) for c, (_, _, n, _) in enumerate(chunks) for first in range(0, n, PREFILL_ROWS)]
        info = torch.tensor([(row, pos, n) for row, pos, n, _ in chunks], dtype=torch.long)
        stage = torch.cat([info.flatten(), torch.tensor(tiles, dtype=torch.long).flatten(),
                           torch.tensor(tables, dtype=torch.long).flatten()])
        if device.type == "cuda":
            stage = stage.pin_memory()
        stage = stage.to(device, non_blocking=True)
        c, t = len(chunks), len(tiles)
        return PrefillPlan(stage[: 3 * c], stage[3 * c: 3 * c + 2 * t], stage[3 * c + 2 * t:].view(c, width), t)

    @staticmethod
    def paged_prefill(q, k_cache, v_cache, plan: PrefillPlan, out, block_size, num_heads, num_kv_heads, head_dim,
                      scale) -> None:
        """Each chunk's rows of ``out`` (rows as ``plan`` places them): attention over the positions before
        each row and the row's own, read through the chunk's block table, for every chunk in one launch."""
        if not plan.num_tiles:
            return
        _paged_prefill_kernel[(plan.num_tiles, num_heads)](
            q, k_cache, v_cache, plan.tables, plan.info, plan.tiles, out, q.stride(0), out.stride(0),
            k_cache.stride(0), plan.tables.stride(0), scale, block_size, GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim, DIM_P=max(16, pow2(head_dim)), ROWS=PREFILL_ROWS, TILE=PREFILL_TILE,
            PRECISION="ieee" if q.dtype == torch.float32 or q.device.type == "cpu" else "tf32",
            UPCAST=q.device.type == "cpu")

    @staticmethod
    def paged_decode(q, k_cache, v_cache, block_tables, lens, block_size, num_heads, num_kv_heads, head_dim,
                     scale, per_program: int | None = None, split_from: int = SPLIT_FROM) -> torch.Tensor:
        """``per_program``: query heads per program; by default a whole KV group once there are enough
        programs to fill the GPU (each K/V read once), else one (more programs, K/V reread from cache).
        A row of more than ``split_from`` positions is attended in up to ``DECODE_SPLITS`` pieces
        (flash-decoding), the pieces' softmax states added by the program that stores the last of them; its
        length alone decides its pieces, so its numbers do not depend on the batch. They are walked at once
        by as many programs each as keep the grid within ``SPLIT_PROGRAMS`` (a batch of many rows fills the GPU
        already; programs past a row's pieces return at once, and the grid is fixed when a graph is captured)."""
        n = q.shape[0]
        out = torch.empty(n, num_heads * head_dim, dtype=q.dtype, device=q.device)
        if n:
            group = num_heads // num_kv_heads
            if per_program is None:
                per_program = group if n * num_kv_heads >= SPREAD_PROGRAMS else 1
            programs, dim_p = num_heads // per_program, pow2(head_dim)
            counters = triton_fp8.arrival_counters(q.device, n * programs)  # (more than LOCKS: eager steps only)
            positions = block_tables.shape[1] * block_size  # the longest row the tables hold
            pieces = min(DECODE_SPLITS, triton.cdiv(positions, split_from))  # the most a row of the tables has
            splits = min(pieces, max(1, SPLIT_PROGRAMS // (n * programs)))
            part = torch.empty(n * programs * DECODE_SPLITS * pow2(per_program) * dim_p if pieces > 1 else 0,
                               dtype=torch.float32, device=q.device)
            stats = torch.empty(n * programs * DECODE_SPLITS * 2 * pow2(per_program) if pieces > 1 else 0,
                                dtype=torch.float32, device=q.device)
            _paged_decode_kernel[(n, programs, splits)](
                q, k_cache, v_cache, block_tables, lens, out, part, stats, counters, q.stride(0), out.stride(0),
                k_cache.stride(0), block_tables.stride(0), scale, block_size,
                split_from, GROUP=group, PER_PROGRAM=per_program,
                PER_PROGRAM_P=pow2(per_program), HEAD_DIM=head_dim, DIM_P=dim_p,
                TILE=32 if head_dim <= 128 else 16, MAX_PIECES=DECODE_SPLITS)
        return out
