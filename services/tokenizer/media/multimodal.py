"""A request's media made ready for the engine: fetched, decoded and run through the model's own processor.

The served folder's processor (``AutoProcessor``: the Pillow image processor of SmolVLM / Idefics3 or
LLaVA, and the tokenizer) resizes, tiles and normalises the images and expands each image placeholder
of the prompt into the model's image tokens, exactly as transformers does for ``generate``. The engine
gets the expanded prompt ids and the processor's tensors (``MediaInputs``); its encoder turns them into
the features placed at the image tokens (``services/engine/multimodal.py``).

Where the images go in the prompt: a chat's ``{"type": "image"}`` content items are rendered by the
model's chat template; a raw prompt (TGI and native ``inputs``, vLLM, Triton) is its text items
concatenated with the processor's image placeholder (``<image>``) where each image item was.

All of this is CPU work off the event loop (``asyncio.to_thread``); the tokenizer service scales out.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.tokenizer.encoder import template_turn
from services.tokenizer.media.fetch import fetch_refs
from shared.errors import validation
from shared.media import MediaPolicy
from shared.messages import ContentPart, GenerateRequest, MediaInputs, Tensor, Tokenize
from shared.model_folder import ModelFolderError, processor_config

log = logging.getLogger("switchboard.tokenizer")

TEXT_ONLY = "the served model is text-only"
SMOLVLM_VIDEO = "<video>"  # SmolVLM2's video placeholder (``smolvlm_video.py``)
VIDEO_FPS = 2.0  # frames sampled per second of video (transformers' Qwen2-VL default)
# a media token and the markers its model's chat template puts around it
MARKERS = {"<|image_pad|>": "<|vision_start|>{}<|vision_end|>", "<|video_pad|>": "<|vision_start|>{}<|vision_end|>",
           "<|AUDIO|>": "<|audio_bos|>{}<|audio_eos|>"}
DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
          np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool", np.dtype(np.uint8): "uint8"}


@dataclass(frozen=True)
class Prepared:
    """A request with media, ready for the engine: its expanded prompt ids and the processor's tensors."""

    ids: list[int]
    media: MediaInputs


