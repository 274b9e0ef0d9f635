"""SmolVLM2 videos without torchvision (services/tokenizer/media/smolvlm_video.py), checked against transformers:
its frame sampling and PyAV reader, SmolVLMProcessor's prompt text, the Pillow image processor's
pixels, and SmolVLMForConditionalGeneration's own generate on what the module produces."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from services.tokenizer.media.multimodal import MediaProcessor
from services.tokenizer.media.smolvlm_video import (
    SampledVideo,
    VideoSettings,
    decode_smolvlm_video,
    expand_smolvlm_prompt,
    number_words,
    sample_indices,
    smolvlm_video,
    video_settings,
)
from shared.errors import ErrorKind, SwitchboardError
from tests.video_items import make_mp4


@pytest.fixture(scope="module")
def smolvlm2_dir(tmp_path_factory, smol_dir) -> Path:
    from tests.smolvlm2_models import make_smolvlm2

    return make_smolvlm2(tmp_path_factory.mktemp("smolvlm2"), smol_dir)


@pytest.fixture(scope="module")
def loaded(smolvlm2_dir):
    """(processor, model, settings) as the tokenizer service and transformers load the folder."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(smolvlm2_dir, dtype=torch.float32).eval()
    return MediaProcessor.load(str(smolvlm2_dir)).processor, model, video_settings(smolvlm2_dir)


