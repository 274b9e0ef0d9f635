"""The engine's vision-language path on a SmolVLM (Idefics3) whose text model is the real SmolLM2:
the features of a request's images go at its image tokens in the flat step, so outputs equal
transformers' ``generate``; requests with and without images share steps, Mix chunks that cut
through an image, the prefix cache and preemption without changing any request's tokens."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.tokenizer.media.multimodal import MediaProcessor
from tests.media_items import png_bytes, test_image
from tests.unit.engine_helpers import (
    Run,
    assert_pool_whole,
    limits,
    make_runner,
    media_request,
    run_until_idle,
)
from tests.vlm_oracles import hf_generate

NEW = 24
CAT, DOG = test_image(1), test_image(2)
QUESTION, COMPARE = "What is in this image?", "Tell me about these images."


@pytest.fixture(scope="module")
def runner(smolvlm_dir):
    return make_runner(smolvlm_dir, 96)


@pytest.fixture(scope="module")
def processor(smolvlm_dir):
    return MediaProcessor.load(str(smolvlm_dir))


CASES = {  # request id -> (question, images): a user turn with the question, then the images
    "cat": (QUESTION, [CAT]),
    "dog": (QUESTION, [DOG]),
    "both": (COMPARE, [CAT, DOG]),
    "text": ("What is the capital of France?", []),
}


def messages(rid: str) -> list[dict]:
    question, images = CASES[rid]
    return [{"role": "user", "content": [{"type": "text", "text": question}] + [{"type": "image"}] * len(images)}]


def engine_request(processor, rid: str):
    return media_request(processor, rid, messages(rid)[0]["content"],
                         [("image", png_bytes(img)) for img in CASES[rid][1]], NEW)


def run(runner, reqs, prefix_cache=False, **limit_kw) -> Run:
    engine = Engine(runner, limits(**limit_kw), {2}, prefix_cache=prefix_cache)
    for req in reqs:
        engine.add_request(req)
    out = run_until_idle(engine, check_blocks=True)
    assert_pool_whole(engine)
    return out


@pytest.fixture(scope="module")
def reference(smolvlm_dir):
    """transformers' greedy tokens for every case."""
    return {rid: hf_generate(smolvlm_dir, images, messages=messages(rid), max_new_tokens=NEW)
            for rid, (_, images) in CASES.items()}


def test_one_and_two_images_equal_transformers(runner, processor, smolvlm_dir, reference):
    for rid in ("cat", "dog", "both"):
        out = run(runner, [engine_request(processor, rid)])
        assert out.tokens[rid] == reference[rid], rid
    assert reference["cat"] != reference["dog"] and min(len(reference[r]) for r in ("cat", "dog", "both")) >= 10


def test_a_mixed_batch_equals_each_request_alone(runner, processor, reference):
    together = run(runner, [engine_request(processor, rid) for rid in CASES])
    assert together.tokens == reference


@pytest.mark.parametrize("chunk", [7, 16])
def test_mix_chunks_that_cut_through_images_change_nothing(runner, processor, smolvlm_dir, reference, chunk):
    out = run(runner, [engine_request(processor, rid) for rid in ("cat", "both", "dog")],
              mix=True, prefill_chunk_size=chunk)
    assert out.tokens == {rid: reference[rid] for rid in ("cat", "both", "dog")}


def test_the_prefix_cache_never_gives_one_image_another_images_cache(runner, processor, smolvlm_dir, reference):
    engine = Engine(runner, limits(), {2}, prefix_cache=True)
    for rid in ("cat", "dog", "cat"):
        req = engine_request(processor, rid)
        req.id = f"{rid}-{engine.blocks.prefix_hit_tokens}"
        engine.add_request(req)
        out = run_until_idle(engine)
        assert out.tokens[req.id] == reference[rid], req.id
    assert engine.blocks.prefix_hit_tokens > 0  # the second cat reused the first cat's blocks
    assert_pool_whole(engine)


def test_preempted_requests_recompute_from_their_features(smolvlm_dir, processor, reference):
    small = make_runner(smolvlm_dir, 11)
    reqs = [engine_request(processor, rid) for rid in ("cat", "dog", "both", "cat")]
    reqs[3].id = "cat2"
    engine = Engine(small, limits(max_preempt_count=2), {2})
    for req in reqs:
        engine.add_request(req)
    out = run_until_idle(engine, check_blocks=True)
    assert out.tokens == {"cat": reference["cat"], "dog": reference["dog"], "both": reference["both"],
                          "cat2": reference["cat"]}
    assert engine.scheduler.num_preemptions > 0, "the pool was big enough: nothing was preempted"


def test_media_for_a_text_model_are_refused_by_the_engine(tiny_runner, processor, smolvlm_dir):
    req = engine_request(processor, "cat")
    req.prompt_ids = [i % 1000 for i in req.prompt_ids]
    out = run(tiny_runner, [req])
    assert out.reason("cat") == "error"
    assert "text-only" in out.finish["cat"].error.message
