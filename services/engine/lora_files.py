"""Reading a LoRA adapter in PEFT's folder format: ``adapter_config.json`` + ``adapter_model.safetensors``.

What the engine applies is plain LoRA on the decoder layers' q/k/v/o and gate/up/down projections:
``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``).
Every other PEFT feature changes that formula (DoRA's magnitudes, LoRA on the embeddings or the
lm_head, trained copies of whole modules, per-module ranks, biases), so an adapter using one is
refused with a message that names it rather than run with the feature silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.lora import Outcome

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default value changes the math (name -> what to say).
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out",
    "layer_replication": "layer_replication",
    "lora_bias": "lora_bias",
    "use_qalora": "QA-LoRA (use_qalora)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    # variants whose forward is not plain LoRA's (aLoRA applies the weights only after its invocation tokens)
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "velora_config": "VeLoRA (velora_config)",
}


class AdapterError(Exception):
    """An adapter that cannot be loaded: the outcome to answer and why."""

    def __init__(self, outcome: Outcome, detail: str = ""):
        super().__init__(detail or outcome.value)
        self.outcome = outcome
        self.detail = detail


@dataclass
class AdapterWeights:
    """One adapter's matrices by (layer, target): A [r, in] and B [out, r] with the scaling folded into B."""

    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a Llama-family decoder layer."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter(path: Path, config, max_rank: int) -> AdapterWeights:
    """The adapter at ``path`` as float32 tensors on the CPU; raises AdapterError."""
    settings = _settings(path)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(Outcome.INVALID, f"{CONFIG_FILE} needs a positive integer r and a number lora_alpha.")
    if rank > max_rank:
        raise AdapterError(Outcome.RANK, f"Its rank is {rank}; maxLoraRank is {max_rank}.")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _tensors(path / WEIGHTS_FILE)
    return AdapterWeights(str(path), rank, _pairs(tensors, config, rank, scaling))


def _settings(path: Path) -> dict:
    if not (path / CONFIG_FILE).is_file():
        raise AdapterError(Outcome.NOT_FOUND)
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(Outcome.INVALID, f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(settings, dict):
        raise AdapterError(Outcome.INVALID, f"{CONFIG_FILE} is not a JSON object.")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(Outcome.INVALID, f"peft_type {peft_type!r} is not supported; only LORA is.")
    for key, what in UNSUPPORTED.items():
        if settings.get(key):
            raise AdapterError(Outcome.INVALID, f"{what} is not supported.")
    if settings.get("bias", "none") != "none":
        raise AdapterError(Outcome.INVALID, f"bias {settings['bias']!r} is not supported; only 'none' is.")
    return settings


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise AdapterError(Outcome.INVALID, f"{WEIGHTS_FILE} is missing.")
    try:
        return load_file(str(file), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise AdapterError(Outcome.INVALID, f"{WEIGHTS_FILE} cannot be read: {exc}") from None


def _pairs(tensors: dict[str, torch.Tensor], config, rank: int, scaling: float):
    shapes, layers = target_shapes(config), config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            module = match.group(2) if match else key
            raise AdapterError(Outcome.INVALID, f"LoRA on {module!r} is not supported; only on "
                                                f"{', '.join(TARGETS)}.")
        layer = int(match.group(1))
        if layer >= layers:
            raise AdapterError(Outcome.INVALID, f"it has layer {layer}; the model has {layers} layers.")
        found.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not found:
        raise AdapterError(Outcome.INVALID, f"{WEIGHTS_FILE} holds no LoRA weights.")
    return {where: _pair(where, ab, shapes[where[1]], rank, scaling) for where, ab in sorted(found.items())}


def _pair(where, ab: dict[str, torch.Tensor], shape: tuple[int, int], rank: int, scaling: float):
    layer, target = where
    if set(ab) != {"A", "B"}:
        raise AdapterError(Outcome.INVALID, f"{target} of layer {layer} lacks lora_{'B' if 'A' in ab else 'A'}.")
    a, b = ab["A"].float(), ab["B"].float()
    n_in, n_out = shape
    if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
        raise AdapterError(Outcome.INVALID, f"{target} of layer {layer} has lora_A {list(a.shape)} and lora_B "
                                            f"{list(b.shape)}; this model needs {[rank, n_in]} and {[n_out, rank]} "
                                            "(an adapter for another base model?).")
    return a.contiguous(), (b * scaling).contiguous()
