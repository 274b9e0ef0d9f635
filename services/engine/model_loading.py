"""Loading a model folder for the runner: which architectures the engine runs, the transformers model (its
text half, and a vision-language model's media encoder), and for an AWQ or GPTQ folder the source of its
packed layers (``prequantized.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine import prequantized
from services.engine.multimodal import FAMILIES, MediaEncoder, TextView, family_of
from shared.model_folder import ModelFolderError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# vision-language models whose text model is one of these (services/engine/multimodal.py)
VISION_LANGUAGE = tuple(FAMILIES)
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl_text", "qwen2_5_vl_text")


class UnsupportedModel(ModelFolderError):
    """The folder's model is not one the engine runs (a start-up error: one line, exit 2)."""


def prequantized_config(path: str) -> dict | None:
    """The folder's ``quantization_config`` (config.json's, or an older checkpoint's ``quantize_config.json``) when
    its weights are an AWQ or GPTQ checkpoint; None for float weights."""
    from shared.model_folder import checkpoint_quantization, quantization_config, read_json

    settings, where = quantization_config(Path(path), read_json(Path(path) / "config.json"))
    return settings if checkpoint_quantization(settings, where) is not None else None


def load_model(path: str, device: torch.device, dtype: torch.dtype, checkpoint: dict | None = None, kernels=None):
    """The model's text half (a ``*ForCausalLM``, or a vision-language model's ``TextView``), for a
    vision-language model its media encoder (else None), and for an AWQ or GPTQ folder (``checkpoint``: its
    quantization_config) the source of its packed layers (else None)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    check_architecture(config)
    family = family_of(config)
    if checkpoint is not None:
        if family is not None:
            raise UnsupportedModel(f"{checkpoint['quant_method']} checkpoints of vision-language models are not read")
        if hasattr(config, "quantization_config"):  # the skeleton is built plain; its projections come from the
            del config.quantization_config  # packed tensors
        tensors = prequantized.Tensors(Path(path))
        model = prequantized.load_skeleton(path, config, dtype, tensors)  # cpu: quantized layers run there only
        return model, None, prequantized.PrequantizedLinears(Path(path), checkpoint, kernels, tensors)
    if family is None:  # no gradients: a parameter that requires one makes inference tensors unusable outside inference mode
        return pretrained(AutoModelForCausalLM, path, dtype).to(device).eval().requires_grad_(False), None, None
    model_class = getattr(transformers, next(a for a in config.architectures if a in FAMILIES))
    full = pretrained(model_class, path, dtype).to(device).eval().requires_grad_(False)
    return TextView(full, family), MediaEncoder(full, family, device, dtype), None


def pretrained(model_class, path: str, dtype: torch.dtype):
    """``from_pretrained`` with every weight of the model read from the folder: a tensor the weights lack (which
    transformers fills with random numbers, in silence) or hold in another shape than config.json makes (which
    it refuses with the names in its log only) is a ModelFolderError naming it."""
    model, info = model_class.from_pretrained(path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    check_loaded(Path(path), info)
    return model


def check_loaded(folder: Path, info: dict) -> None:
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, stored, wanted = mismatched[0]
        raise ModelFolderError(f"{folder}: the weights hold {name} as {list(stored)}, config.json's model needs "
                               f"{list(wanted)}{_more(mismatched)}: the weights and config.json are not of one model")
    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return
    packed = sorted(k for k in info.get("unexpected_keys") or [] if k.rsplit(".", 1)[-1] in ("qweight", "qzeros"))
    if packed:
        raise ModelFolderError(f"{folder}: the weights are packed ({packed[0]}{_more(packed)}) but neither config.json "
                               "nor a quantize_config.json says how (a quantization_config)")
    raise ModelFolderError(f"{folder}: the weights have no tensor {missing[0]}{_more(missing)}, which config.json's "
                           "model needs (a layer count or a file that does not match?)")


def _more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def read_config(path: str):
    """transformers' config of the folder; ModelFolderError naming config.json when transformers refuses it (a
    hidden size that is not a multiple of the heads, ...), with the reason at the bottom of its chain."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise ModelFolderError(f"{Path(path) / 'config.json'}: transformers cannot read it: {cause}") from exc


def check_architecture(config) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        usual = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "LlamaForCausalLM")
        raise UnsupportedModel(f"config.json names no architectures: the engine runs the class it names (for this "
                               f"{config.model_type} model, \"architectures\": [\"{usual}\"])")
    if family_of(config) is not None:
        text = config.get_text_config()
        if text.model_type in TEXT_MODEL_TYPES:
            return
        archs = [f"{archs[0]} with a {text.model_type} text model"]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModel(
            f"unsupported model architecture {archs or config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES + VISION_LANGUAGE)}"
        )
