"""Quantized linear layers on a GPU, on PyTorch's own kernels (``Switchboard.quantization`` on cuda).

A decode step at a few rows reads every weight once, so on a GPU too its time is the weights' bytes over
the memory's bandwidth. Two formats, each on the kernel PyTorch maintains for it (graph-capturable, no
host sync):

* ``int4`` → ``Int4Linear``: the Q4_1-style blocks ``quant.Q4Linear`` holds (codes 0..15, a scale d and
  an offset m per 32 input columns) in the layout of PyTorch's tensor-core int4 kernel
  (``_weight_int4pack_mm``, "tinygemm", sm80+; gpt-fast's and torchao's int4 path). Its weights are
  ``(q - 8) * scale + zero`` per group, so scale = d and zero = m + 8 d, kept in bfloat16 as the kernel
  takes them. Activations are bfloat16 (W4A16). 0.625 bytes per weight against bfloat16's 2.
* ``fp8`` → ``Fp8Linear``: float8 e4m3 weights with one float32 scale per output channel (max |w| / 448),
  and the activations quantized to e4m3 on the fly (W8A8, as vLLM's fp8 path runs on Hopper). Prompts: each
  row over its own scale (``fp8_rows``), multiplied by ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM, rowwise
  scales, sm89+). A decode step's few rows (up to ``FP8_GEMV_ROWS``): ``TritonOps.fp8_gemv``, one launch
  that quantizes each 128 columns of a row over their own scale as it loads them, and whose programs split
  the columns across the processors as a product of one row needs (a GEMM kernel made for many rows leaves
  most of them idle), the last of a tile's splits adding the parts. At one row a product is ~5-30 us of
  weights, so the launches around it count: the rows quantized first, then the product, then the parts'
  sum and a cast were four.

The lm_head stays in the model's dtype on a GPU: it is ~3% of an 8B model's bytes and where 4 bits cost
the most quality. The same classes run on a CPU (PyTorch's ``_for_cpu`` int4 kernel and its reference fp8
GEMM; slow there), which is how CI checks them: the engine on a CPU uses ``quant.py``'s kernels instead.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.kernels import TorchOps
from services.engine.quant import BLOCK, Q4Linear, QuantLinear, unpack4

FORMATS = ("int4", "fp8")  # Switchboard.quantization's values on cuda
FP8_GEMV_ROWS = 16  # fp8 products of up to this many rows run as TritonOps.fp8_gemv (a GEMV), more as _scaled_mm
CHECKPOINTS = ("awq", "gptq")  # folders already quantized (prequantized.py), loaded as int4


def unsupported(fmt: str, device: torch.device) -> str | None:
    """Why ``fmt`` cannot run on ``device`` (a GPU), or None when it can."""
    if fmt not in FORMATS + CHECKPOINTS:
        return f"runs on cpu only; on {device.type}: {' or '.join(FORMATS)}"
    if device.type != "cuda":
        return f"runs on cpu and cuda; the engine's device is {device.type}"
    if not torch.cuda.is_available():
        return "runs on a CUDA device; this torch sees none"
    major, minor = torch.cuda.get_device_capability(device)
    need = (8, 9) if fmt == "fp8" else (8, 0)
    if (major, minor) < need:
        return f"needs a GPU of compute capability {need[0]}.{need[1]} or newer; this one is {major}.{minor}"
    return None


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with W as int4 codes in the tinygemm layout and bfloat16 scales and zeros per 32 columns."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None):
        """``q``, ``d``, ``m``: as ``quant.Q4Linear`` takes them (uint8 [n, k / 2] in blocks of 32, float16
        [n, k / 32]), on the device the layer runs on."""
        super().__init__()
        n, k = q.shape[0], q.shape[1] * 2
        self.out_features, self.in_features = n, k
        self.inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        codes = unpack4(q.reshape(n, k // BLOCK, BLOCK // 2)).reshape(n, k)
        self.packed = pack_codes(codes, self.inner_k_tiles)
        scale = d.to(torch.float32)
        zero = m.to(torch.float32) + 8.0 * scale
        self.scales_zeros = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # [k/32, n, 2]
        self.bias = None if bias is None else bias.detach().clone()

    @staticmethod
    def fits(out_features: int, in_features: int, device: torch.device) -> bool:
        """The kernel's shapes: rows in eights (sixteens for the CPU's), columns in blocks of 32."""
        return out_features % (16 if device.type == "cpu" else 8) == 0 and in_features % BLOCK == 0

    @classmethod
    def from_q4(cls, layer: Q4Linear, device: torch.device) -> Int4Linear:
        q, d, m = (t.to(device) for t in layer.canonical())
        bias = None if layer.bias is None else layer.bias.to(device)
        return cls(q, d, m, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls.from_q4(Q4Linear.from_float(weight, bias), weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = int4_mm(rows, self.packed, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] as the kernel sees it (the identity through it)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return int4_mm(eye, self.packed, self.scales_zeros).T.to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def pack_codes(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Codes [n, k] (0..15) in the int4 kernel's layout: on cuda from two codes a byte (the even column in
    the high nibble), on a CPU from int32 codes."""
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), inner_k_tiles)
    pairs = (codes[:, ::2] << 4) | codes[:, 1::2]
    return torch.ops.aten._convert_weight_to_int4pack(pairs.to(torch.uint8).contiguous(), inner_k_tiles)


