"""Prompt and mixed steps from static buffers (services/engine/step_graphs.py) give exactly the ordinary
step's tokens.

What the piecewise CUDA graphs replay is this path: a step's ids, positions and slots written into fixed
buffers padded to a size of the token ladder, each layer's pieces between the attentions run from them,
padding rows writing only the scratch block. Here it runs eagerly on the CPU (``capture=False``) beside a
runner without it: Mix steps (prompt chunks beside decodes), whole prompts, a prompt after a cached prefix,
grammar masks and seeded sampling; LoRA rows, prompt logprobs and steps past the largest size run the
ordinary way."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.engine.graphs import GraphPlan
from services.engine.step_graphs import token_sizes
from tests.unit.engine_helpers import BLOCK, limits, prompt, request, run_until_idle
from tests.unit.test_decode_graphs import adapter, assert_same, requests, runner  # noqa: F401 (adapter: a fixture)

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def runners(tiny_model_dir, adapter):  # noqa: F811
    plain = runner(tiny_model_dir, adapter, None)
    stepped = runner(tiny_model_dir, adapter, GraphPlan(max_rows=8, max_seq_len=512, capture=False,
                                                        max_tokens=MAX_TOKENS))
    return plain, stepped


def run(r, reqs, prefix_cache=False, **kw):
    engine = Engine(r, limits(**kw), {2}, prefix_cache=prefix_cache)
    for req in reqs:
        engine.add_request(req)
    return run_until_idle(engine, check_blocks=True)


@pytest.mark.parametrize("mix", [True, False])
def test_prompt_and_mixed_steps_from_the_buffers_give_the_ordinary_steps_tokens(runners, mix):
    plain, stepped = runners
    kw = dict(mix=True, prefill_chunk_size=16) if mix else dict(max_prefill_batch_size=1)  # (one prompt a step)
    reqs = requests() + [request("logprobs", prompt(9, start=700), max_new_tokens=5, prompt_logprobs=2, logprobs=2)]
    before = stepped.pieces.steps
    theirs, ours = run(plain, reqs, **kw), run(stepped, requests() + reqs[-1:], **kw)
    assert_same(ours, theirs)
    first = [next(e for e in r.events if e.id == "logprobs") for r in (ours, theirs)]
    assert first[0].prompt_logprobs == first[1].prompt_logprobs and first[0].prompt_logprobs
    assert stepped.pieces.steps - before >= 3  # the prompt steps without an adapter row, padded to the ladder
    assert plain.pieces is None


def test_a_prompt_after_a_cached_prefix(runners):
    plain, stepped = runners
    shared = prompt(40, start=300)

    def turns():
        return [request("first", shared + prompt(5, start=20), max_new_tokens=6, ignore_eos=True, logprobs=3),
                request("second", shared + prompt(9, start=900), max_new_tokens=6, ignore_eos=True, logprobs=3)]

    results = []
    for r in (plain, stepped):
        engine, run_ = Engine(r, limits(mix=True, prefill_chunk_size=16), {2}, prefix_cache=True), None
        for req in turns():  # one after the other: the second finds the first's blocks
            engine.add_request(req)
            run_ = run_until_idle(engine, run_, check_blocks=True)
        assert engine.blocks.prefix_hit_tokens == 2 * BLOCK
        results.append(run_)
    assert_same(results[1], results[0])


def test_padding_rows_write_only_the_scratch_block(runners):
    _, stepped = runners
    stepped.k_cache.zero_()
    engine = Engine(stepped, limits(), {2})
    engine.add_request(request("r", prompt(21), max_new_tokens=2, ignore_eos=True))  # 21 prompt tokens -> size 32
    steps, owned = stepped.pieces.steps, set()
    while engine.has_work:
        engine.step()
        owned.update(b for seq in engine.seqs.values() for b in seq.block_table)
    assert stepped.pieces.steps == steps + 1
    written = (stepped.k_cache != 0).any(dim=-1).any(dim=1).any(dim=0).view(-1, BLOCK).any(dim=1)  # per block
    assert set(written.nonzero().flatten().tolist()) == owned | {stepped.scratch_block}


def test_steps_past_the_largest_size_run_the_ordinary_way(runners):
    _, stepped = runners
    before = stepped.pieces.steps
    result = run(stepped, [request("long", prompt(MAX_TOKENS + 1), max_new_tokens=3, ignore_eos=True)])
    assert len(result.tokens["long"]) == 3
    assert stepped.pieces.steps == before  # one prompt step of 49 tokens; its decode steps are decode graphs' work


def test_the_token_ladder():
    assert token_sizes(16) == [16]
    assert token_sizes(48) == [16, 32, 48]
    assert token_sizes(192) == [16, 32, 64, 96, 128, 192]
    assert token_sizes(10_000)[-1] == 2048


def test_the_served_plan_covers_the_largest_step(tmp_path, tiny_model_dir):
    """Mix: a prompt chunk beside a token per decoding sequence; otherwise the most prompt tokens a step takes."""
    from services.engine.build import graph_plan
    from shared.config import load_config
    from tests.conftest import write_config

    schedule = "BackendConfig.ScheduleConfig"
    mix = graph_plan(load_config(write_config(tmp_path, tiny_model_dir, **{
        schedule: {"templateType": "Mix", "prefillChunkSize": 128, "maxBatchSize": 64}})))
    assert (mix.max_rows, mix.max_tokens) == (64, 192)
    (tmp_path / "b").mkdir()
    standard = graph_plan(load_config(write_config(tmp_path / "b", tiny_model_dir, **{
        schedule: {"templateType": "Standard", "maxPrefillTokens": 8192}})))
    assert standard.max_tokens == 8192 and token_sizes(standard.max_tokens)[-1] == 2048
