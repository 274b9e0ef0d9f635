"""Tiny vision-language model folders of real transformers architectures.

The engine's multimodal path must match transformers token for token, so the tests need real model
folders (config, weights, processor, chat template) that load with ``AutoProcessor`` and
``AutoModelForImageTextToText``, yet build in seconds on a CPU and need no download:

- ``make_smolvlm``: an Idefics3 (SmolVLM) whose text model IS SmolLM2 (so text-only chats must give
  SmolLM2's exact tokens) with a small random SigLIP-style vision tower;
- ``make_llava``: a LLaVA with a small random CLIP tower and projector around SmolLM2;
- ``make_qwen2_vl``: a fully random tiny Qwen2-VL (M-RoPE), with SmolLM2's tokenizer.

Only the Pillow image processors (``*ImageProcessorPil``) are used: torchvision is not installed.
transformers' own outputs for them (the oracle) are in ``tests/vlm_oracles.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.media_items import test_image

ROOT = Path(__file__).resolve().parent.parent
SMOL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

# SmolLM2's ChatML template, list-aware: ``content`` may be a string (rendered exactly as SmolLM2's own
# template does) or a list of text/image/video/audio items; IMAGE, VIDEO and AUDIO are replaced per
# architecture.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% elif item['type'] == 'image' %}{{ '@IMAGE@' }}"
    "{% elif item['type'] == 'video' %}{{ '@VIDEO@' }}"
    "{% elif item['type'] == 'audio' %}{{ '@AUDIO@' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN2_VL_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

# The text to put where an image goes in a raw text prompt, per ``config.model_type``.
PLACEHOLDERS = {"idefics3": "<image>", "smolvlm": "<image>", "llava": "<image>", "qwen2_vl": QWEN2_VL_IMAGE,
                "qwen2_5_vl": QWEN2_VL_IMAGE}


def chat_template(image: str = "", video: str = "", audio: str = "") -> str:
    """SmolLM2's ChatML template, rendering an image item as ``image``, a video item as ``video`` and an
    audio item as ``audio``."""
    return _CHATML_TEMPLATE.replace("@IMAGE@", image).replace("@VIDEO@", video).replace("@AUDIO@", audio)


# ---------------------------------------------------------------------------------------------- text part


def extended_tokenizer(base: Path, tokens: list[str]):
    """SmolLM2's tokenizer with ``tokens`` added as special tokens (never split, kept by decode)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(tokens, special_tokens=True)
    return tokenizer


def smol_text_state(base: Path, vocab_size: int) -> tuple[dict, dict]:
    """SmolLM2's config dict and decoder weights (``model.*`` names), embeddings grown to ``vocab_size``.

    New rows are the mean of the existing rows: a neutral embedding that leaves text-only outputs
    untouched (they are never looked up) and, through the tied head, rarely wins a greedy argmax.
    """
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = {k: v for k, v in lm.state_dict().items() if k.startswith("model.")}
    embed = state["model.embed_tokens.weight"]
    extra = embed.mean(0, keepdim=True).expand(vocab_size - embed.shape[0], -1)
    state["model.embed_tokens.weight"] = torch.cat([embed, extra]).contiguous()
    config = lm.config.to_dict()
    config["vocab_size"] = vocab_size
    return config, state


def load_text_weights(model, text_module: str, state: dict) -> None:
    """Copy SmolLM2's decoder weights into ``model``'s text decoder at ``text_module``, and tie the head."""
    decoder = model.get_submodule(text_module)
    missing, unexpected = decoder.load_state_dict({k[len("model."):]: v for k, v in state.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, decoder.embed_tokens.weight)


def match_embedding_scale(model, projection: torch.nn.Linear, embed: torch.Tensor, processor, seed: int) -> None:
    """Redraw the projector's last layer so image features have the RMS of SmolLM2's token embeddings.

    With the default init (std 0.02) SmolVLM's features are ~2.5x larger than any token embedding, and
    LLaVA's ~10x smaller, and SmolLM2 mostly ignores them (different images, same greedy text); on the
    embeddings' scale the image visibly steers the answer, so a test that drops or misplaces the
    features fails. The layer is redrawn (seeded) then scaled by target / measured RMS on a test image.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator))
        if projection.bias is not None:
            projection.bias.zero_()
        inputs = processor(text=processor.image_token, images=[test_image(0)], return_tensors="pt")
        pixels = {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask") if k in inputs}
        features = torch.cat(list(model.model.get_image_features(**pixels).pooler_output))
        projection.weight.mul_(embed.pow(2).mean().sqrt() / features.pow(2).mean().sqrt())


def check_tied(out: Path, text_module: str) -> None:
    """The saved folder reloads with the LM head equal to the embeddings (SmolLM2 ties them)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    embed = model.get_submodule(text_module).embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed), "lm_head is not tied to embed_tokens after reload"


