"""Vision-language models: the text decoder the engine's step runs, and the encoder that turns a
request's preprocessed media into the features placed at its media tokens.

A Hugging Face vision-language folder (SmolVLM / Idefics3, LLaVA) is a text decoder of an
architecture the step already runs, plus a vision tower and a projector. The engine loads the whole
model; the step runs the decoder as for a text model, and the vision tower and projector run here,
once per request, on the tensors the tokenizer service made from the request's images
(``MediaInputs``: the model's own processor's outputs). Their result is placed at the prompt's image
tokens, in order, exactly as transformers' ``masked_scatter`` places them, and kept with the request:
a preempted request recomputes its prompt from these features, not from the pixels.

Why the encoder runs in the engine and not in the tokenizer: it is a transformer of its own (SigLIP
400M beside SmolVLM-2B, a 675M ViT beside Qwen2-VL-7B) that wants the accelerator and the model's
dtype, and its weights belong in the engine's memory once. The tokenizer keeps what is CPU work in
every server (fetching, decoding, resizing, tiling, normalising), which scales out with its instances.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import torch
from torch import nn

from shared.messages import EngineRequest, MediaInputs, Tensor
from shared.prefix_hash import client_salt, media_salt


@dataclass(frozen=True)
class Family:
    """What the engine needs to know of one vision-language architecture."""

    text: str  # the text decoder's path in the loaded model (the module with .layers, .embed_tokens)
    modalities: tuple[str, ...]
    encode: Callable[[nn.Module, dict[str, torch.Tensor]], list[tuple[int, torch.Tensor]]]
    mrope: bool = False  # Qwen2-VL's multimodal rotary embedding: media tokens get 3-D positions


def _encode_images(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Image features from the processor's tensors through the model's own get_image_features."""
    names = IMAGE_INPUTS[type(model).__name__]
    missing = [name for name in names[:1] if name not in tensors]
    if missing:
        raise ValueError(f"the request's media lack {missing[0]}")
    out = model.model.get_image_features(**{name: tensors[name] for name in names if name in tensors})
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return [(model.config.image_token_id, features.reshape(-1, features.shape[-1]))]


def _encode_qwen2_vl(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Qwen2-VL: images and videos through the vision tower, each kind to its own token."""
    out = []
    if "pixel_values" in tensors:
        out += _encode_images(model, tensors)
    if "pixel_values_videos" in tensors:
        videos = model.model.get_video_features(tensors["pixel_values_videos"], tensors["video_grid_thw"])
        out.append((model.config.video_token_id, torch.cat(list(videos.pooler_output))))
    if not out:
        raise ValueError("the request's media hold neither pixel_values nor pixel_values_videos")
    return out


def _encode_audio(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Qwen2-Audio: each clip's log-mel features through the audio tower (padding frames masked out)
    and the projector, then only each clip's own frames, in order (what transformers' forward does)."""
    from transformers.masking_utils import create_bidirectional_mask

    inner = model.model
    features, mask = tensors["input_features"], tensors["feature_attention_mask"]
    tower = inner.audio_tower
    lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
    clips, _, frames = features.shape
    width = (frames - 2) // 2 + 1
    valid = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()
    dummy = torch.zeros((clips, width, 1), dtype=model.dtype, device=features.device)
    attention = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=valid)
    hidden = tower(features.to(model.dtype), attention_mask=attention).last_hidden_state
    projected = inner.multi_modal_projector(hidden)
    keep = torch.arange(projected.shape[1], device=projected.device)[None, :] < out_lengths[:, None]
    return [(model.config.audio_token_id, projected[keep])]


IMAGE_INPUTS = {
    "Idefics3ForConditionalGeneration": ("pixel_values", "pixel_attention_mask"),
    "SmolVLMForConditionalGeneration": ("pixel_values", "pixel_attention_mask"),
    "LlavaForConditionalGeneration": ("pixel_values", "image_sizes"),
    "Qwen2VLForConditionalGeneration": ("pixel_values", "image_grid_thw"),
    "Qwen2_5_VLForConditionalGeneration": ("pixel_values", "image_grid_thw"),
}

FAMILIES = {
    "Idefics3ForConditionalGeneration": Family("model.text_model", ("image",), _encode_images),
    "SmolVLMForConditionalGeneration": Family("model.text_model", ("image", "video"), _encode_images),
    "LlavaForConditionalGeneration": Family("model.language_model", ("image",), _encode_images),
    "Qwen2VLForConditionalGeneration": Family("model.language_model", ("image", "video"), _encode_qwen2_vl,
                                              mrope=True),
    "Qwen2_5_VLForConditionalGeneration": Family("model.language_model", ("image", "video"), _encode_qwen2_vl,
                                                 mrope=True),
    "Qwen2AudioForConditionalGeneration": Family("model.language_model", ("audio",), _encode_audio),
}


def family_of(config) -> Family | None:
    """The vision-language family of a model's config, or None for a text model."""
    return next((FAMILIES[a] for a in getattr(config, "architectures", None) or [] if a in FAMILIES), None)


