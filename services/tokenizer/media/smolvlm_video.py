"""Videos for SmolVLM (SmolVLM2, ``SmolVLMForConditionalGeneration``) without torchvision.

transformers' ``SmolVLMVideoProcessor`` is a torchvision backend (not installable next to this
project's torch), and ``SmolVLMProcessor`` refuses to exist without the ``num2words`` package (it
writes the frame count in words). This module computes what the two of them produce for a video,
from pieces that run here:

- ``sample_indices`` / ``decode_smolvlm_video``: the frames SmolVLM keeps (``sample_frames``: ``fps``
  a second, at most ``max_frames``, evenly spread, one second cut from each end of a long video),
  decoded with PyAV by ``video.py``'s decoder, with the metadata the prompt text is written from;
- ``smolvlm_video``: each kept frame resized and squared by the served Pillow image processor
  (``SmolVLMImageProcessorPil`` without tiling: exactly the video processor's resize, rescale and
  normalise steps), and the text that replaces the ``<video>`` placeholder (duration, one
  ``Frame from MM:SS:`` line and one single-image block of ``<image>`` tokens per frame);
- ``expand_smolvlm_prompt``: a whole prompt with its ``<video>`` placeholders expanded, and the tensors.

A video frame is an image to the model: its features come from ``get_image_features`` on
``pixel_values`` [videos, frames, 3, H, W] and go to the ``<image>`` tokens, so the engine encodes a
video exactly as it encodes images. All of this is CPU work for the tokenizer service.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from shared.errors import validation

# SmolVLMProcessor's text pieces (transformers 5.23, processing_smolvlm.py)
VIDEO_INTRO = "You are provided the following series of {frame_count} frames from a {video_duration} [H:MM:SS] video.\n"
MEDIA_OUTTRO = "\n\n"
FRAME_TIMESTAMP = "\nFrame from {timestamp}:"
VIDEO_TOKEN = "<video>"
# SmolVLMVideoProcessor's class defaults, for a folder whose config does not say
DEFAULT_SIZE = 4 * 364
DEFAULT_MAX_IMAGE_SIZE = 364
# What SmolVLM2's checkpoints set (``video_sampling``); used when a folder has no video_sampling at all
DEFAULT_FPS, DEFAULT_MAX_FRAMES = 1.0, 64


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's settings that change its output: frames a second and at most how many
    to keep, the longest edge frames are first resized to, and the square side they end at."""

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    size: int = DEFAULT_SIZE
    max_image_size: int = DEFAULT_MAX_IMAGE_SIZE
    skip_secs: float = 1.0


@dataclass(frozen=True)
class SampledVideo:
    """A video's kept frames (RGB PIL images) and the metadata SmolVLMProcessor writes the prompt from:
    the kept frame indices, the stream's frame rate and its duration in seconds (frames / rate, as
    transformers' PyAV reader computes it)."""

    frames: list
    indices: list[int]
    fps: float
    duration: float

    @property
    def timestamps(self) -> list[float]:
        """Each kept frame's time in seconds (``VideoMetadata.timestamps``: index / fps)."""
        return [i / self.fps for i in self.indices]


# ---------------------------------------------------------------------------------------------- settings


def video_settings(model_dir) -> VideoSettings:
    """The video processor's settings as transformers resolves them for a folder: processor_config.json's
    ``video_processor`` section, else video_preprocessor_config.json, else preprocessor_config.json
    (where SmolVLM2's checkpoints keep ``video_sampling``, beside the image processor's settings)."""
    folder = Path(model_dir)
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None),
                      ("preprocessor_config.json", None)):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config = config.get(key) if key else config
            if config:
                return settings_from_config(config)
    return VideoSettings()


def settings_from_config(config: dict) -> VideoSettings:
    """``SmolVLMVideoProcessor.__init__``'s reading of a config: ``video_sampling`` gives fps, max_frames
    and the resize size (``video_size``), but a top-level ``size`` wins over ``video_size`` (transformers
    copies it in "for BC"; in a shared preprocessor_config.json that is the image processor's size)."""
    sampling = config.get("video_sampling") or {}
    size = config.get("size") if "size" in config and sampling else sampling.get("video_size") or config.get("size")
    return VideoSettings(
        fps=float(sampling.get("fps") or DEFAULT_FPS),
        max_frames=int(sampling.get("max_frames") or DEFAULT_MAX_FRAMES),
        size=int((size or {}).get("longest_edge") or DEFAULT_SIZE),
        max_image_size=int((config.get("max_image_size") or {}).get("longest_edge") or DEFAULT_MAX_IMAGE_SIZE))


# ---------------------------------------------------------------------------------------------- sampling