def int4_mm(rows: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    if rows.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, BLOCK, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(rows, packed, BLOCK, scales_zeros)


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W in float8 e4m3 (a scale per output channel) and x quantized on the fly (a decode
    step's rows by 128 columns, a prompt's by row)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        """``q``: float8 e4m3 [n, k]; ``scale``: float32 [n]; ``ops``: what quantizes the activations and runs
        the decode rows' product (``fp8_rows``, ``fp8_gemv``: Triton kernels on cuda; by default PyTorch
        operations)."""
        super().__init__()
        self.ops = ops or TorchOps()
        self.out_features, self.in_features = q.shape
        self.weight_t = q.T  # [k, n], column-major as _scaled_mm takes its second operand
        self.scale = scale.to(torch.float32).reshape(1, -1).contiguous()
        self.bias = None if bias is None else bias.detach().clone()

    @staticmethod
    def fits(out_features: int, in_features: int, device: torch.device) -> bool:
        """cuBLASLt's fp8 GEMM: both of the weight's sides in sixteens."""
        return out_features % 16 == 0 and in_features % 16 == 0

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, ops=None) -> Fp8Linear:
        q, scale = TorchOps.fp8_rows(weight.detach())  # each output channel as the activations' rows are
        return cls(q, scale, bias, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = (self.gemv if self._as_gemv(rows) else self.gemm)(rows, out_dtype).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _as_gemv(self, rows: torch.Tensor) -> bool:
        """A decode step's few rows, whose time is the weights' bytes: through the Triton kernel (or PyTorch's
        reference on a CPU, as CI checks it; on a GPU without Triton that would convert every weight)."""
        return rows.shape[0] <= FP8_GEMV_ROWS and (self.ops.fused or rows.device.type == "cpu")

    def gemv(self, rows: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``rows`` [M, K] in e4m3 (a scale per 128 columns) times the weights: ``ops.fp8_gemv`` (a decode
        step's product, one launch)."""
        return self.ops.fp8_gemv(rows, self.weight_t.T, self.scale.reshape(-1), out_dtype)

    def gemm(self, rows: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``rows`` [M, K] in e4m3 times the weights: cuBLASLt's ``_scaled_mm`` (prompts)."""
        q, scale = self.ops.fp8_rows(rows)
        return torch._scaled_mm(q, self.weight_t, scale_a=scale, scale_b=self.scale, out_dtype=out_dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_t.T.float() * self.scale.T).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() + self.scale.numel() * 4


def quantize(linear: nn.Module, fmt: str, ops=None) -> nn.Module:
    """``linear`` (an nn.Linear on its device) in ``fmt``; a shape the kernel does not take stays float.
    ``ops``: the device's small operations (fp8 quantizes its activations with them)."""
    if fmt == "fp8":
        fits = Fp8Linear.fits(linear.out_features, linear.in_features, linear.weight.device)
        return Fp8Linear.from_float(linear.weight, linear.bias, ops) if fits else linear
    fits = Int4Linear.fits(linear.out_features, linear.in_features, linear.weight.device)
    return Int4Linear.from_float(linear.weight, linear.bias) if fits else linear


def place(layer: QuantLinear, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A checkpoint's layer (``prequantized.py``: int4 blocks, or int8 where GPTQ's act-order groups cross
    blocks) on the GPU: the int4 kernel's layout where its shape fits, else its dequantized weight in ``dtype``."""
    if isinstance(layer, Q4Linear) and Int4Linear.fits(layer.out_features, layer.in_features, device):
        return Int4Linear.from_q4(layer, device)
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=device, dtype=dtype)
    dense.weight.data = layer.dequantized(dtype).to(device)
    if layer.bias is not None:
        dense.bias.data = layer.bias.to(device, dtype)
    return dense.requires_grad_(False)