def transformers_sample_frames():
    """``SmolVLMVideoProcessor.sample_frames`` itself: its module imports only with torchvision, so the
    method's source is taken from the installed transformers and compiled alone."""
    import transformers.models.smolvlm as package

    source = (Path(package.__file__).parent / "video_processing_smolvlm.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "SmolVLMVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    method.returns = None
    for arg in method.args.args + method.args.kwonlyargs:
        arg.annotation = None
    namespace = {"np": np}
    exec(compile(ast.Module([method], []), "video_processing_smolvlm.py", "exec"), namespace)  # noqa: S102 -- transformers' own code
    return namespace["sample_frames"]


class _Self:
    num_frames, fps = 64, 1


# ---------------------------------------------------------------------------------------------- pieces


def test_number_words_are_num2words():
    # num2words 0.5.14's English cardinals (the whole range 0..999999 was compared once, all equal)
    expected = {0: "zero", 1: "one", 13: "thirteen", 21: "twenty-one", 64: "sixty-four", 100: "one hundred",
                101: "one hundred and one", 256: "two hundred and fifty-six", 1000: "one thousand",
                1001: "one thousand and one", 1100: "one thousand, one hundred",
                1234: "one thousand, two hundred and thirty-four", 21000: "twenty-one thousand"}
    assert {n: number_words(n) for n in expected} == expected


def test_sampling_is_transformers():
    from transformers.video_utils import VideoMetadata

    sample_frames = transformers_sample_frames()
    for total in (1, 2, 7, 16, 30, 121, 1000, 9000):
        for video_fps in (1.0, 4.0, 24.0, 29.97, 30.0):
            for fps, max_frames in ((1, 64), (2, 8), (0.5, 3)):
                metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
                want = sample_frames(_Self(), metadata, num_frames=max_frames, fps=fps).tolist()
                assert sample_indices(total, video_fps, fps, max_frames) == want, (total, video_fps, fps)


def test_decoding_is_transformers_pyav_reader():
    from transformers.video_utils import read_video_pyav

    data = make_mp4(frames=16, fps=4, seed=3)
    sample_frames = transformers_sample_frames()
    frames, metadata = read_video_pyav(io.BytesIO(data), lambda metadata: sample_frames(_Self(), metadata))
    video = decode_smolvlm_video(data, 0, VideoSettings(fps=1, max_frames=64))
    assert video.indices == list(metadata.frames_indices) == [0, 5, 10, 15]
    assert (video.fps, video.duration) == (metadata.fps, metadata.duration) == (4.0, 4.0)
    assert np.array_equal(np.stack([np.asarray(f) for f in video.frames]), frames)


def test_settings_follow_the_video_processor(smolvlm2_dir):
    # the config's top-level size wins over video_sampling's video_size, as in SmolVLMVideoProcessor
    assert video_settings(smolvlm2_dir) == VideoSettings(fps=1, max_frames=64, size=128, max_image_size=64)


def test_prompt_text_is_smolvlm_processors(loaded):
    from transformers.video_utils import VideoMetadata

    processor, _, settings = loaded
    short = decode_smolvlm_video(make_mp4(frames=8, fps=4, seed=1), 1, settings)  # 2 s: frames 0 and 7
    long = SampledVideo(short.frames * 40, list(range(0, 80 * 75, 75)), 25.0, 3725.0)  # timestamps past a minute
    text = "<|im_start|>user\n<video>Which is it?<video><|im_end|>\n"
    expanded, tensors = expand_smolvlm_prompt(text, [short, long], processor, settings)

    def replacement(video):
        metadata = VideoMetadata(total_num_frames=len(video.indices), fps=video.fps, duration=video.duration,
                                 frames_indices=video.indices)
        return processor.replace_video_token({"pixel_values": tensors["pixel_values"],
                                              "video_metadata": [metadata]}, 0)

    want = processor.get_text_with_replacements([text], [], [replacement(short), replacement(long)])[0][0]
    assert expanded == want
    assert "series of eighty frames from a 1:02:05 [H:MM:SS] video" in expanded
    assert "\nFrame from 00:01:" in expanded and "\nFrame from 03:57:" in expanded
    assert tensors["pixel_values"].shape == (2, 80, 3, 64, 64)
    assert tensors["pixel_attention_mask"].shape == (2, 80, 64, 64) and tensors["pixel_attention_mask"].all()
    assert not tensors["pixel_values"][0, 2:].any()  # the short video's padding frames are zeros
    assert expanded.count("<image>") == (2 + 80) * processor.image_seq_len


def test_frame_pixels_are_the_image_processors_and_pillows(loaded):
    from PIL import Image

    processor, model, settings = loaded
    frame = decode_smolvlm_video(make_mp4(frames=1, fps=4, seed=2), 0, settings)
    assert len(frame.frames) == 1
    text, tensors = smolvlm_video(frame, processor, settings)
    image = processor.image_processor(images=[[frame.frames[0]]], do_image_splitting=False, return_tensors="np")
    assert np.array_equal(tensors["pixel_values"], image["pixel_values"])
    # the video processor's steps by hand: longest edge to 128 (96x80 -> 128x106, even), then 64x64, LANCZOS
    resized = frame.frames[0].resize((128, 106), Image.LANCZOS).resize((64, 64), Image.LANCZOS)
    by_hand = (np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255 - 0.5) / 0.5
    np.testing.assert_allclose(tensors["pixel_values"][0, 0], by_hand, atol=1e-6)
    assert text.count("<image>") == processor.image_seq_len and "series of one frames" in text
    with torch.inference_mode():  # the frame's features are the image's (the engine encodes both alike)
        got = model.model.get_image_features(torch.from_numpy(tensors["pixel_values"]),
                                             torch.from_numpy(tensors["pixel_attention_mask"])).pooler_output
        want = model.model.get_image_features(torch.from_numpy(image["pixel_values"]),
                                              torch.from_numpy(image["pixel_attention_mask"])).pooler_output
    assert torch.equal(torch.cat(got), torch.cat(want))


def test_images_with_videos_and_miscounts_are_refused(loaded):
    processor, _, settings = loaded
    video = decode_smolvlm_video(make_mp4(frames=8, fps=4), 0, settings)
    cases = [("<image><video>", [video], [object()]), ("<video><video>", [video], None),
             ("<image><video>", [video], None)]
    for text, videos, images in cases:
        with pytest.raises(SwitchboardError) as err:
            expand_smolvlm_prompt(text, videos, processor, settings, images=images)
        assert err.value.kind is ErrorKind.VALIDATION


# ---------------------------------------------------------------------------------------------- oracle


def generate(loaded, videos: list[bytes], question: str = "What happens in the video?") -> tuple[list[int], dict]:
    """transformers' greedy SmolVLMForConditionalGeneration.generate on the module's ids and tensors,
    the chat rendered by the folder's template; the new ids, and the inputs."""
    processor, model, settings = loaded
    content = [{"type": "video"} for _ in videos] + [{"type": "text", "text": question}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False)
    sampled = [decode_smolvlm_video(data, i, settings) for i, data in enumerate(videos)]
    expanded, tensors = expand_smolvlm_prompt(text, sampled, processor, settings)
    ids = processor.tokenizer(expanded, return_tensors="pt")["input_ids"]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              **{name: torch.from_numpy(value) for name, value in tensors.items()}}
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    return out[0, ids.shape[1]:].tolist(), inputs


def test_generate_runs_and_videos_steer_it(loaded):
    _, model, _ = loaded
    first, inputs = generate(loaded, [make_mp4(frames=16, fps=4, seed=0)])
    second, _ = generate(loaded, [make_mp4(frames=16, fps=4, seed=5)])
    assert len(first) > 0 and first != second
    # what the engine runs: get_image_features on [videos, frames, ...], one row per <image> token
    with torch.inference_mode():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
    rows = torch.cat(list(features.pooler_output))
    assert rows.shape[0] == int((inputs["input_ids"] == model.config.image_token_id).sum()) == 4 * 4


def test_generate_two_videos_of_different_lengths(loaded):
    new, inputs = generate(loaded, [make_mp4(frames=8, fps=4, seed=1), make_mp4(frames=16, fps=4, seed=2)],
                           "Compare the videos.")
    assert len(new) > 0
    assert inputs["pixel_values"].shape[:2] == (2, 4)  # 2 frames padded to the other's 4
    assert int((inputs["input_ids"] == loaded[1].config.image_token_id).sum()) == (2 + 4) * 4