# ---------------------------------------------------------------------------------------------- SmolVLM


def idefics3_processor(tokenizer, image_seq_len: int):
    """An Idefics3Processor with the Pillow image processor, sized so an image is a few 64x64 tiles."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len,
                             chat_template=chat_template("<image>"))


def make_smolvlm(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save an Idefics3ForConditionalGeneration (SmolVLM) into ``out``: SmolLM2 at ``base`` as the text
    model, a seeded random vision tower (64x64 tiles of 16x16 patches, pixel shuffle 2: 4 tokens a tile)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out = Path(out)
    tokenizer = extended_tokenizer(base, IDEFICS3_TOKENS)
    text_config, state = smol_text_state(base, len(tokenizer))
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 64, "patch_size": 16}
    config = Idefics3Config(text_config=text_config, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=True, pad_token_id=text_config["pad_token_id"])
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    load_text_weights(model, "model.text_model", state)
    image_seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // config.scale_factor**2
    tokenizer.chat_template = chat_template("<image>")
    processor = idefics3_processor(tokenizer, image_seq_len)
    match_embedding_scale(model, model.model.connector.modality_projection.proj, state["model.embed_tokens.weight"],
                          processor, seed)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    save_generation_config(base, out)
    check_tied(out, "model.text_model")
    return out


def save_generation_config(base: Path, out: Path) -> None:
    """SmolLM2's generation_config.json (bos/eos/pad ids), so generate stops and pads as SmolLM2's does."""
    source = Path(base) / "generation_config.json"
    if source.exists():
        (Path(out) / "generation_config.json").write_text(source.read_text())


# ---------------------------------------------------------------------------------------------- LLaVA


def llava_processor(tokenizer, image_size: int, patch_size: int):
    """A LlavaProcessor with CLIP's Pillow image processor (resize + centre crop to ``image_size``), as
    the llava-1.5-hf checkpoints; the CLS token is dropped ("default" strategy), so (size/patch)^2 tokens."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token="<image>", chat_template=chat_template("<image>"))


