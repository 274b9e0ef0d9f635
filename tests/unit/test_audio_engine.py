"""Audio on a Qwen2-Audio folder through the tokenizer's decoding and processing and the engine's step:
outputs equal transformers' ``generate`` token for token, alone, batched with text-only requests and in
Mix chunks; WAV and FLAC of the same clip give the same tokens; different clips differ."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.tokenizer.media.multimodal import MediaProcessor
from tests.audio_models import flac_bytes, hf_generate_audio, make_qwen2_audio, test_clip, wav_bytes
from tests.unit.engine_helpers import assert_pool_whole, limits, make_runner, media_request, run_until_idle

NEW = 12
RATE = 16000
CLIPS = {"a": [test_clip(1)], "b": [test_clip(2, seconds=0.6)], "both": [test_clip(1), test_clip(3)], "text": []}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_dir):
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio"), smol_dir)


def messages(case: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What do you hear?"}]
             + [{"type": "audio"}] * len(CLIPS[case])}]


def engine_request(processor: MediaProcessor, case: str, encode=wav_bytes):
    return media_request(processor, case, messages(case)[0]["content"],
                         [("audio", encode(clip, RATE)) for clip in CLIPS[case]], NEW)


def test_audio_equals_transformers_alone_together_and_in_chunks(model_dir):
    processor = MediaProcessor.load(str(model_dir))
    assert processor.modalities == ["audio"]
    reference = {case: hf_generate_audio(model_dir, CLIPS[case], messages=messages(case), max_new_tokens=NEW)
                 for case in CLIPS}
    assert reference["a"] != reference["b"]
    runner = make_runner(model_dir, 96)
    assert runner.modalities == ["audio"]
    for case, encode in (("a", wav_bytes), ("a", flac_bytes), ("both", wav_bytes)):
        engine = Engine(runner, limits(), {2})
        engine.add_request(engine_request(processor, case, encode))
        assert run_until_idle(engine).tokens[case] == reference[case], (case, encode.__name__)
    for limit_kw in ({}, {"mix": True, "prefill_chunk_size": 9}):
        engine = Engine(runner, limits(**limit_kw), {2})
        for case in CLIPS:
            engine.add_request(engine_request(processor, case))
        assert run_until_idle(engine, check_blocks=True).tokens == reference, limit_kw
        assert_pool_whole(engine)
