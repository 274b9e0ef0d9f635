"""LLaVA and Qwen2-VL through the tokenizer's processing and the engine's step: outputs with images
equal transformers' ``generate`` token for token. Qwen2-VL's image tokens rotate by 3-D (temporal,
height, width) positions (M-RoPE) and the tokens after them by a shifted position, so its batches mix
rows of both kinds with text-only rows, in Mix chunks too."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.tokenizer.multimodal import MediaProcessor
from shared.messages import GenerateRequest
from tests.unit.engine_helpers import assert_pool_whole, limits, make_runner, request, run_until_idle
from tests.vlm_models import hf_generate, make_llava, make_qwen2_vl, png_bytes, test_image

NEW = 12
IMAGES = {"one": [test_image(1)], "other": [test_image(2)], "two": [test_image(1), test_image(3)], "text": []}
QUESTION = "What colour is it?"


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def model_dir(request, tmp_path_factory, smol_dir):
    make = {"llava": make_llava, "qwen2_vl": make_qwen2_vl}[request.param]
    return make(tmp_path_factory.mktemp(request.param), smol_dir)


def messages(case: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}] + [{"type": "image"}] * len(IMAGES[case])}]


def engine_request(processor: MediaProcessor, case: str):
    """What the tokenizer service sends the engine: the rendered chat, the images through the processor."""
    text = processor.prompt_text(GenerateRequest(id=case, model="m", reply_to="x", messages=messages(case)),
                                 processor.processor.tokenizer)
    if not IMAGES[case]:
        return request(case, processor.processor.tokenizer(text, add_special_tokens=False).input_ids,
                       max_new_tokens=NEW)
    prepared = processor.process(text, [png_bytes(img) for img in IMAGES[case]])
    req = request(case, prepared.ids, max_new_tokens=NEW)
    req.media = prepared.media
    return req


def test_images_equal_transformers_alone_together_and_in_chunks(model_dir):
    processor = MediaProcessor.load(str(model_dir))
    assert processor.modalities == ["image"]
    reference = {case: hf_generate(model_dir, IMAGES[case], messages=messages(case), max_new_tokens=NEW)
                 for case in IMAGES}
    assert reference["one"] != reference["other"]
    runner = make_runner(model_dir, 64)
    for case in ("one", "two"):
        engine = Engine(runner, limits(), {2})
        engine.add_request(engine_request(processor, case))
        assert run_until_idle(engine).tokens[case] == reference[case], case
    for limit_kw in ({}, {"mix": True, "prefill_chunk_size": 5}):
        engine = Engine(runner, limits(**limit_kw), {2})
        for case in IMAGES:
            engine.add_request(engine_request(processor, case))
        assert run_until_idle(engine, check_blocks=True).tokens == reference, limit_kw
        assert_pool_whole(engine)
