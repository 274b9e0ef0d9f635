"""Quantized linear layers: fewer bytes per weight, so a decode step, which reads every weight once, reads less.

Two formats (``Switchboard.quantization``):

* ``int8`` → ``Q8Linear``: ``w = s * q``, q int8, one float32 scale s per output channel (1 byte per weight
  instead of bfloat16's 2). Symmetric: s = max |w| / 127 over the row. Where the CPU has AVX-512 VNNI the
  kernel quantizes the activations too, per block of 32 with a scale each, and multiplies int8 by int8
  (W8A8); elsewhere it multiplies float activations by the dequantized weights (W8A16).
* ``int4`` → ``Q4Linear``: ``w = d * q + m``, q in 0..15, a float16 scale d and offset m per block of 32
  input columns (GGUF's Q4_1 layout; 0.625 bytes per weight). Asymmetric: each block's [min, max] onto 0..15.
  Where the CPU has AVX-512 BF16 the layer keeps its codes in the kernel's own layout (``pack_q4``: 16 rows
  interleaved, so one instruction unpacks 16 rows' codes of 2 columns), and the kernel rounds the activations
  to bfloat16 (as a bfloat16 model does everywhere) and multiplies with ``vdpbf16ps``; elsewhere float
  activations by dequantized weights.
  GGUF files (``gguf_weights.py``) and AWQ / GPTQ checkpoints (``prequantized.py``) load into it as stored.

Each holds only its packed weight (the float one is dropped). On the CPU the engine's C++ kernels
(``csrc/quant_ops.cpp``) multiply by it directly, whatever the batch (they beat dequantizing the matrix
at every size measured, prefill chunks included); without them (no compiler, ``cpuKernels: false``) the
weight is dequantized by PyTorch operations at each use — slow, the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32


class QuantLinear(nn.Module):
    """What both formats share: the shape, the bias, the choice between kernel and dequantized product."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, kernels=None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.detach().clone()
        self.kernels = kernels  # the CPU kernels (kernels.CpuOps), or None: PyTorch operations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's rows: no reshape (a decode step makes 120 of these calls)
        rows = x if flat else x.reshape(-1, self.in_features)
        if self.kernels is not None:
            out = self._kernel(rows)
        else:
            out = F.linear(rows, self.dequantized(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Q8Linear(QuantLinear):

    def __init__(self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None, kernels=None,
                 int8_activations: bool = True):
        """``q``: int8 [out, in]; ``s``: float32 [out]; ``int8_activations``: W8A8 where the CPU has VNNI
        (the lm_head keeps float activations: there, rounding them flipped greedy answers of the default model)."""
        super().__init__(q.shape[0], q.shape[1], bias, kernels)
        self.q, self.s = q.contiguous(), s.to(torch.float32).contiguous()
        self.int8_activations = int8_activations and kernels is not None and kernels.int8_activations

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels=None,
                   int8_activations: bool = True) -> Q8Linear:
        w = weight.detach().float()
        s = w.abs().amax(dim=1) / 127.0
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, s, bias, kernels, int8_activations)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_linear(rows, self.q, self.s, self.int8_activations)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.q8_dequant(self.q, self.s, dtype)
        return (self.q.float() * self.s[:, None]).to(dtype)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.q, self.s]


