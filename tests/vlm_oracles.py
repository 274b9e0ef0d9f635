"""transformers' own outputs for the folders of ``tests/vlm_models.py``: the oracle the engine's multimodal
path must match token for token (its processor, its greedy ``generate``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from tests.vlm_models import PLACEHOLDERS, processor_without_video


def load_processor(model_dir: Path):
    """``AutoProcessor.from_pretrained(model_dir)``; for Qwen2-VL and Qwen2.5-VL without torchvision (where
    AutoProcessor raises ImportError: Qwen2VLVideoProcessor requires torchvision), the folder's processor
    class built from its image processor and tokenizer, with no video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except ImportError:
        if model_type(model_dir) not in ("qwen2_vl", "qwen2_5_vl", "smolvlm"):
            raise
    config = json.loads((Path(model_dir) / "processor_config.json").read_text())
    if model_type(model_dir) == "smolvlm":  # SmolVLMProcessor needs num2words for videos' frame counts
        from services.tokenizer.media.smolvlm_video import use_number_words

        use_number_words()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    extra = {key: config[key] for key in ("image_seq_len",) if key in config}
    return processor_without_video(getattr(transformers, config["processor_class"]),
                                   AutoImageProcessor.from_pretrained(model_dir), tokenizer,
                                   (Path(model_dir) / "chat_template.jinja").read_text(), **extra)


# ---------------------------------------------------------------------------------------------- oracle


@functools.lru_cache(maxsize=4)
def load(model_dir: Path):
    """(processor, model) for ``model_dir``, float32, eval mode; cached, as loading dominates a test."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return processor, model


def model_type(model_dir: Path) -> str:
    """``config.model_type`` of the folder (idefics3, llava, qwen2_vl)."""
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def placeholder(model_dir: Path) -> str:
    """The text to put where an image goes in a raw text prompt for ``model_dir``'s architecture."""
    return PLACEHOLDERS[model_type(model_dir)]


def hf_inputs(model_dir: Path, images: list, *, text: str | None = None, messages: list | None = None,
              return_tensors: str = "pt"):
    """The processor's outputs, as transformers documents: a chat through ``apply_chat_template``, or
    raw ``text`` with ``placeholder(model_dir)`` where images go."""
    processor, _ = load(Path(model_dir))
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text= or messages=")
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=list(images) or None, return_tensors=return_tensors)


def hf_prompt_ids(model_dir: Path, images: list, *, text: str | None = None, messages: list | None = None) -> list[int]:
    """The processor's input_ids: the prompt with each image placeholder expanded to its image tokens."""
    return hf_inputs(model_dir, images, text=text, messages=messages)["input_ids"][0].tolist()


def hf_generate_prepared(model_dir: Path, prompt_ids: list[int], media, max_new_tokens: int = 16) -> list[int]:
    """transformers' greedy generate on exactly the ids and tensors the tokenizer service prepared (an
    ``EngineRequest``'s ``prompt_ids`` and ``media``): the oracle where transformers' own processor
    cannot run here (video processors need torchvision)."""
    from services.engine.multimodal import from_wire

    _, model = load(Path(model_dir))
    ids = torch.tensor([prompt_ids])
    tensors = {name: from_wire(t) for name, t in media.tensors.items()}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **tensors, do_sample=False,
                             max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:].tolist()


def hf_generate(model_dir: Path, images: list, *, text: str | None = None, messages: list | None = None,
                max_new_tokens: int = 16) -> list[int]:
    """transformers' greedy generation for the prompt and PIL ``images``: only the new token ids."""
    _, model = load(Path(model_dir))
    inputs = hf_inputs(model_dir, images, text=text, messages=messages)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
