"""Small deterministic test videos made in memory with PyAV, and transformers' own answer for them.

``make_mp4`` encodes a seeded moving pattern (so frames differ from each other and seeds differ from
each other, visibly to a vision tower); ``video_data_url`` is how a client sends it inline.
``hf_generate_video`` is the oracle for Qwen2-VL videos: transformers' greedy ``generate`` on the
``pixel_values_videos`` / ``video_grid_thw`` that ``services.tokenizer.media.video`` computes (transformers'
own video processor needs torchvision, which is not installed).
"""

from __future__ import annotations

import base64
import io
from fractions import Fraction
from pathlib import Path

import numpy as np

MIME = {"mp4": "video/mp4", "avi": "video/x-msvideo", "matroska": "video/x-matroska", "webm": "video/webm"}


def pattern_frame(index: int, size=(96, 80), seed: int = 0) -> np.ndarray:
    """Frame ``index`` of seed ``seed``'s pattern, RGB uint8 (height, width, 3): seeded colour waves
    drifting with time, plus a bright square that moves across the frame (no noise: the encoder
    keeps it, so decoded frames stay close to these)."""
    width, height = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase, speed = rng.uniform(0.03, 0.15), rng.uniform(0.03, 0.15), rng.uniform(0, 2 * np.pi), rng.uniform(0.3, 0.9)
        channels.append(127.5 + 90 * np.sin(fx * x + fy * y + phase + speed * index))
    pixels = np.stack(channels, -1)
    side = max(4, min(width, height) // 4)
    colour = rng.integers(0, 256, 3)
    left = (index * 7 + int(rng.integers(0, width))) % max(1, width - side)
    top = (index * 5 + int(rng.integers(0, height))) % max(1, height - side)
    pixels[top:top + side, left:left + side] = colour
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_mp4(frames: int = 8, size=(96, 80), fps: int = 4, seed: int = 0, *, codec: str = "mpeg4",
             fmt: str = "mp4") -> bytes:
    """An encoded video of ``frames`` frames of ``size`` (width, height; even numbers for yuv420p) at
    ``fps``: MPEG-4 Part 2 in MP4 by default, ``fmt="avi"`` for an AVI, ``codec="libx264"`` for H.264.

    The default is byte-for-byte deterministic (ffmpeg's own single-threaded mpeg4 encoder, fixed
    bit rate, no creation time). libx264 here is not: the same call in one process now and then
    gives a different (equally valid) stream, so tests compare H.264 videos by their decoded frames."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.codec_context.time_base = Fraction(1, fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        if codec == "libx264":
            stream.codec_context.options = {"crf": "12", "preset": "veryfast", "threads": "1",
                                            "x264-params": "threads=1:lookahead-threads=1"}
        else:
            stream.codec_context.bit_rate = 4_000_000
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(pattern_frame(i, size, seed), format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def video_data_url(data: bytes, fmt: str = "mp4") -> str:
    """The video as a ``data:video/mp4;base64,...`` URL (what an OpenAI-style client sends inline)."""
    return f"data:{MIME.get(fmt, 'video/mp4')};base64," + base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------- oracle


def hf_video_inputs(model_dir: Path, videos: list[bytes], *, text: str | None = None, messages: list | None = None,
                    fps: float = 2.0, max_frames: int = 32) -> dict:
    """What transformers' Qwen2VLProcessor would give for the prompt and the encoded ``videos`` (torch
    tensors): input_ids / attention_mask / mm_token_type_ids with each ``<|video_pad|>`` expanded, and
    pixel_values_videos / video_grid_thw; computed by ``services.tokenizer.media.video``."""
    import torch

    from services.tokenizer.media.video import (
        decode_video,
        expand_video_tokens,
        qwen2_vl_video,
    )
    from tests.vlm_oracles import load

    processor, model = load(Path(model_dir))
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text= or messages=")
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    outs = [qwen2_vl_video(decode_video(data, i, fps, max_frames), processor.image_processor)
            for i, data in enumerate(videos)]
    grid = np.concatenate([o["video_grid_thw"] for o in outs])
    ids, types = expand_video_tokens(processor.tokenizer(text)["input_ids"], grid,
                                     video_token_id=model.config.video_token_id,
                                     image_token_id=model.config.image_token_id,
                                     merge_size=processor.image_processor.merge_size)
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "mm_token_type_ids": torch.tensor([types]),
            "pixel_values_videos": torch.from_numpy(np.concatenate([o["pixel_values_videos"] for o in outs])),
            "video_grid_thw": torch.from_numpy(grid)}


def hf_generate_video(model_dir: Path, videos: list[bytes], *, text: str | None = None, messages: list | None = None,
                      max_new_tokens: int = 12, **sampling) -> list[int]:
    """transformers' greedy ``Qwen2VLForConditionalGeneration.generate`` for the prompt and encoded
    ``videos``: only the new token ids (the oracle an engine serving videos is compared with)."""
    import torch

    from tests.vlm_oracles import load

    _, model = load(Path(model_dir))
    inputs = hf_video_inputs(model_dir, videos, text=text, messages=messages, **sampling)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
