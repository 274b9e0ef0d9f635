"""Videos for Qwen2-VL without torchvision: decode and sample with PyAV, pixels with the image processor.

transformers' only Qwen2-VL video processor (``Qwen2VLVideoProcessor``) is a torchvision backend, and
torchvision is not installable next to this project's torch; its video decoders want torchcodec or
torchvision too. This module computes what that processor returns, from pieces that run here:

- ``decode_video``: PyAV (which bundles ffmpeg) decodes the bytes in memory and keeps only the sampled
  frames, choosing them as ``Qwen2VLVideoProcessor.sample_frames`` does (``sample_indices``);
- ``qwen2_vl_video``: each frame through the served ``Qwen2VLImageProcessorPil`` (smart_resize, Pillow
  bicubic, rescale, normalise), then the video processor's temporal padding and patch order;
- ``expand_video_tokens``: each ``<|video_pad|>`` grown to the video's tokens, as
  ``Qwen2VLProcessor`` grows it, and the ``mm_token_type_ids`` that ``get_rope_index`` reads.

All of it is CPU work for the tokenizer service (run it off the event loop, as ``multimodal.py`` does).
"""

from __future__ import annotations

import io
import math

import numpy as np

from shared.errors import validation

# Qwen2VLVideoProcessor's class defaults (transformers 5.23): at least 4 frames, an even count for
# temporal_patch_size 2. Its max_frames is 768; ours defaults to 32 (see ``decode_video``).
MIN_FRAMES = 4
TEMPORAL_PATCH = 2


