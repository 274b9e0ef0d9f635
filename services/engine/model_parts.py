"""What a decoder step reads from the transformers model besides its weights, looked up once at load: each layer's
norms (weight and epsilon; a module attribute costs a dict walk, several times a layer and step) and, for
Qwen2-VL's multimodal rotary embedding, which position axis rotates each frequency."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.engine.model_loading import UnsupportedModel


def _norm(module) -> tuple[torch.Tensor, float]:
    """An RMSNorm module's weight and epsilon."""
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps")
    return module.weight, float(eps)


@dataclass
class LayerNorms:
    """A decoder layer's norms as the step uses them, looked up once (a module attribute costs a dict walk):
    (weight, epsilon) of its input norm, of the norm after attention, and of what follows the layer (the next
    layer's input norm, or the model's final norm); its attention module where it normalizes q and k (Qwen3)."""

    before: tuple[torch.Tensor, float]
    middle: tuple[torch.Tensor, float]
    after: tuple[torch.Tensor, float]
    qk: nn.Module | None


def layer_norms(inner: nn.Module) -> list[LayerNorms]:
    layers = list(inner.layers)
    follows = [layer.input_layernorm for layer in layers[1:]] + [inner.norm]
    return [LayerNorms(_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm), _norm(after),
                       layer.self_attn if hasattr(layer.self_attn, "q_norm") else None)
            for layer, after in zip(layers, follows)]


def mrope_axes(rotary, half: int, device: torch.device) -> torch.Tensor | None:
    """Qwen2-VL's multimodal rotary embedding: for each of the head's ``half`` frequencies, the axis
    (0 temporal, 1 height, 2 width) whose position it rotates by; None for a 1-D rotary embedding."""
    sections = getattr(rotary, "mrope_section", None)
    if not sections:
        return None
    axes = [i % 3 for i, size in enumerate(sections) for _ in range(size)]
    if len(axes) != half:
        raise UnsupportedModel(f"mrope_section {list(sections)} does not cover the head's {half} frequencies")
    return torch.tensor(axes, dtype=torch.long, device=device)
