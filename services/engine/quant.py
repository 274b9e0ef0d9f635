"""Quantized linear layers: fewer bytes per weight, so a decode step, which reads every weight once, reads less.

Two packed formats, each run by a matrix product PyTorch ships (the "maintained library" of issue 25):

* ``Int8Linear`` (W8A16): an int8 weight per output channel, symmetric (``w = q * scale``), activations
  in the model's dtype; ``torch._weight_int8pack_mm``.
* ``Int4Linear`` (W4A16): 4-bit weights in groups of ``group`` input columns, each group with a scale
  and a zero (``w = (q - 8) * scale + zero``, q in 0..15: tinygemm's convention, into which GGUF's
  Q4_0, Q4_1 and Q4_K and AWQ/GPTQ's groups convert exactly); ``torch._weight_int4pack_mm_for_cpu``.

Both hold only the packed weight (the float one is dropped) and give back their dequantized float weight
(``dequantized``) for checks. ``quantize`` picks one for a float ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

FORMATS = ("none", "int8", "int4")
INT4_GROUPS = (32, 64, 128, 256)


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = qweight.contiguous()  # int8 [out, in]
        self.scales = scales.to(dtype).contiguous()  # [out]
        self.bias = None if bias is None else bias.detach().to(dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        """``q``: int32 [out, in] in 0..15; ``scales``, ``zeros``: [out, in / group]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group = group
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32) -> Int4Linear:
        """Asymmetric groups: each group's range [min, max] onto 0..15."""
        out_features, in_features = weight.shape
        w = weight.detach().float().reshape(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((high - low) / 15.0).clamp(min=1e-8)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        zero = low + 8.0 * scale
        return cls(q.reshape(out_features, in_features), scale, zero, group, bias, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_and_zeros).float().T


def fits_int4(linear: nn.Linear, group: int) -> bool:
    return linear.in_features % group == 0


def quantize(linear: nn.Linear, fmt: str, group: int = 32) -> nn.Module:
    """``linear`` in ``fmt`` (int8, or int4 where its input width divides into groups, else int8)."""
    if fmt == "int4" and fits_int4(linear, group):
        return Int4Linear.from_float(linear.weight, linear.bias, group)
    return Int8Linear.from_float(linear.weight, linear.bias)