def sample_indices(total: int, video_fps: float | None, fps: float = 2.0, max_frames: int = 32,
                   min_frames: int = MIN_FRAMES, temporal_patch_size: int = TEMPORAL_PATCH) -> list[int]:
    """The frame indices to keep from a video of ``total`` frames at ``video_fps``: ``fps`` a second,
    uniformly spread, as ``Qwen2VLVideoProcessor.sample_frames`` (transformers 5.23) chooses them:

        n = total / video_fps * fps, clamped to [min_frames, min(max_frames, total)],
        rounded down to a multiple of temporal_patch_size; index k = floor(k * total / n).

    Two departures, both where transformers would fail: a video of fewer than ``temporal_patch_size``
    frames keeps all its frames (transformers raises), and an unknown frame rate spreads
    ``min(max_frames, total)`` frames (transformers refuses ``fps`` without one). The indices are
    exact integer arithmetic where transformers evaluates ``torch.arange(0, total, total / n).int()``
    in floating point; they agree (both floor k * total / n) unless rounding lands on an integer.
    """
    if total <= 0:
        return []
    cap = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
    wanted = total / video_fps * fps if video_fps else cap
    n = math.floor(min(max(wanted, min_frames), cap, total) / temporal_patch_size) * temporal_patch_size
    n = n or min(total, max(1, max_frames))  # shorter than one temporal patch: every frame
    return [k * total // n for k in range(n)]


def decode_video(data: bytes, index: int, fps: float = 2.0, max_frames: int = 32) -> list:
    """The sampled frames of an encoded video (MP4, AVI, WMV, WebM...: whatever ffmpeg reads) as RGB
    PIL images; ``index`` is the media item's place in the request, for the error message.

    Sampling (``sample_indices``) follows transformers' Qwen2-VL video processor when it samples
    (``do_sample_frames=True, fps=2``, which Qwen's model cards and qwen-vl-utils use: 2 frames a
    second, at least 4, an even count): ``fps`` a second, at least ``min(4, total)``, a multiple of
    2, at most ``max_frames``. transformers' default ``max_frames`` is 768 (about 6 minutes at 2 fps),
    hundreds of thousands of tokens; 32 (16 seconds at 2 fps, longer videos spread 32 frames over
    their length) keeps a request's cost and memory bounded. Without ``do_sample_frames``
    transformers' default is to keep every frame, which nothing bounds. At least 2 frames come back:
    a single-frame video gives its frame twice (the repeat the processor's temporal padding makes);
    a truncated video gives the sampled frames it has.

    Memory stays bounded by the kept frames: packets are decoded one at a time, a frame that is not
    kept is dropped at once, decoding stops after the last kept frame, and a frame size over
    Pillow's decompression-bomb limit is refused before decoding. Colours are ffmpeg's rgb24
    conversion, as transformers' PyAV reader (``read_video_pyav``) gets them.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="replace") as container:
            stream = _video_stream(container, index)
            total = stream.frames or _count_frames(data)
            keep = sample_indices(total, _frame_rate(stream), fps, max_frames)
            frames = _decode_at(container, stream, keep)
    except av.FFmpegError as exc:
        raise validation(f"media item {index}: the video cannot be decoded: {exc}") from None
    if not frames:
        raise validation(f"media item {index}: the video cannot be decoded: it has no frames")
    return frames if len(frames) > 1 else frames * 2


def _video_stream(container, index: int):
    """The container's first video stream; 422 for a file without one, or with frames too large."""
    from PIL import Image

    if not container.streams.video:
        raise validation(f"media item {index}: the video cannot be decoded: it has no video stream")
    stream = container.streams.video[0]
    limit = Image.MAX_IMAGE_PIXELS
    if limit and (stream.width or 0) * (stream.height or 0) > limit:
        raise validation(f"media item {index}: the video is too large to decode "
                         f"({stream.width}x{stream.height} frames, over {limit} pixels)")
    return stream


def _frame_rate(stream) -> float | None:
    """The stream's average frame rate (what transformers' PyAV reader uses), else ffmpeg's guess."""
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else None


def _count_frames(data: bytes) -> int:
    """The video packets of a container that does not record its frame count (e.g. Matroska/WebM):
    demuxing without decoding reads the file once, cheaply."""
    import av

    with av.open(io.BytesIO(data), mode="r", metadata_errors="replace") as container:
        return sum(1 for packet in container.demux(video=0) if packet.size)


def _decode_at(container, stream, keep: list[int]) -> list:
    """The decoded frames at the ``keep`` indices (in decode order, ascending), as RGB PIL images."""
    wanted, frames = set(keep), []
    if not keep:
        return frames
    for i, frame in enumerate(container.decode(stream)):
        if i in wanted:
            frames.append(frame.to_image())
        if i >= keep[-1]:
            break
    return frames


def qwen2_vl_video(frames: list, image_processor, size: dict | None = None) -> dict[str, np.ndarray]:
    """What ``Qwen2VLVideoProcessor`` returns for ``frames`` (one video): ``pixel_values_videos``,
    float32 [t*h*w, C*temporal_patch_size*patch*patch], and ``video_grid_thw``, int64 [[t, h, w]].

    Each frame goes through ``image_processor`` itself (the served ``Qwen2VLImageProcessorPil``, called
    on the frame, one temporal copy of its output kept), so images and video frames cannot drift
    apart: smart_resize to multiples of patch*merge within the pixel bounds, its resampling
    (bicubic), rescale 1/255 and normalise with its mean/std; its patch, merge and temporal sizes. The frame count is padded to a multiple of temporal_patch_size by
    repeating the last frame, and the patches are laid out as the video processor's ``patchify``:
    per temporal group, merge blocks in raster order, each row (C, temporal, patch, patch).

    ``size`` is the video processor's {"shortest_edge", "longest_edge"} pixel bounds (``video_size``);
    None takes the image processor's, which is what transformers does for a checkpoint without
    its own video processor config (Qwen2-VL's: the video processor loads preprocessor_config.json).

    Where this differs from transformers with torchvision: its video processor resizes uint8 tensors
    with torchvision's antialiased bicubic (torch's ``interpolate``, then rounded) and fuses rescale
    and normalise in one float32 step. Pillow's bicubic differs by 1-2 grey levels at some pixels
    (measured against torch's antialiased bicubic, 640x480 -> 308x224: 14% of values, max 2), and
    the separate numpy steps by float rounding. Exact equality with an unrunnable reference is not
    on offer; what is kept exactly is the guarantee a server needs more: a video of 2 identical
    frames is the image processor's output for that image, bit for bit (Qwen2-VL encodes an image as
    a 2-frame video of itself), so an image and a still video give the same features.
    ``cap_pixels_per_frame`` (a total-pixel budget, off by default in transformers 5.23) is not applied.
    """
    if not frames:
        raise ValueError("a video needs at least one frame")
    kwargs = {"size": size} if size else {}
    temporal = image_processor.temporal_patch_size
    per_frame, grid = [], None
    for frame in frames:
        out = image_processor(images=[frame], return_tensors="np", **kwargs)
        if grid is not None and not np.array_equal(out["image_grid_thw"], grid):
            raise ValueError("the frames of a video must all have one size")
        grid = out["image_grid_thw"]
        per_frame.append(_one_frame(out["pixel_values"], temporal, image_processor.patch_size))
    per_frame += per_frame[-1:] * (-len(per_frame) % temporal)
    patches = np.stack(per_frame).reshape(len(per_frame) // temporal, temporal, *per_frame[0].shape)
    patches = patches.transpose(0, 2, 3, 1, 4)  # (t, patches, C, temporal, patch*patch)
    grid_t = patches.shape[0]
    pixel_values = np.ascontiguousarray(patches.reshape(grid_t * patches.shape[1], -1), dtype=np.float32)
    return {"pixel_values_videos": pixel_values,
            "video_grid_thw": np.array([[grid_t, int(grid[0, 1]), int(grid[0, 2])]], dtype=np.int64)}


def _one_frame(pixel_values: np.ndarray, temporal: int, patch: int) -> np.ndarray:
    """A frame's patches (patches, C, patch*patch) from the image processor's output for it, whose rows
    are (C, temporal, patch, patch) with the frame repeated along temporal: keep one copy."""
    return pixel_values.reshape(len(pixel_values), -1, temporal, patch * patch)[:, :, 0]


def video_size(model_dir) -> dict | None:
    """The video processor's pixel bounds as transformers resolves them for a folder: processor_config.json's
    ``video_processor`` section, else video_preprocessor_config.json; None when neither has one (then
    transformers uses preprocessor_config.json, the image processor's: pass None to ``qwen2_vl_video``)."""
    import json
    from pathlib import Path

    folder = Path(model_dir)
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None)):
        path = folder / name
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        config = config.get(key) if key else config
        if config:
            return _size_of(config)
    return None