class Q4Linear(QuantLinear):

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
                 kernels=None):
        """``q``: uint8 [out, in / 2] (byte j of a block: element j low, element j + 16 high); ``d``, ``m``:
        float16 [out, in / 32]. Held as given, or in the kernel's layout where the kernels have one."""
        super().__init__(q.shape[0], q.shape[1] * 2, bias, kernels)
        q, d, m = q.contiguous(), d.to(torch.float16).contiguous(), m.to(torch.float16).contiguous()
        self.packed = kernels is not None and getattr(kernels, "q4_packed", False)
        self.stored = pack_q4(q, d, m) if self.packed else (q, d, m)

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, d, m) as the constructor takes them (unpacked from the kernel's layout where held in it)."""
        return unpack_q4(*self.stored, self.out_features) if self.packed else self.stored

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels=None) -> Q4Linear:
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        d, m = ((high - low) / 15.0).to(torch.float16), low.to(torch.float16)
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        codes = torch.round((w - m.float()[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(pack4(codes).reshape(n, k // 2), d, m, bias, kernels)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return self.kernels.q4p_linear(rows, *self.stored, self.out_features)
        return self.kernels.q4_linear(rows, *self.stored)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, d, m = self.canonical()
        if self.kernels is not None:
            return self.kernels.q4_dequant(q, d, m, dtype)
        n, k = self.out_features, self.in_features
        codes = unpack4(q.reshape(n, k // BLOCK, BLOCK // 2)).float()
        w = codes * d.float()[..., None] + m.float()[..., None]
        return w.reshape(n, k).to(dtype)

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.stored)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 32] codes in 0..15 → [..., 16] bytes: element j in the low nibble of byte j, j + 16 in the high."""
    return codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack4``."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


GROUP = 16  # weight rows interleaved in the kernel's layout


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1-style (q, d, m) of [n, k] weights in the CPU kernel's layout (``csrc/quant_ops.cpp``, ``linear_q4p``):
    rows in groups of 16 (the last padded with zero rows); per group and octet of columns 8o..8o+7, 64 bytes
    whose 32-bit lane i holds row i's codes of the even columns in its low half and of the odd ones in its
    high half (column 8o + 2t + h: half h, bits 4t..4t+3); d and m as [groups, k / 32, 16]."""
    n, k = q.shape[0], q.shape[1] * 2
    groups, pad = -(-n // GROUP), -n % GROUP
    codes = unpack4(q.reshape(n, k // BLOCK, BLOCK // 2)).reshape(n, k)
    codes, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (codes, d, m))
    lanes = codes.reshape(groups, GROUP, k // 8, 4, 2).permute(0, 2, 1, 4, 3)  # (group, octet, row, half, t)
    packed = (lanes[..., 0::2] | (lanes[..., 1::2] << 4)).contiguous().reshape(groups * GROUP, k // 2)
    return (packed, *(t.reshape(groups, GROUP, k // BLOCK).transpose(1, 2).contiguous() for t in (d, m)))


def unpack_q4(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_q4``: (q, d, m) of the first ``n`` rows."""
    groups, k = d.shape[0], packed.shape[1] * 2
    pairs = packed.reshape(groups, k // 8, GROUP, 2, 2)
    lanes = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(groups, k // 8, GROUP, 2, 4)
    codes = lanes.permute(0, 2, 1, 4, 3).reshape(groups * GROUP, k)[:n].reshape(n, k // BLOCK, BLOCK)
    scales = (t.transpose(1, 2).reshape(groups * GROUP, k // BLOCK)[:n].contiguous() for t in (d, m))
    return (pack4(codes).reshape(n, k // 2), *scales)


def quantize(linear: nn.Module, fmt: str, kernels=None) -> nn.Module:
    """``linear`` (an nn.Linear) in ``fmt``; a width that is no whole number of blocks stays float."""
    if fmt == "none" or linear.in_features % BLOCK:
        return linear
    cls = {"int8": Q8Linear, "int4": Q4Linear}[fmt]
    return cls.from_float(linear.weight, linear.bias, kernels)


def quantize_head(linear: nn.Module, kernels=None) -> nn.Module:
    """The lm_head: int8 weights, 16-bit activations (W8A16: int16 by `vpdpwssd` on VNNI, else float32)."""
    if linear.in_features % BLOCK:
        return linear
    return Q8Linear.from_float(linear.weight, linear.bias, kernels, int8_activations=False)


def merge(layers: list[QuantLinear], kernels=None) -> QuantLinear:
    """Layers of one input width side by side (their outputs concatenated); int8 when their formats differ."""
    if all(isinstance(layer, Q4Linear) for layer in layers):
        q, d, m = zip(*(layer.canonical() for layer in layers))
        return Q4Linear(torch.cat(q), torch.cat(d), torch.cat(m), kernels=kernels)
    eights = [l if isinstance(l, Q8Linear) else Q8Linear.from_float(l.dequantized(), kernels=kernels) for l in layers]
    return Q8Linear(torch.cat([l.q for l in eights]), torch.cat([l.s for l in eights]), kernels=kernels)


def shapes_of(linears: dict[str, nn.Module]) -> dict[str, tuple[int, int]]:
    return {key: (module.out_features, module.in_features) for key, module in linears.items()}
