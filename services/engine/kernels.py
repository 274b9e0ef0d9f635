"""The decoder step's small operations: C++ kernels on the CPU, the same math in PyTorch elsewhere.

On a CPU, a decoder layer written as PyTorch operations is ~45 small operations, each paying dispatch
and an OpenMP barrier; at one token per sequence those cost more than the arithmetic. `csrc/cpu_ops.cpp`
fuses them (RMSNorm, residual + RMSNorm, SiLU * up, rotary embedding + cache write) and attends one new
token per sequence directly over its paged cache, with no gather; `csrc/prefill.cpp` does the same for a
step's prompt pieces. It is compiled for this machine's
CPU on first use (`switchboard prepare-model` does it ahead of time) into a per-source cache folder;
when no compiler is at hand the PyTorch versions below run instead, with a warning.

`TorchOps` is also what cuda and npu run: the same operations, each a few PyTorch calls.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.engine import kv_cache

log = logging.getLogger("switchboard.engine")

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_ops.cpp", "quant_ops.cpp", "layer_loop.cpp", "prefill.cpp")]
# -fopenmp: at::parallel_for is OpenMP inlined from the header. The extension's libgomp.so.1 is resolved
# to the one torch already loaded (same soname), so kernels and torch share one thread team.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


FP8_MAX, FP8_TINY = 448.0, 1e-12  # e4m3's largest finite value; the smallest |x| a row's scale is taken from
FP8_GROUP = 128  # fp8_gemv: columns of a row that share one activation scale


class TorchOps:
    """Reference implementations: what the C++ kernels compute, in PyTorch operations."""

    fused = False

    def prefills(self, dtype: torch.dtype, head_dim: int, kv_quantized: bool) -> bool:
        """Whether ``prefill_plan`` and ``paged_prefill`` attend a step's prompt pieces for this model; when
        not, each piece is attended by SDPA over the keys read from the cache."""
        return False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        residual.add_(x)
        return cls.rms_norm(residual, weight, eps)

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def fp8_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of ``rows`` [M, K] divided by its own scale (max |x| / 448, e4m3's largest value; an all-zero
        row gets a tiny one), in ``out``'s dtype (by default float8 e4m3), and the scales [M, 1] float32."""
        scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=FP8_TINY) / FP8_MAX
        q = rows.float() / scale
        return (q.to(torch.float8_e4m3fn) if out is None else out.copy_(q)), scale

    @staticmethod
    def fp8_mm(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rows`` [M, K] times W^T, W given as float8 e4m3 codes ``q`` [N, K] and a float32 ``scale`` [N] per
        output channel; the sums in float32, the result in ``out_dtype`` (by default ``rows``'). ``rows`` are
        either e4m3 codes with ``row_scale`` [M, 1] (W8A8, as ``fp8_rows`` makes them) or 16-bit (W8A16)."""
        a = rows.float() if row_scale is None else rows.float() * row_scale
        return ((a @ q.float().T) * scale.reshape(1, -1)).to(out_dtype or rows.dtype)

    @staticmethod
    def fp8_gemv(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rows`` [M, K] (16-bit or float32) times W^T, W as in ``fp8_mm``, with the rows quantized to e4m3 on
        the way in: each group of ``FP8_GROUP`` columns of each row over its own scale (max |x| / 448), as
        DeepSeek-V3 quantizes its activations in 1 x 128 tiles. The sums in float32, the result in ``out_dtype``
        (by default ``rows``'). A decode step's fp8 products (``quant_cuda.Fp8Linear.gemv``)."""
        m, k = rows.shape
        pad = -k % FP8_GROUP
        x = F.pad(rows.float(), (0, pad)).reshape(m, -1, FP8_GROUP)
        group_scale = x.abs().amax(dim=2, keepdim=True).clamp(min=FP8_TINY) / FP8_MAX
        a = ((x / group_scale).to(torch.float8_e4m3fn).float() * group_scale).reshape(m, -1)[:, :k]
        return ((a @ q.float().T) * scale.reshape(1, -1)).to(out_dtype or rows.dtype)

    @staticmethod
    def rotate(qkv, cos, sin, positions, num_heads, num_kv_heads, head_dim) -> torch.Tensor:
        """Rotates q and k in place; returns the rows' k and v [T, 2, Hkv, D]."""
        rotated = num_heads + num_kv_heads
        x = qkv[:, : rotated * head_dim].unflatten(-1, (rotated, head_dim))
        c, s = cos[positions][:, None, :].to(qkv.dtype), sin[positions][:, None, :].to(qkv.dtype)
        a, b = x[..., : head_dim // 2].clone(), x[..., head_dim // 2:].clone()
        x[..., : head_dim // 2] = a * c - b * s
        x[..., head_dim // 2:] = b * c + a * s
        return qkv[:, num_heads * head_dim:].unflatten(-1, (2, num_kv_heads, head_dim))

    @classmethod
    def rope_store(cls, qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim) -> None:
        kv = cls.rotate(qkv, cos, sin, positions, num_heads, num_kv_heads, head_dim)
        store(k_cache, slots, kv[:, 0].transpose(0, 1))
        store(v_cache, slots, kv[:, 1].transpose(0, 1))

    @classmethod
    def rope_store_q8(cls, qkv, cos, sin, positions, k_cache, v_cache, k_scale, v_scale, slots, num_heads,
                      num_kv_heads, head_dim) -> None:
        """rope_store into an int8 cache (``kv_cache.py``): codes [Hkv, S, D], float16 scales [Hkv, S]."""
        kv = cls.rotate(qkv, cos, sin, positions, num_heads, num_kv_heads, head_dim)
        for i, (cache, scales) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
            codes, scale = kv_cache.quantize(kv[:, i])
            cache.index_copy_(1, slots, codes.transpose(0, 1))
            scales.index_copy_(1, slots, scale.transpose(0, 1))

    @staticmethod
    def paged_decode(q, k_cache, v_cache, block_tables, lens, block_size, num_heads, num_kv_heads, head_dim,
                     scale) -> torch.Tensor:
        keys, values = (gather_blocks(cache, block_tables, block_size).to(q.dtype) for cache in (k_cache, v_cache))
        return attend_rows(q, keys, values, lens, num_heads, head_dim, scale)

    @staticmethod
    def paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, block_tables, lens, block_size, num_heads,
                        num_kv_heads, head_dim, scale) -> torch.Tensor:
        """paged_decode over an int8 cache: each row's positions dequantized, then the same attention."""
        keys, values = (kv_cache.dequantize(gather_blocks(cache, block_tables, block_size),
                                            gather_blocks(scales[..., None], block_tables, block_size)[..., 0], q.dtype)
                        for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))
        return attend_rows(q, keys, values, lens, num_heads, head_dim, scale)

    @staticmethod
    def lora_apply(y, x, a_parts, bts, rows) -> None:
        """y[:, cols of target t] += ((x A_t^T) masked to each row's rank range) Bt_t, in place; ``rows``
        (``lora.Rows``) gives each row's range."""
        mask = rows.mask(bts[0].shape[0], x.dtype)
        col = 0
        for a, bt in zip(a_parts, bts):
            width = bt.shape[1]
            y[:, col:col + width] += ((x @ a.t()) * mask) @ bt
            col += width


def attend_rows(q, keys, values, lens, num_heads, head_dim, scale) -> torch.Tensor:
    """One query row per sequence over its gathered keys and values [N, Hkv, W, D], the first lens[i] of them."""
    n, width = q.shape[0], keys.shape[2]
    mask = (torch.arange(width, device=q.device)[None] < lens[:, None])[:, None, None, :]
    query = q.reshape(n, num_heads, 1, head_dim)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.reshape(n, num_heads * head_dim)


def store(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` [Hkv, len(slots), D] into ``cache`` [Hkv, S, D] at ``slots``, in the cache's dtype (an fp8 cache
    rounds them; PyTorch has no index_copy_ for fp8, so its bytes are copied)."""
    values = values.to(cache.dtype)
    if cache.element_size() == 1 and cache.is_floating_point():
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.index_copy_(1, slots, values)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Hkv, S, D] cache, [N, NB] block tables -> [N, Hkv, NB * block_size, D]: each row's positions in order."""
    heads, _, dim = cache.shape
    n, nb = block_tables.shape
    blocks = cache.view(heads, -1, block_size, dim).index_select(1, block_tables.reshape(-1))
    return blocks.view(heads, n, nb * block_size, dim).transpose(0, 1)


class CpuOps(TorchOps):
    """The compiled kernels, with TorchOps' signatures."""

    fused = True

    def __init__(self, module):
        self.rms_norm = module.rms_norm
        self.add_rms_norm = module.add_rms_norm
        self.silu_mul = module.silu_mul
        self.rope_store = module.rope_store
        self.paged_decode = module.paged_decode
        self.rope_store_q8, self.paged_decode_q8 = module.rope_store_q8, module.paged_decode_q8  # int8 K/V
        self.q8_linear, self.q4_linear = module.q8_linear, module.q4_linear  # quantized weights (quant.py)
        self.q8_dequant, self.q4_dequant = module.q8_dequant, module.q4_dequant
        self.q4_packed = module.q4_packed()  # int4 layers in the kernel's own layout (AVX-512 BF16)
        self.q4p_linear = module.q4p_linear
        self.q8_activations = module.q8_activations  # the activations as the int8 kernel quantizes them
        self.q4_operands = module.q4_operands  # the activations and weight as the int4 kernel multiplies them
        self.int8_activations = module.q8_int8_activations()  # W8A8 (AVX-512 VNNI) rather than W8A16
        self.module = module

    def lora_apply(self, y, x, a_parts, bts, rows) -> None:
        self.module.lora_apply(y, x, a_parts, bts, rows.off, rows.rank)

    def prefills(self, dtype: torch.dtype, head_dim: int, kv_quantized: bool) -> bool:
        return not kv_quantized and self.module.prefill_supported(dtype, head_dim)

    @staticmethod
    def prefill_plan(chunks, block_size: int, device) -> CpuPrefillPlan:
        """``chunks``: (first row, first position, rows, the sequence's block table) each."""
        width = max(-(-(pos + n) // block_size) for _, pos, n, _ in chunks)
        return CpuPrefillPlan(torch.tensor([(row, pos, n) for row, pos, n, _ in chunks], dtype=torch.long),
                              torch.tensor([(table + [0] * width)[:width] for *_, table in chunks], dtype=torch.long))

    def paged_prefill(self, q, k_cache, v_cache, plan: CpuPrefillPlan, out, block_size, num_heads, num_kv_heads,
                      head_dim, scale) -> None:
        """Each piece's rows of ``out``: attention over the positions before each row and its own, read
        through the piece's block table (``csrc/prefill.cpp``)."""
        self.module.paged_prefill(q, k_cache, v_cache, plan.info, plan.tables, out, block_size, num_heads,
                                  num_kv_heads, head_dim, scale)


class CpuPrefillPlan(NamedTuple):
    info: torch.Tensor  # [pieces, 3]: first row in the step, first position, rows
    tables: torch.Tensor  # [pieces, width] block tables, zero-padded


def cpu_flags() -> str:
    """The CPU's feature flags (Linux); a build made with -march=native is valid only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_dir() -> Path:
    """A folder per source, torch version and CPU, so an edited kernel, a new torch or an image moved to
    another CPU never loads a stale (or illegal-instruction) build."""
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + torch.__version__.encode() + " ".join(CFLAGS).encode()
                            + cpu_flags().encode())
    root = Path(os.environ.get("SWITCHBOARD_KERNEL_CACHE") or Path.home() / ".cache" / "switchboard" / "kernels")
    folder = root / digest.hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_cpu_ops():
    """Build (or load the cached build of) the C++ kernels; raises when they cannot be built."""
    from torch.utils import cpp_extension

    bin_dir = str(Path(sys.executable).parent)  # the venv's ninja, when the venv is not on PATH
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(name="switchboard_cpu_ops", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir()), verbose=False)


def for_device(device: torch.device, enabled: bool = True) -> TorchOps:
    """The C++ kernels on cpu and the Triton kernels on cuda when ``enabled`` and available; PyTorch
    operations otherwise (npu, or no compiler or Triton at hand)."""
    if device.type == "cuda" and enabled:
        return gpu_ops()
    if device.type != "cpu" or not enabled:
        return TorchOps()
    try:
        return CpuOps(compile_cpu_ops())
    except Exception as exc:  # no compiler, no ninja: slower, same results
        log.warning("cpu kernels unavailable; running the PyTorch operations instead", extra={"error": repr(exc)})
        return TorchOps()


def gpu_ops() -> TorchOps:
    try:
        from services.engine.triton_ops import TritonOps
    except ImportError as exc:  # no triton: slower (and the decode attention gathers), same results
        log.warning("triton unavailable; running the PyTorch operations instead", extra={"error": repr(exc)})
        return TorchOps()
    return TritonOps()


if __name__ == "__main__":  # `python -m services.engine.kernels`: build now (switchboard prepare-model runs it)
    built = any(build_dir().glob("switchboard_cpu_ops*.so"))
    if not built:
        print("[kernels] building the engine's CPU kernels for this machine (once; ~1 min)", flush=True)
    ops = for_device(torch.device("cpu"))
    if not (built and ops.fused):
        print(f"[kernels] {'ready' if ops.fused else 'unavailable: the engine will use PyTorch operations'}", flush=True)