def make_llava(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save a LlavaForConditionalGeneration into ``out``: SmolLM2 at ``base`` as the text model, a seeded
    random CLIP tower (32x32 images, 8x8 patches: 16 image tokens) and a 2-layer GELU projector."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out = Path(out)
    tokenizer = extended_tokenizer(base, ["<image>"])
    text_config, state = smol_text_state(base, len(tokenizer))
    vision = {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 64}
    image_tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    config = LlavaConfig(text_config=text_config, vision_config=vision,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=image_tokens,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=True)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    load_text_weights(model, "model.language_model", state)
    tokenizer.chat_template = chat_template("<image>")
    processor = llava_processor(tokenizer, vision["image_size"], vision["patch_size"])
    match_embedding_scale(model, model.model.multi_modal_projector.linear_2, state["model.embed_tokens.weight"],
                          processor, seed)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    save_generation_config(base, out)
    check_tied(out, "model.language_model")
    return out


# ---------------------------------------------------------------------------------------------- Qwen2-VL


def qwen2_vl_processor(tokenizer, patch_size: int, merge_size: int, temporal_patch_size: int,
                       processor_cls=None):
    """A Qwen2VLProcessor (or ``processor_cls``: Qwen2_5_VLProcessor) with the Pillow image processor and
    NO video processor (Qwen2-VL's only video processor imports torchvision); pixels are bounded so an
    image gives 4 to 16 image tokens."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    unit = (patch_size * merge_size) ** 2  # the pixels of one image token
    image_processor = Qwen2VLImageProcessorPil(min_pixels=4 * unit, max_pixels=16 * unit, patch_size=patch_size,
                                               merge_size=merge_size, temporal_patch_size=temporal_patch_size)
    return processor_without_video(processor_cls or Qwen2VLProcessor, image_processor, tokenizer,
                                   chat_template(QWEN2_VL_IMAGE, QWEN2_VL_VIDEO))


def processor_without_video(cls, image_processor, tokenizer, template: str, **extra):
    """A ``cls`` processor (e.g. Qwen2VLProcessor) whose ``video_processor`` is None.

    ProcessorMixin requires every sub-processor in ``__init__``'s signature and checks its class against
    VideoProcessorMixin, which transformers does not define without torchvision: even ``None`` is
    refused (ValueError "Could not find module VideoProcessorMixin"). Images never touch the video
    processor, so skip that one check, on this instance only; the class (and the saved
    ``processor_class``) stays ``cls``.
    """
    processor = cls.__new__(cls)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = lambda name, arg: None if arg is None else check(name, arg)
    processor.__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                       chat_template=template, **extra)
    del processor.check_argument_for_proper_class
    return processor


def make_qwen2_vl(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save a tiny random Qwen2VLForConditionalGeneration into ``out``, with SmolLM2's tokenizer from
    ``base`` plus the vision tokens: hidden 64, 2 layers, 4 heads (head_dim 16, M-RoPE sections
    [2, 3, 3] = 8 rotary pairs for t/h/w), vision tower embed 32, depth 2, 14x14 patches, 2x2 merge.

    Weights are drawn with std 0.1, not the default 0.02: at 0.02 the tied head's argmax is the last
    input token (the residual stream is almost only its embedding), so every prompt and image gives
    "\\n\\n\\n...", and a test could not tell images apart."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": 0.1}
    return _make_qwen_vl(out, base, seed, Qwen2VLConfig, Qwen2VLForConditionalGeneration, None, vision)


def make_qwen2_5_vl(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save a tiny random Qwen2_5_VLForConditionalGeneration into ``out``: the text model of
    ``make_qwen2_vl``; a vision tower of 2 blocks (one windowed, one full attention), width 32, an RMSNorm
    merger to 64; 2 temporal positions per second of video."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [1], "tokens_per_second": 2, "initializer_range": 0.1}
    return _make_qwen_vl(out, base, seed, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                         Qwen2_5_VLProcessor, vision)


def _make_qwen_vl(out: Path, base: Path, seed: int, config_cls, model_cls, processor_cls, vision: dict) -> Path:
    """A Qwen2-VL-family folder: ``vision`` is its vision config; the text model and tokens are shared."""
    out = Path(out)
    tokenizer = extended_tokenizer(base, QWEN2_VL_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_VL_TOKENS}
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": True, "initializer_range": 0.1}
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, initializer_range=0.1)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out)
    tokenizer.chat_template = chat_template(QWEN2_VL_IMAGE, QWEN2_VL_VIDEO)
    processor = qwen2_vl_processor(tokenizer, vision["patch_size"], vision["spatial_merge_size"],
                                   vision["temporal_patch_size"], processor_cls)
    save_processor_without_video(processor, out, "Qwen2VLVideoProcessor")
    save_generation_config(base, out)
    check_tied(out, "model.language_model")
    return out


def save_processor_without_video(processor, out: Path, video_type: str) -> None:
    """What ``processor.save_pretrained(out)`` writes (tokenizer files, chat_template.jinja, processor_config.json),
    which itself fails on the None video processor.

    processor_config.json also gets a ``video_processor`` section (class ``video_type``, the image
    processor's sizes), as real checkpoints have: with torchvision, AutoProcessor then loads the folder
    as is (without that section it raises OSError, even with torchvision, looking for one).
    """
    processor.tokenizer._set_processor_class(type(processor).__name__)
    processor.tokenizer.save_pretrained(out)
    (Path(out) / "chat_template.jinja").write_text(processor.chat_template)
    config = {key: value for key, value in processor.to_dict().items() if value is not None}
    video = {key: value for key, value in config["image_processor"].items() if key != "image_processor_type"}
    config["video_processor"] = {**video, "video_processor_type": video_type}
    (Path(out) / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_smolvlm2(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    from tests.smolvlm2_models import make_smolvlm2  # it builds on this module

    return make_smolvlm2(out, base, seed)


BUILDERS = {"smolvlm": make_smolvlm, "smolvlm2": _make_smolvlm2, "llava": make_llava, "qwen2_vl": make_qwen2_vl,
            "qwen2_5_vl": make_qwen2_5_vl}


def main(argv=None) -> None:
    """python -m tests.vlm_models DIR [--arch smolvlm|smolvlm2|llava|qwen2_vl|qwen2_5_vl] [--base PATH]: a demo
    folder (README)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=sorted(BUILDERS), default="smolvlm")
    parser.add_argument("--base", type=Path, default=SMOL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(BUILDERS[args.arch](args.out, args.base, seed=args.seed))


if __name__ == "__main__":
    main()
