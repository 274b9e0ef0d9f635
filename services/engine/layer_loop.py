"""A decode step's layer loop as one C++ call (``csrc/layer_loop.cpp``), where every layer is made of parts it runs.

At one stream a small model's decode step is a few milliseconds, and each layer's nine kernel calls from Python
(argument conversion, the interpreter between them) add ~20 us: ~0.6 ms over 30 layers, more than a tenth of an
int4 step. The loop holds each layer's weights, norms and cache from load and calls the same kernels, so a step
gives the same results bit for bit. It runs steps of decode rows only, with no LoRA row and a 1-D rotary
embedding; everything else (prompts, adapters, Qwen3's q/k norms, a projection it does not know) takes the
Python loop, ``ModelRunner._layer``.
"""

from __future__ import annotations

from torch import nn

from services.engine import quant
from services.engine.batch import Batch
from services.engine.linears import PackedLinear

Q8, Q4, Q4P, ONEDNN = 0, 1, 2, 3  # as csrc/layer_loop.cpp's Kind


def describe(linear: nn.Module) -> tuple | None:
    """(kind, tensors, out_features, int8 activations, bias) of a projection the loop runs, or None."""
    if isinstance(linear, quant.Q8Linear) and linear.kernels is not None:
        return Q8, [linear.q, linear.s], linear.out_features, linear.int8_activations, linear.bias
    if isinstance(linear, quant.Q4Linear) and linear.kernels is not None:
        return Q4P if linear.packed else Q4, list(linear.stored), linear.out_features, False, linear.bias
    if isinstance(linear, PackedLinear):
        return ONEDNN, [linear.packed], linear.out_features, False, linear.bias
    return None


def build(runner) -> object | None:
    """The runner's LayerLoop, or None where its kernels have none or a layer has a part the loop does not run."""
    module = getattr(runner.ops, "module", None)
    if module is None or not hasattr(module, "LayerLoop") or runner.mrope_axes is not None:
        return None
    layers = []
    for lin, norms, kv in zip(runner.linears, runner.norms, runner.kv.layers):
        parts = [describe(part) for part in (lin.qkv, lin.o, lin.gate_up, lin.down)]
        if norms.qk is not None or not lin.is_silu or None in parts:
            return None
        layers.append((*parts, norms.middle, norms.after, (kv.k, kv.v, kv.k_scale, kv.v_scale)))
    return module.LayerLoop(layers, runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.block_size,
                            runner.scale)


def runs(batch: Batch) -> bool:
    """Whether the loop runs this step: decode rows only, none with an adapter, rotated by position."""
    return not batch.chunks and batch.prefill is None and batch.lora is None and batch.rope_cos is None