class MediaProcessor:
    """The served model's processor, or none for a text model (then every media item is refused)."""

    def __init__(self, processor: Any | None, path: str = ""):
        self.processor = processor
        self.path = path  # the model folder (SmolVLM's video settings are read from it)
        self.modalities = media_kinds(processor)

    @classmethod
    def load(cls, path: str) -> MediaProcessor:
        """The folder's processor when it takes media (an image processor, an audio feature extractor);
        a text model's folder has none."""
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path)
        except ImportError:  # a video processor that needs torchvision (Qwen2-VL's): built without it
            processor = _without_video(path)
        except (OSError, ValueError) as exc:
            log.info("no media processor: the model is served text-only", extra={"reason": str(exc)})
            return cls(None)
        return cls(processor if media_kinds(processor) else None, path)

    @functools.cached_property
    def token_ids(self) -> frozenset[int]:
        """The ids of the tokens the model's encoder features replace (its ``<image>``, ``<|image_pad|>``, …)."""
        if self.processor is None:
            return frozenset()
        tokens = [getattr(self.processor, f"{kind}_token", None) for kind in self.modalities]
        ids = self.processor.tokenizer.convert_tokens_to_ids([t for t in tokens if isinstance(t, str)])
        return frozenset(i for i in ids if isinstance(i, int))

    def first_media_token(self, ids: list[int]) -> int:
        """The position of the prompt's first media token (0 when none is found: all of it the media's)."""
        media = self.token_ids
        return next((i for i, token in enumerate(ids) if token in media), 0)

    @property
    def placeholder(self) -> str:
        """What marks an image's place in a raw text prompt."""
        return self.placeholder_of("image")

    def placeholder_of(self, kind: str) -> str:
        """What marks a media item's place in a raw text prompt, as the model's chat template writes it:
        ``<image>`` (SmolVLM, LLaVA); Qwen2-VL's pad tokens inside its vision markers; Qwen2-Audio's
        ``<|AUDIO|>`` inside its audio markers."""
        token = getattr(self.processor, f"{kind}_token", None) or f"<{kind}>"
        return MARKERS.get(token, "{}").format(token)

    async def prepare(self, req: GenerateRequest | Tokenize, tokenizer, policy: MediaPolicy,
                      timeout_s: float | None = None) -> Prepared:
        """Fetch, decode and process the request's media; 422 for a kind the model does not take."""
        refs = [part.media for part in req.parts if part.media is not None]
        for i, ref in enumerate(refs):
            if ref.kind not in self.modalities:
                what = TEXT_ONLY if not self.modalities else f"the served model takes {', '.join(self.modalities)} only"
                raise validation(f"media item {i}: {ref.kind} inputs are not supported: {what}.")
        contents = await fetch_refs(refs, policy, timeout_s)
        text = self.prompt_text(req, tokenizer)
        return await asyncio.to_thread(self.process, text, list(zip([r.kind for r in refs], contents)))

    def prompt_text(self, req: GenerateRequest | Tokenize, tokenizer) -> str:
        """The prompt with a placeholder where each media item goes: a chat rendered by the model's
        template, a raw prompt's text items joined around the processor's placeholders."""
        if req.messages is not None:
            try:
                return tokenizer.apply_chat_template(req.messages, tokenize=False, **template_turn(req),
                                                     **req.chat_template_kwargs)
            except Exception as exc:  # a template error is the caller's messages not fitting the template
                raise validation(f"the messages do not fit the model's chat template: {exc}") from None
        return "".join(self._piece(part) for part in req.parts)

    def _piece(self, part: ContentPart) -> str:
        return part.text if part.media is None else self.placeholder_of(part.type)

    def process(self, text: str, items: list[tuple[str, bytes]]) -> Prepared:
        """The processor on the prompt and the decoded media (``(kind, bytes)`` in prompt order): the
        expanded ids and its tensors."""
        images = [decode_image(data, i) for i, (kind, data) in enumerate(items) if kind == "image"]
        audios = [self._audio(data, i) for i, (kind, data) in enumerate(items) if kind == "audio"]
        if any(kind == "video" for kind, _ in items):
            if getattr(self.processor, "video_token", None) == SMOLVLM_VIDEO:
                return self._smolvlm_videos(text, images, items)
            return self._with_videos(text, images, [_video(data, i) for i, (kind, data) in enumerate(items)
                                                    if kind == "video"])
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = [images]
        if audios:
            kwargs.update(audio=audios, sampling_rate=self.processor.feature_extractor.sampling_rate)
        try:
            out = self.processor(text=[text], return_tensors="np", **kwargs)
        except (ValueError, TypeError) as exc:  # e.g. placeholders and media that do not pair up
            raise validation(f"the prompt and its media cannot be processed: {exc}") from None
        return prepared(out["input_ids"][0], {name: value for name, value in out.items()
                              if name not in ("input_ids", "attention_mask", "num_audio_tokens")})

    def _with_videos(self, text: str, images: list, videos: list[list]) -> Prepared:
        """Qwen2-VL with videos: transformers' processor refuses video placeholders without its video
        processor (which needs torchvision), so the prompt is tokenized alone, the images go through the
        image processor, each video's sampled frames through ``video.qwen2_vl_video`` (the video
        processor's computation), and both kinds of placeholder are expanded as the processor would."""
        from services.tokenizer.media.video import expand_video_tokens, qwen2_vl_video

        image_processor = self.processor.image_processor
        tensors: dict[str, np.ndarray] = {}
        if images:
            out = image_processor(images=images, return_tensors="np")
            tensors.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        clips = [qwen2_vl_video(frames, image_processor) for frames in videos]
        grid = np.concatenate([clip["video_grid_thw"] for clip in clips])
        ids, types = expand_video_tokens(
            self.processor.tokenizer(text)["input_ids"], grid, video_token_id=self.processor.video_token_id,
            image_token_id=self.processor.image_token_id, merge_size=image_processor.merge_size,
            image_grid_thw=tensors.get("image_grid_thw"))
        tensors.update(pixel_values_videos=np.concatenate([clip["pixel_values_videos"] for clip in clips]),
                       video_grid_thw=grid, mm_token_type_ids=np.asarray([types], dtype=np.int64))
        if type(self.processor).__name__ == "Qwen2_5_VLProcessor":  # seconds per temporal patch, for M-RoPE
            step = image_processor.temporal_patch_size / VIDEO_FPS
            tensors["second_per_grid_ts"] = np.full(len(clips), step, dtype=np.float32)
        return prepared(ids, tensors)

    def _audio(self, data: bytes, index: int) -> np.ndarray:
        from services.tokenizer.media.audio import decode_audio

        return decode_audio(data, index, self.processor.feature_extractor.sampling_rate)


    def _smolvlm_videos(self, text: str, images: list, items: list[tuple[str, bytes]]) -> Prepared:
        """SmolVLM2 with videos: each video's sampled frames become single images of the model (its
        ``<video>`` placeholder the processor's text: duration, frame timestamps, image tokens), as
        ``smolvlm_video`` computes what transformers' torchvision video processor would."""
        from services.tokenizer.media.smolvlm_video import decode_smolvlm_video, expand_smolvlm_prompt, video_settings

        settings = video_settings(self.path)
        videos = [decode_smolvlm_video(data, i, settings) for i, (kind, data) in enumerate(items) if kind == "video"]
        expanded, tensors = expand_smolvlm_prompt(text, videos, self.processor, settings, images=images or None)
        return prepared(self.processor.tokenizer(expanded)["input_ids"], tensors)