def _size_of(config: dict) -> dict | None:
    """{"shortest_edge", "longest_edge"} from a video processor config: min/max_pixels win over size,
    as ``Qwen2VLVideoProcessor.__init__`` lets them."""
    size = dict(config.get("size") or {})
    if config.get("min_pixels") is not None:
        size["shortest_edge"] = config["min_pixels"]
    if config.get("max_pixels") is not None:
        size["longest_edge"] = config["max_pixels"]
    size = {k: v for k, v in size.items() if k in ("shortest_edge", "longest_edge")}
    return size if len(size) == 2 else None


def expand_video_tokens(input_ids: list[int], video_grid_thw: np.ndarray | None, *, video_token_id: int,
                        image_token_id: int, merge_size: int,
                        image_grid_thw: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """``input_ids`` with each ``<|video_pad|>`` (one per video, in order) grown to t*h*w/merge² video
    tokens, as ``Qwen2VLProcessor`` grows it (``replace_video_token``: the pad string repeated, a
    special token, so expanding ids equals tokenising the expanded text); and the matching
    ``mm_token_type_ids``: 2 at video tokens, 1 at image tokens, 0 elsewhere, as
    ``ProcessorMixin.create_mm_token_type_ids`` marks them.

    Image tokens are taken as already expanded (the processor's ids) unless ``image_grid_thw`` is
    given; then each ``<|image_pad|>`` grows the same way. Why both: ``Qwen2VLProcessor.__call__``
    refuses a prompt holding ``<|video_pad|>`` without videos, so with no video processor a prompt
    with images and videos is tokenised with the tokenizer alone and grown here.
    422 when the placeholders and the media do not pair up.
    """
    grids = {video_token_id: _tokens_per_item(video_grid_thw, merge_size)}
    if image_grid_thw is not None:
        grids[image_token_id] = _tokens_per_item(image_grid_thw, merge_size)
    for token, counts in grids.items():
        found = sum(1 for i in input_ids if i == token)
        if found != len(counts):
            what = "video" if token == video_token_id else "image"
            raise validation(f"the prompt has {found} {what} placeholders for {len(counts)} {what}s")
    ids, queues = [], {token: iter(counts) for token, counts in grids.items()}
    for i in input_ids:
        ids.extend([i] * (next(queues[i]) if i in queues else 1))
    types = [2 if i == video_token_id else 1 if i == image_token_id else 0 for i in ids]
    return ids, types


def _tokens_per_item(grid_thw: np.ndarray | None, merge_size: int) -> list[int]:
    """The LLM tokens of each video (or image): t*h*w patches, merge_size² patches a token."""
    if grid_thw is None:
        return []
    return [int(np.prod(row)) // merge_size**2 for row in np.asarray(grid_thw).reshape(-1, 3)]
