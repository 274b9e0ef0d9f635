"""A tiny SmolVLM2 (``SmolVLMForConditionalGeneration``) folder around the real SmolLM2, for video tests.

Built as ``tests.vlm_models.make_smolvlm`` builds its Idefics3: SmolLM2's own decoder weights (so a
text-only chat gives SmolLM2's tokens), a seeded random SigLIP-style vision tower (64x64 frames of
16x16 patches, pixel shuffle 2: 4 ``<image>`` tokens a frame) and the projector scaled so pictures
steer the answer. The processor is a ``SmolVLMProcessor`` with the Pillow image processor and no
video processor (``SmolVLMVideoProcessor`` needs torchvision); it is saved as
``save_processor_without_video`` saves Qwen2-VL's, with ``video_sampling`` in the image processor's
settings and a ``video_processor`` section as SmolVLM2's checkpoints have them, and it loads back with
``services.tokenizer.media.multimodal.MediaProcessor.load`` (``AutoProcessor`` cannot: ImportError).
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.tokenizer.media.smolvlm_video import use_number_words
from tests.vlm_models import (
    IDEFICS3_TOKENS,
    SMOL_DIR,
    chat_template,
    check_tied,
    extended_tokenizer,
    load_text_weights,
    match_embedding_scale,
    processor_without_video,
    save_generation_config,
    save_processor_without_video,
    smol_text_state,
)

# SmolVLM2's checkpoints: 1 frame a second, at most 64. Its video_size is moot, as in those checkpoints
# (one preprocessor config for both processors): SmolVLMVideoProcessor takes the config's top-level
# ``size`` over it, so frames go to 128 pixels on their longest edge, then to 64x64 (max_image_size).
VIDEO_SAMPLING = {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 96}}


def smolvlm2_processor(tokenizer, image_seq_len: int):
    """A SmolVLMProcessor with the Pillow image processor (images: 128-pixel longest edge, 64x64 tiles)
    and no video processor; the chat template renders an image item as ``<image>`` and a video item
    as ``<video>`` (SmolVLMProcessor's placeholders)."""
    from transformers import SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    use_number_words()
    image_processor = SmolVLMImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                               video_sampling=VIDEO_SAMPLING)
    processor = processor_without_video(SmolVLMProcessor, image_processor, tokenizer,
                                        chat_template("<image>", "<video>"))
    processor.image_seq_len = image_seq_len
    return processor


def make_smolvlm2(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save a SmolVLMForConditionalGeneration (SmolVLM2) into ``out``: SmolLM2 at ``base`` as the text
    model, a seeded random vision tower (64x64 images of 16x16 patches, scale factor 2: 4 tokens an
    image or frame), the processor and chat template described in the module docstring."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    out = Path(out)
    tokenizer = extended_tokenizer(base, IDEFICS3_TOKENS)
    text_config, state = smol_text_state(base, len(tokenizer))
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 64, "patch_size": 16}
    config = SmolVLMConfig(text_config=text_config, vision_config=vision, scale_factor=2,
                           image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                           tie_word_embeddings=True, pad_token_id=text_config["pad_token_id"])
    config.architectures = ["SmolVLMForConditionalGeneration"]
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config).eval()
    load_text_weights(model, "model.text_model", state)
    image_seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // config.scale_factor**2
    tokenizer.chat_template = chat_template("<image>", "<video>")
    processor = smolvlm2_processor(tokenizer, image_seq_len)
    match_embedding_scale(model, model.model.connector.modality_projection.proj, state["model.embed_tokens.weight"],
                          processor, seed)
    model.save_pretrained(out)
    save_processor_without_video(processor, out, "SmolVLMVideoProcessor")
    save_generation_config(base, out)
    check_tied(out, "model.text_model")
    return out