def sample_indices(total: int, video_fps: float, fps: float = DEFAULT_FPS, max_frames: int = DEFAULT_MAX_FRAMES,
                   skip_secs: float = 1.0) -> list[int]:
    """The frames ``SmolVLMVideoProcessor.sample_frames`` (transformers 5.23) keeps of ``total`` frames at
    ``video_fps``, which is what ``apply_chat_template`` asks for (``fps`` and ``max_frames`` from
    ``video_sampling``):

        n = clamp(round(fps * duration), 1, max_frames), duration = total / video_fps;
        between the first and the last frame, or (when duration - 2*skip_secs > max_frames * fps)
        between skip_secs*video_fps and total - skip_secs*video_fps;
        np.linspace(start, end, n, dtype=int), duplicates dropped.

    The same numpy expression, so the same indices. transformers' own default without
    ``apply_chat_template`` (``do_sample_frames=False``) keeps every frame, which nothing bounds."""
    if total <= 0:
        return []
    duration = total / video_fps
    wanted = max(1, min(round(fps * duration), max_frames))
    start, end = 0, total - 1
    if skip_secs > 0 and duration - 2 * skip_secs > max_frames * fps:
        start, end = int(skip_secs * video_fps), int(total - skip_secs * video_fps)
    start, end = max(0, start), min(end, total - 1)
    if start >= end:
        start, end = 0, total - 1
    return [int(i) for i in np.unique(np.linspace(start, end, wanted, dtype=int))]


def decode_smolvlm_video(data: bytes, index: int, settings: VideoSettings = VideoSettings()) -> SampledVideo:
    """The kept frames of an encoded video and their metadata; ``index`` is the media item's place in
    the request, for the error message. PyAV decodes as ``video.py`` does (one packet at a time, only
    the kept frames held, frame-size limit checked first); 422 for what cannot be decoded.

    A stream without a frame rate cannot be timed (transformers refuses to sample it): 422."""
    import av

    from services.tokenizer.media.video import (
        _count_frames,
        _decode_at,
        _frame_rate,
        _video_stream,
    )

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="replace") as container:
            stream = _video_stream(container, index)
            rate = _frame_rate(stream)
            if not rate:
                raise validation(f"media item {index}: the video cannot be decoded: it has no frame rate")
            total = stream.frames or _count_frames(data)
            keep = sample_indices(total, rate, settings.fps, settings.max_frames, settings.skip_secs)
            frames = _decode_at(container, stream, keep)
    except av.FFmpegError as exc:
        raise validation(f"media item {index}: the video cannot be decoded: {exc}") from None
    if not frames:
        raise validation(f"media item {index}: the video cannot be decoded: it has no frames")
    return SampledVideo(frames, keep[:len(frames)], rate, total / rate)


# ---------------------------------------------------------------------------------------------- one video


def video_pixels(frames: list, image_processor, settings: VideoSettings) -> dict[str, np.ndarray]:
    """``pixel_values`` float32 [1, frames, 3, M, M] and ``pixel_attention_mask`` int64 [1, frames, M, M]
    (M = max_image_size) for one video's frames.

    ``SmolVLMVideoProcessor`` resizes each frame so its longest edge is ``size`` (aspect kept, the
    other edge rounded up to even), then to M x M, then rescales and normalises; it never tiles. The
    Pillow image processor with ``do_image_splitting=False`` runs those very steps (the same size
    rule, its resampling, mean and std, which SmolVLM2's checkpoints share between the two), so a
    frame's pixels are the image processor's for that frame. With torchvision transformers would
    resize uint8 tensors with torchvision's LANCZOS (or BICUBIC before torchvision 0.27) and fuse
    rescale+normalise in float32: a grey level or so at some pixels, unrunnable here to compare."""
    out = image_processor(images=[list(frames)], do_image_splitting=False, return_tensors="np",
                          size={"longest_edge": settings.size},
                          max_image_size={"longest_edge": settings.max_image_size})
    return {"pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
            "pixel_attention_mask": np.asarray(out["pixel_attention_mask"], dtype=np.int64)}


def video_text(video: SampledVideo, image_seq_len: int, frame_count: int | None = None, *,
               fake_image_token: str = "<fake_token_around_image>", image_token: str = "<image>",
               global_image_token: str = "<global-img>") -> str:
    """What ``SmolVLMProcessor.replace_video_token`` puts in place of ``<video>``: the intro with the
    frame count in words and the duration (H:MM:SS, whole seconds), then per frame
    ``\\nFrame from MM:SS:`` and the single-image block
    ``<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>``, then "\\n\\n".

    ``frame_count`` is the count the intro states; transformers states the frame axis of the batch's
    ``pixel_values``, i.e. the longest video's count for every video of a request (see
    ``expand_smolvlm_prompt``); None states this video's own."""
    count = len(video.indices) if frame_count is None else frame_count
    duration = timedelta(seconds=int(video.duration))
    text = VIDEO_INTRO.format(frame_count=number_words(count), video_duration=str(duration))
    block = fake_image_token + global_image_token + image_token * image_seq_len + fake_image_token
    for second in video.timestamps:
        stamp = f"{int(second // 60):02d}:{int(second % 60):02d}"
        text += FRAME_TIMESTAMP.format(timestamp=stamp) + block
    return text + MEDIA_OUTTRO