class TextView(nn.Module):
    """The text half of a vision-language model, shaped like a ``*ForCausalLM``: ``.model`` is the
    decoder and ``.lm_head`` the head, so the step and ``linears.build`` treat both kinds alike."""

    def __init__(self, full: nn.Module, family: Family):
        super().__init__()
        self.model = attrgetter(family.text)(full)
        self.lm_head = full.lm_head
        self.config = full.config.get_text_config()
        self.generation_config = getattr(full, "generation_config", None)


@dataclass
class MediaRows:
    """A request's media features and the prompt positions they go to, both in position order."""

    positions: torch.Tensor  # [K] long, ascending
    embeds: torch.Tensor  # [K, hidden]
    rope: torch.Tensor | None = None  # M-RoPE: [3, prompt length] (temporal, height, width) positions
    rope_delta: int = 0  # M-RoPE: a generated token at position p rotates as p + rope_delta

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[n, 3] rotary positions of sequence positions [start, end): the prompt's from ``rope``, a
        generated token's p + rope_delta on all three axes."""
        prompt = self.rope.shape[1]
        inside = self.rope[:, start:min(end, prompt)].T
        after = torch.arange(max(start, prompt), max(end, prompt), device=self.rope.device) + self.rope_delta
        return torch.cat([inside, after[:, None].expand(-1, 3)])

    def within(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positions in [start, end) and their features, or None when there are none."""
        lo = int(torch.searchsorted(self.positions, start))
        hi = int(torch.searchsorted(self.positions, end))
        return None if lo == hi else (self.positions[lo:hi], self.embeds[lo:hi])


class MediaEncoder:
    """Runs a vision-language model's encoder for one request at a time."""

    def __init__(self, full: nn.Module, family: Family, device: torch.device, dtype: torch.dtype):
        self.full, self.family = full, family
        self.device, self.dtype = device, dtype

    @property
    def modalities(self) -> list[str]:
        return list(self.family.modalities)

    @functools.cached_property
    def token_ids(self) -> frozenset[int]:
        """The model's media tokens' ids (those the encoder's features replace)."""
        config = self.full.config
        return frozenset(getattr(config, name) for name in ("image_token_id", "video_token_id", "audio_token_id")
                         if isinstance(getattr(config, name, None), int))

    def encode(self, media: MediaInputs, prompt_ids: list[int]) -> MediaRows:
        """The request's features and their prompt positions; ValueError when they do not match its
        media tokens one for one (transformers raises the same)."""
        tensors = {name: from_wire(t).to(self.device) for name, t in media.tensors.items()}
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        positions, embeds = [], []
        for token_id, features in self.family.encode(self.full, tensors):
            where = (ids == token_id).nonzero().flatten()
            if where.numel() != features.shape[0]:
                raise ValueError(f"media features and media tokens do not match: {where.numel()} tokens "
                                 f"(id {token_id}), {features.shape[0]} features")
            positions.append(where)
            embeds.append(features.to(self.dtype))
        position = torch.cat(positions)
        order = position.argsort()
        rows = MediaRows(position[order].to(self.device), torch.cat(embeds)[order])
        if self.family.mrope:
            rope, delta = self.full.model.get_rope_index(ids[None].to(self.device), **_rope_inputs(tensors))
            rows.rope, rows.rope_delta = rope[:, 0].long(), int(delta.flatten()[0])
        return rows


def _rope_inputs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What Qwen2-VL's (and Qwen2.5-VL's) get_rope_index reads of the processor's tensors."""
    names = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    return {name: tensors[name] for name in names if name in tensors}


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8}


def from_wire(t: Tensor) -> torch.Tensor:
    """A bus tensor as a torch tensor (its own copy of the bytes)."""
    if t.dtype not in DTYPES:
        raise ValueError(f"media tensor dtype {t.dtype!r} is not one of {', '.join(DTYPES)}")
    flat = torch.frombuffer(bytearray(t.data), dtype=DTYPES[t.dtype]) if t.data else torch.empty(0, dtype=DTYPES[t.dtype])
    return flat.reshape(t.shape)


@dataclass(frozen=True)
class Salts:
    """A request's prefix-cache salts after its adapter's (``Sequence.more_salt``, ``media_from``, ``media_salt``)."""

    more: bytes  # its client's cache_salt's: blocks shared only among requests giving the same salt
    media_from: int = -1  # the block holding its first media token (-1: no media)
    media: bytes = b""  # its media's digest's, joining that block's parent: K/V from an image on are its own


def salts(req: EngineRequest, media_ids: frozenset[int], block_size: int) -> Salts:
    """``req``'s salts; ``media_ids``: the model's media token ids (``MediaEncoder.token_ids``). The blocks before
    the first media token are the text's alone (tokens before an image attend to none of it), so a long
    system prompt is cached for requests with and without images alike, as vLLM keys them."""
    more = client_salt(req.cache_salt)
    if req.media is None:
        return Salts(more)
    first = next((i for i, token in enumerate(req.prompt_ids) if token in media_ids), 0)
    return Salts(more, first // block_size, media_salt(req.media.digest))
