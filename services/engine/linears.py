"""The model's matrix products, made cheap: merged projections and, on the CPU, prepacked weights.

Each layer's q, k and v projections become one matrix product, and so do the MLP's gate and up
projections (fewer, larger products, as vLLM's QKVParallelLinear and MergedColumnParallelLinear).
On the CPU in float32 and bfloat16 every weight is then reordered once into oneDNN's blocked layout, as
torch.compile's freezing pass does: a decode step multiplies a few rows by each matrix, and
PyTorch's default kernel runs those small products (above all the vocabulary-wide lm_head) far
from the CPU's peak. Together: a 16-row decode step of SmolLM2 1.6-1.9x faster on a 2-core AVX2
machine (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from services.engine import quant, quant_cuda
from shared.config import ConfigError

log = logging.getLogger("switchboard.engine")


def check_format(quantization: str, device: torch.device) -> None:
    """Refuse a weight format the device has no kernel for, naming the key and what it takes there."""
    if quantization == "none":
        return
    if device.type == "cpu":
        if quantization == "fp8":
            raise ConfigError(f"Switchboard.quantization {quantization!r} runs on cuda only (a GPU of compute "
                             f"capability 8.9 or newer); on cpu: int8, int4 or gguf")
        return
    why = quant_cuda.unsupported(quantization, device)
    if why is not None:
        what = (f"the model folder's {quantization.upper()} checkpoint" if quantization in quant_cuda.CHECKPOINTS
                else f"Switchboard.quantization {quantization!r}")
        raise ValueError(f"{what} {why}")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's layout; same results as nn.Linear to float rounding."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the engine's rows
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


@dataclass
class LayerLinears:
    """One decoder layer's projections: qkv and gate_up merged, outputs split by these sizes."""

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]
    qkv_sizes: tuple[int, int, int]
    intermediate: int

    @property
    def is_silu(self) -> bool:
        """torch's SiLU or transformers' own SiLUActivation (what ACT2FN["silu"] gives)."""
        return isinstance(self.act, nn.SiLU) or type(self.act).__name__ == "SiLUActivation"

    def act_mul(self, ops, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the merged gate/up output: one fused op for SiLU (every supported model)."""
        if self.is_silu:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.act(gate) * up


def merge(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the given linears' outputs side by side."""
    weight = torch.cat([l.weight.detach() for l in linears])
    has_bias = any(l.bias is not None for l in linears)
    merged = nn.Linear(linears[0].in_features, weight.shape[0], bias=has_bias,
                       device=weight.device, dtype=weight.dtype).requires_grad_(False)
    merged.weight.data = weight
    if has_bias:
        merged.bias.data = torch.cat([l.bias.detach() if l.bias is not None else
                                      torch.zeros(l.out_features, dtype=weight.dtype, device=weight.device)
                                      for l in linears])
    return merged


GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}  # merged: parts


class LayerSource(Protocol):
    """Where a model's projections come from when not from its float weights: a GGUF file
    (``gguf_weights.GgufLinears``), an AWQ or GPTQ checkpoint (``prequantized.PrequantizedLinears``)."""

    def layer(self, index: int, shapes: dict[str, tuple[int, int]]) -> dict[str, nn.Module]: ...


def layer_linears(layer: nn.Module, pack: bool, batch_hint: int, quantization: str = "none",
                  kernels=None, source: LayerSource | None = None, index: int = 0,
                  gpu: torch.device | None = None, dtype: torch.dtype = torch.float32, ops=None) -> LayerLinears:
    """Merge a transformers decoder layer's projections (and drop the originals to free memory); then pack
    them for oneDNN, or quantize them (``quant.py``; on a GPU, ``gpu``, ``quant_cuda.py``), or take them
    from ``source`` (with the float model's biases; on a GPU in its formats there, ``dtype`` where it has none).
    ``ops``: the device's small operations, which the GPU formats use."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    sizes, intermediate = (q.out_features, k.out_features, v.out_features), mlp.gate_proj.out_features
    if source is not None:
        parts = {"q": q, "k": k, "v": v, "o": attn.o_proj, "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        mods = source.layer(index, quant.shapes_of(parts))
        for name, keys in GROUPS.items():
            if mods[name].bias is None:
                mods[name].bias = merged_bias([parts[key] for key in keys])
            if gpu is not None:
                mods[name] = quant_cuda.place(mods[name], gpu, dtype)
        out = LayerLinears(mods["qkv"], mods["o"], mods["gate_up"], mods["down"], mlp.act_fn, sizes, intermediate)
        quantization = "none"  # already in their format
    else:
        out = LayerLinears(merge([q, k, v]), attn.o_proj, merge([mlp.gate_proj, mlp.up_proj]), mlp.down_proj,
                           mlp.act_fn, sizes, intermediate)
    for module, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            delattr(module, name)
    for name in ("qkv", "o", "gate_up", "down"):
        if quantization != "none" and gpu is not None:
            setattr(out, name, quant_cuda.quantize(getattr(out, name), quantization, ops))
        elif quantization != "none":
            setattr(out, name, quant.quantize(getattr(out, name), quantization, kernels))
        elif pack and source is None:
            setattr(out, name, PackedLinear(getattr(out, name), batch_hint))
    return out


def merged_bias(linears: list[nn.Module]) -> torch.Tensor | None:
    """The float linears' biases side by side (zeros for one without), or None when none has one."""
    if all(l.bias is None for l in linears):
        return None
    like = next(l.bias for l in linears if l.bias is not None)
    return torch.cat([l.bias.detach().float() if l.bias is not None else torch.zeros(l.out_features, device=like.device)
                      for l in linears])


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on any CPU oneDNN runs on; bfloat16 where oneDNN has bfloat16 kernels for this CPU."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def build(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_hint: int, quantization: str = "none",
          kernels=None, source: LayerSource | None = None, gpu_formats: bool | None = None,
          ops=None) -> list[LayerLinears]:
    """Every layer's merged projections; on cpu (float32, bfloat16) these and the lm_head are packed, or with
    ``quantization`` (int8, int4) quantized, or (gguf, awq, gptq) taken from ``source``: the layers in its
    format, the lm_head in int8 (the logits are where 4 bits cost the most quality). ``kernels``: the CPU
    kernels the quantized layers run on. On a GPU (``gpu_formats``, by default off the cpu) the layers are
    quantized on PyTorch's kernels (``quant_cuda.py``: int4, fp8; ``ops``: the device's small operations) and the
    lm_head keeps the model's dtype."""
    gpu_formats = device.type != "cpu" if gpu_formats is None else gpu_formats
    pack = can_pack(device, dtype) and quantization == "none"
    own = quantization if source is None else "none"
    gpu = device if gpu_formats else None
    layers = [layer_linears(layer, pack, batch_hint, own, kernels, source, i, gpu, dtype, ops)
              for i, layer in enumerate(model.model.layers)]
    if quantization != "none" and not gpu_formats:
        model.lm_head = quant.quantize_head(model.lm_head, kernels)
    elif pack:
        model.lm_head = PackedLinear(model.lm_head, batch_hint)
    log.info("linear layers ready", extra={"layers": len(layers), "packed": pack, "quantization": quantization})
    return layers