def smolvlm_video(video: SampledVideo, processor, settings: VideoSettings,
                  frame_count: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """One video as SmolVLMVideoProcessor + SmolVLMProcessor give it: the text for its ``<video>``
    placeholder and its tensors (``video_pixels``). ``processor`` is the served SmolVLMProcessor (its
    image processor, ``image_seq_len`` and image tokens)."""
    text = video_text(video, processor.image_seq_len, frame_count, fake_image_token=processor.fake_image_token,
                      image_token=processor.image_token, global_image_token=processor.global_image_token)
    return text, video_pixels(video.frames, processor.image_processor, settings)


# ---------------------------------------------------------------------------------------------- a prompt


def expand_smolvlm_prompt(text: str, videos: list[SampledVideo], processor, settings: VideoSettings,
                          images: list | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """The prompt with its i-th ``<video>`` replaced by video i's text, and the videos' tensors stacked
    as ``SmolVLMProcessor(text=..., videos=...)`` stacks them: ``pixel_values`` [videos, F, 3, M, M]
    and ``pixel_attention_mask`` [videos, F, M, M], F the longest video's frame count; a shorter
    video is padded with all-zero frames (which ``get_image_features`` drops as padding; their mask
    is ones, as transformers' ``pad`` makes it). As in transformers, every video's intro states F
    frames, even one that has fewer (a transformers quirk, kept for parity: its frame lines and
    image tokens are its own).

    Images and videos in one prompt are refused (422): ``SmolVLMProcessor`` accepts both but returns
    the images' and the videos' tensors under the same name, ``pixel_values``, the videos' replacing
    the images', so transformers itself cannot run such a prompt. So is ``<image>`` text in a video
    prompt (the processor raises: image placeholders without images)."""
    if images:
        raise validation("SmolVLM takes images or videos in one request, not both")
    token = getattr(processor, "video_token", VIDEO_TOKEN)
    if text.count(token) != len(videos):
        raise validation(f"the prompt has {text.count(token)} video placeholders for {len(videos)} videos")
    if processor.image_token in text:
        raise validation(f"the prompt has {text.count(processor.image_token)} image placeholders and no images")
    if not videos:
        return text, {}
    longest = max(len(v.indices) for v in videos)
    pieces, tensors = text.split(token), []
    for i, video in enumerate(videos):
        replacement, arrays = smolvlm_video(video, processor, settings, frame_count=longest)
        pieces[i] += replacement
        tensors.append(arrays)
    return "".join(pieces), _stack(tensors, longest)


def _stack(tensors: list[dict[str, np.ndarray]], frames: int) -> dict[str, np.ndarray]:
    """Videos' [1, f, ...] tensors as one [videos, frames, ...] batch: zero frames after a shorter
    video's pixels, ones after its mask (``SmolVLMVideoProcessor.pad``)."""
    def pad(array: np.ndarray, fill: int) -> np.ndarray:
        extra = np.full((1, frames - array.shape[1], *array.shape[2:]), fill, dtype=array.dtype)
        return np.concatenate([array, extra], axis=1)

    return {"pixel_values": np.concatenate([pad(t["pixel_values"], 0) for t in tensors]),
            "pixel_attention_mask": np.concatenate([pad(t["pixel_attention_mask"], 1) for t in tensors])}


# ---------------------------------------------------------------------------------------------- words


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """``num2words(n)`` (English cardinal, num2words 0.5.14) for 0 <= n < 10**6, e.g. 64 -> "sixty-four",
    121 -> "one hundred and twenty-one", 1100 -> "one thousand, one hundred"; digits beyond.

    SmolVLMProcessor writes the frame count with the ``num2words`` package and will not even be built
    without it; this is its output for every count a video can have, so the package is not needed."""
    if not 0 <= n < 10**6:
        return str(n)
    thousands, rest = divmod(n, 1000)
    if not thousands:
        return _below_thousand(n)
    head = _below_thousand(thousands) + " thousand"
    if not rest:
        return head
    return head + (", " if rest >= 100 else " and ") + _below_thousand(rest)


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = _below_hundred(rest) if rest or not hundreds else ""
    if not hundreds:
        return words
    return _ONES[hundreds] + " hundred" + (" and " + words if words else "")


def _below_hundred(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + ("-" + _ONES[ones] if ones else "")


# ---------------------------------------------------------------------------------------------- processor


def use_number_words() -> None:
    """Let transformers' SmolVLMProcessor exist without the ``num2words`` package, which it needs only to
    write a video's frame count in words: ``number_words`` writes the same words."""
    import transformers.models.smolvlm.processing_smolvlm as smolvlm

    if smolvlm.num2words is None:
        smolvlm.num2words = number_words
