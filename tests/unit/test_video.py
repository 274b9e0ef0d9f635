"""Videos for Qwen2-VL without torchvision (services/tokenizer/media/video.py): PyAV decoding and sampling,
the video processor's pixels from the Pillow image processor, token expansion, and transformers'
own Qwen2-VL generate on them (the oracle for the engine)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.tokenizer.media.video import (
    decode_video,
    expand_video_tokens,
    qwen2_vl_video,
    sample_indices,
    video_size,
)
from shared.errors import ErrorKind, SwitchboardError
from tests.media_items import test_image
from tests.video_items import make_mp4, pattern_frame, video_data_url
from tests.vlm_models import QWEN2_VL_VIDEO


def tiny_image_processor():
    """The tiny Qwen2-VL folder's image processor (4..16 tokens an image, 14px patches, merge 2)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    unit = 28 * 28
    return Qwen2VLImageProcessorPil(min_pixels=4 * unit, max_pixels=16 * unit, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


# ---------------------------------------------------------------------------------------------- test videos


def test_made_videos_are_deterministic_and_seeds_differ():
    assert make_mp4(seed=0) == make_mp4(seed=0)
    assert make_mp4(seed=0) != make_mp4(seed=1)
    assert video_data_url(b"\x00\x01").startswith("data:video/mp4;base64,AAE=")


# ---------------------------------------------------------------------------------------------- sampling


def transformers_indices(total: int, video_fps: float, fps: float, max_frames: int) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames (transformers 5.23), line for line, with its defaults
    (min_frames 4, temporal_patch_size 2); it cannot be imported without torchvision."""
    import torch

    max_frames = math.floor(min(max_frames, total) / 2) * 2
    num_frames = total / video_fps * fps
    num_frames = min(max(num_frames, 4), max_frames, total)
    num_frames = math.floor(num_frames / 2) * 2
    return torch.arange(0, total, total / num_frames).int().tolist()


def test_sampling_follows_transformers_qwen2_vl():
    """The same indices, except that transformers' float ``arange`` now and then overshoots by one
    index past the last frame (total 107 at 4 fps: 53 indices for 52 frames, the last = 107); its
    PyAV reader never reaches that frame and drops it, array inputs raise IndexError."""
    overshoots = 0
    for total in range(2, 400, 7):
        for video_fps in (4, 24, 25, 29.97, 30, 60):
            for max_frames in (32, 768):
                ours = sample_indices(total, video_fps, fps=2.0, max_frames=max_frames)
                theirs = transformers_indices(total, video_fps, 2.0, max_frames)
                overshoots += theirs[-1] >= total
                assert ours == [i for i in theirs if i < total], (total, video_fps, max_frames)
    assert overshoots  # the transformers quirk this test documents is still there


def test_sampling_rule():
    assert sample_indices(8, 4.0) == [0, 2, 4, 6]  # 2 s at 2 fps
    assert sample_indices(40, 4.0) == list(range(0, 40, 2))  # 10 s: 20 frames
    assert len(sample_indices(3000, 30.0)) == 32  # 100 s: capped, spread over the whole video
    assert sample_indices(3000, 30.0)[-1] > 2900
    assert sample_indices(10, 30.0) == [0, 2, 5, 7]  # 1/3 s: at least 4 frames
    assert sample_indices(3, 30.0) == [0, 1]  # fewer than 4: an even count
    assert sample_indices(1, 30.0) == [0]  # shorter than a temporal patch: every frame
    assert sample_indices(0, 30.0) == []
    assert sample_indices(100, None, max_frames=10) == list(range(0, 100, 10))  # no frame rate known
    assert all(len(sample_indices(t, 25.0)) % 2 == 0 for t in range(2, 500))


# ---------------------------------------------------------------------------------------------- decoding


def nearest_pattern(frame, total: int, seed: int = 0) -> int:
    """Which frame of the source pattern a decoded frame is (smallest mean absolute difference)."""
    pixels = np.asarray(frame, dtype=np.float32)
    errors = [np.abs(pixels - pattern_frame(i, frame.size, seed)).mean() for i in range(total)]
    return int(np.argmin(errors))


def test_decode_mp4_samples_the_right_frames():
    frames = decode_video(make_mp4(frames=8, fps=4), 0)
    assert len(frames) == 4 and all(f.size == (96, 80) and f.mode == "RGB" for f in frames)
    assert [nearest_pattern(f, 8) for f in frames] == [0, 2, 4, 6]


def test_decode_long_video_is_capped():
    frames = decode_video(make_mp4(frames=120, fps=4, size=(32, 24)), 0, max_frames=16)
    assert len(frames) == 16  # 30 s at 2 fps would be 60
    assert [nearest_pattern(f, 120) for f in frames] == [k * 120 // 16 for k in range(16)]


@pytest.mark.parametrize("codec,fmt", [("mpeg4", "avi"), ("libx264", "mp4"), ("libx264", "matroska")])
def test_decode_other_containers(codec, fmt):
    """AVI, H.264 (B-frames: decode order is not presentation order) and Matroska (no frame count in
    the header: the packets are counted)."""
    frames = decode_video(make_mp4(frames=12, fps=6, codec=codec, fmt=fmt), 0)
    assert len(frames) == 4 and frames[0].size == (96, 80)
    assert [nearest_pattern(f, 12) for f in frames] == [0, 3, 6, 9]


def test_truncated_video_gives_the_frames_it_has():
    data = make_mp4(frames=40, fps=4, fmt="avi")  # 10 s: 20 frames sampled
    frames = decode_video(data[: len(data) * 6 // 10], 0)
    assert 2 <= len(frames) < 20
    # the last frame may be cut short (ffmpeg conceals the missing part): compare the others
    assert [nearest_pattern(f, 40) for f in frames[:-1]] == list(range(0, 2 * len(frames) - 2, 2))


def test_single_frame_video_gives_two_frames():
    frames = decode_video(make_mp4(frames=1), 0)
    assert len(frames) == 2 and frames[0].tobytes() == frames[1].tobytes()


@pytest.mark.parametrize("data", [b"", b"not a video at all" * 100, make_mp4()[:200]])
def test_undecodable_video_is_a_validation_error(data):
    with pytest.raises(SwitchboardError) as err:
        decode_video(data, 3)
    assert err.value.info.kind == ErrorKind.VALIDATION
    assert err.value.info.message.startswith("media item 3: the video cannot be decoded: ")


# ---------------------------------------------------------------------------------------------- pixels


@pytest.mark.parametrize("processor", ["tiny", "default"])
def test_two_identical_frames_are_the_image(processor):
    """Qwen2-VL encodes an image as a 2-frame video of itself: bit for bit the image processor's output."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image_processor = tiny_image_processor() if processor == "tiny" else Qwen2VLImageProcessorPil()
    image = test_image(0, size=(150, 100))
    expected = image_processor(images=[image], return_tensors="np")
    video = qwen2_vl_video([image, image.copy()], image_processor)
    assert video["pixel_values_videos"].dtype == np.float32 and video["video_grid_thw"].dtype == np.int64
    assert video["pixel_values_videos"].shape == expected["pixel_values"].shape
    assert np.array_equal(video["pixel_values_videos"], expected["pixel_values"])
    assert np.array_equal(video["video_grid_thw"], expected["image_grid_thw"])


def video_processor_patchify(frames: list, image_processor) -> tuple[np.ndarray, list[int]]:
    """Qwen2VLVideoProcessor's _preprocess (resize, rescale+normalise, pad, patchify), its tensor code
    ported to numpy with the Pillow processor's per-frame resize/rescale/normalise."""
    ip, p, m, tps = image_processor, image_processor.patch_size, image_processor.merge_size, 2
    arrays = []
    for frame in frames:
        x = ip.process_image(frame, do_convert_rgb=True)
        x = ip.resize(x, size=ip.size, resample=ip.resample, factor=p * m)
        arrays.append(ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std))
    videos = np.stack(arrays)[None]  # (batch, frames, C, H, W)
    if pad := -videos.shape[1] % tps:
        videos = np.concatenate([videos, np.repeat(videos[:, -1:], pad, axis=1)], axis=1)
    b, t, c, h, w = videos.shape
    gt, gh, gw = t // tps, h // p, w // p
    patches = videos.reshape(b, gt, tps, c, gh // m, m, p, gw // m, m, p).transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(b, gt * gh * gw, c * tps * p * p)[0], [gt, gh, gw]


@pytest.mark.parametrize("count", [3, 4])
def test_video_patch_layout_is_the_video_processors(count):
    """Frames of a video are stacked along temporal per group, padded by repeating the last frame."""
    image_processor = tiny_image_processor()
    frames = [test_image(seed, size=(120, 90)) for seed in range(count)]
    video = qwen2_vl_video(frames, image_processor)
    expected, grid = video_processor_patchify(frames, image_processor)
    assert video["video_grid_thw"].tolist() == [grid] and grid[0] == 2
    assert np.array_equal(video["pixel_values_videos"], expected.astype(np.float32))


def test_video_size_override_and_folder_config(tmp_path):
    image_processor = tiny_image_processor()
    frames = [test_image(0, size=(150, 100))] * 2
    small = qwen2_vl_video(frames, image_processor, size={"shortest_edge": 784, "longest_edge": 4 * 784})
    assert int(np.prod(small["video_grid_thw"])) <= 16 < int(np.prod(qwen2_vl_video(frames, image_processor)["video_grid_thw"]))
    (tmp_path / "processor_config.json").write_text('{"video_processor": {"min_pixels": 1, "size": {"longest_edge": 9}}}')
    assert video_size(tmp_path) == {"shortest_edge": 1, "longest_edge": 9}
    assert video_size(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------------- tokens


def test_expand_video_tokens():
    video, image, merge = 90, 91, 2
    grid = np.array([[2, 6, 4], [1, 2, 2]])  # 12 and 1 tokens
    ids, types = expand_video_tokens([1, video, 2, image, image, 3, video], grid, video_token_id=video,
                                     image_token_id=image, merge_size=merge)
    assert ids == [1] + [video] * 12 + [2, image, image, 3] + [video]
    assert types == [0] + [2] * 12 + [0, 1, 1, 0] + [2]
    ids, types = expand_video_tokens([image, video], grid[:1], video_token_id=video, image_token_id=image,
                                     merge_size=merge, image_grid_thw=np.array([[1, 4, 4]]))
    assert ids == [image] * 4 + [video] * 12 and types == [1] * 4 + [2] * 12
    for bad in ([1, video], [video, video, video]):
        with pytest.raises(SwitchboardError) as err:
            expand_video_tokens(bad, grid, video_token_id=video, image_token_id=image, merge_size=merge)
        assert err.value.info.kind == ErrorKind.VALIDATION


# ---------------------------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory, smol_dir):
    from tests.vlm_models import make_qwen2_vl

    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-video"), smol_dir)


def test_expansion_matches_the_processor(qwen2_vl_dir):
    """Growing ids equals Qwen2VLProcessor: for images (its own output) and for videos (its text-level
    replacement of the pad, tokenised)."""
    from tests.vlm_models import QWEN2_VL_IMAGE
    from tests.vlm_oracles import load

    processor, model = load(qwen2_vl_dir)
    tokenizer, config = processor.tokenizer, model.config
    ids = {"video_token_id": config.video_token_id, "image_token_id": config.image_token_id, "merge_size": 2}
    text = f"a {QWEN2_VL_IMAGE} b {QWEN2_VL_VIDEO} c"
    image = test_image(1)
    reference = processor(text=text.replace(QWEN2_VL_VIDEO, ""), images=[image], return_tensors="np")
    grid = np.array([[3, 6, 8]])
    ours, types = expand_video_tokens(tokenizer(text)["input_ids"], grid, image_grid_thw=reference["image_grid_thw"],
                                      **ids)
    image_tokens = int(np.prod(reference["image_grid_thw"])) // 4
    expanded = text.replace("<|video_pad|>", "<|video_pad|>" * 36).replace("<|image_pad|>", "<|image_pad|>" * image_tokens)
    assert ours == tokenizer(expanded)["input_ids"]
    assert [i for i, t in zip(ours, types) if t == 1] == [i for i in reference["input_ids"][0] if i == config.image_token_id]
    assert types == processor.create_mm_token_type_ids([ours])[0]


def test_transformers_generates_from_videos(qwen2_vl_dir):
    """transformers' own Qwen2-VL runs on these inputs; different videos give different answers; a video
    of an image twice has exactly the image's vision features."""
    import torch

    from tests.video_items import hf_generate_video, hf_video_inputs
    from tests.vlm_oracles import load

    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    videos = [make_mp4(frames=8, fps=4, seed=seed) for seed in (0, 1)]
    inputs = hf_video_inputs(qwen2_vl_dir, videos[:1], messages=messages)
    assert inputs["video_grid_thw"].tolist() == [[2, 6, 6]]  # 4 frames of 84x84 after smart_resize
    assert int((inputs["input_ids"] == load(qwen2_vl_dir)[1].config.video_token_id).sum()) == 18
    outputs = [hf_generate_video(qwen2_vl_dir, [video], messages=messages, max_new_tokens=12) for video in videos]
    assert all(outputs), outputs
    assert outputs[0] != outputs[1], outputs
    assert hf_generate_video(qwen2_vl_dir, videos[:1], messages=messages, max_new_tokens=12) == outputs[0]

    processor, model = load(qwen2_vl_dir)
    image = test_image(2)
    as_image = processor.image_processor(images=[image], return_tensors="pt")
    as_video = qwen2_vl_video([image, image], processor.image_processor)
    with torch.inference_mode():
        image_features = model.model.get_image_features(as_image["pixel_values"], as_image["image_grid_thw"]).pooler_output
        video_features = model.model.get_video_features(torch.from_numpy(as_video["pixel_values_videos"]),
                                                        torch.from_numpy(as_video["video_grid_thw"])).pooler_output
    assert torch.equal(torch.cat(image_features), torch.cat(video_features))