def prepared(ids: list[int], arrays: dict[str, Any]) -> Prepared:
    tensors = {name: to_wire(np.asarray(value)) for name, value in arrays.items()}
    return Prepared([int(i) for i in ids], MediaInputs(tensors, digest(tensors)))


def _video(data: bytes, index: int) -> list:
    from services.tokenizer.media.video import decode_video

    return decode_video(data, index, fps=VIDEO_FPS)


def media_kinds(processor: Any | None) -> list[str]:
    """The media kinds a processor takes: images with an image processor, videos with Qwen2-VL's (whose
    video path ``video.py`` reproduces), audio with a feature extractor and an audio token."""
    if processor is None:
        return []
    kinds = []
    if getattr(processor, "image_processor", None) is not None:
        kinds.append("image")
        if getattr(processor, "video_token", None) in ("<|video_pad|>", SMOLVLM_VIDEO):
            kinds.append("video")
    if getattr(processor, "feature_extractor", None) is not None and getattr(processor, "audio_token", None):
        kinds.append("audio")
    return kinds


def _without_video(path: str):
    """The folder's processor class built from its image processor and tokenizer, without the video
    processor that transformers cannot load here (its video processors need torchvision, which is not
    installable next to this project's torch; ``video.py`` and ``smolvlm_video.py`` do their work).
    transformers checks each sub-processor's class and refuses even None for one whose base class it did
    not define; that one check is skipped for the video processor only, on this instance only."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(path)
    config = processor_config(folder)
    cls = getattr(transformers, config["processor_class"], None)
    if cls is None:
        raise ModelFolderError(f"{folder}: processor_class {config['processor_class']!r} is not a processor this "
                               f"transformers ({transformers.__version__}) has")
    if cls.__name__ == "SmolVLMProcessor":
        from services.tokenizer.media.smolvlm_video import use_number_words

        use_number_words()
    processor = cls.__new__(cls)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = lambda name, arg: None if arg is None else check(name, arg)
    template = folder / "chat_template.jinja"
    extra = {key: config[key] for key in ("image_seq_len",) if key in config}
    processor.__init__(image_processor=AutoImageProcessor.from_pretrained(path),
                       tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None,
                       chat_template=template.read_text() if template.exists() else None, **extra)
    del processor.check_argument_for_proper_class
    return processor


FORMATS = ("PNG", "JPEG", "GIF", "WebP", "BMP", "TIFF")  # the common ones PIL reads (it reads more)


def decode_image(data: bytes, index: int):
    """An RGB PIL image; 422 for bytes that are no image, or one so large it looks like a decompression bomb."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise validation(f"media item {index}: the image is too large to decode ({exc})") from None
    except Image.UnidentifiedImageError:  # its message names the BytesIO object read (an address)
        raise validation(f"media item {index}: the image cannot be decoded: its bytes are in no image format "
                         f"this server reads ({', '.join(FORMATS)})") from None
    except Exception as exc:  # PIL raises many kinds for bad data
        raise validation(f"media item {index}: the image cannot be decoded: {exc}") from None
    return to_rgb(image)


def to_rgb(image):
    """RGB as transformers' processors (and vLLM's loader) make it: transparency composited onto white (a plain
    ``convert`` kept the colour stored under transparent pixels, often black)."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def to_wire(array: np.ndarray) -> Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype not in DTYPES:
        array = array.astype(np.float32 if array.dtype.kind == "f" else np.int64)
    return Tensor(DTYPES[array.dtype], list(array.shape), array.astype(array.dtype.newbyteorder("<")).tobytes())


def digest(tensors: dict[str, Tensor]) -> str:
    """A hash of the tensors (names, dtypes, shapes and bytes): equal media give equal digests."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape}".encode())
        h.update(t.data)
    return h.hexdigest()
