"""Engine.step() with the prefix cache on the tiny random model: prompts after a cached prefix, alone,
together, in Mix chunks, across turns, with seeded sampling and with preemption, give the same tokens
and log-probabilities (within 1e-4) as each prompt alone without the cache, and hit the shared blocks;
the engine's heartbeat carries the counters. (The default model with the cache: test_engine_steps.)
"""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from tests.unit.engine_helpers import (
    BLOCK, MIX, TOP, Run, alone, assert_pool_whole, assert_same_outputs, limits, outputs, prompt, request,
    run_until_idle,
)

# ---- prefix caching ---------------------------------------------------------------------------

SHARED_IDS = prompt(3 * BLOCK, start=600)  # three whole blocks
SUFFIXES = [prompt(7, start=20), prompt(11, start=40), prompt(1, start=60)]  # the last: all but one token cached
SHARED_PROMPTS = {f"r{i}": SHARED_IDS + suffix for i, suffix in enumerate(SUFFIXES)}


def shared_prefix_run(runner, prefix_cache: bool, order: str, limit_kw: dict | None = None, **sampling):
    engine = Engine(runner, limits(**(limit_kw or {})), set(), prefix_cache=prefix_cache)
    run = Run()
    hits = []
    for rid, ids in SHARED_PROMPTS.items():
        engine.add_request(request(rid, ids, max_new_tokens=8, logprobs=TOP, **sampling))
        if order == "one by one":
            run = run_until_idle(engine, run, check_blocks=True)
            hits.append(engine.blocks.prefix_hit_tokens)
    run = run_until_idle(engine, run, check_blocks=True)
    assert_pool_whole(engine)
    return engine, run, hits


@pytest.mark.parametrize("limit_kw", [{}, MIX], ids=["standard", "mix"])
def test_prefix_cache_one_by_one_gives_the_same_outputs_and_hits_the_shared_blocks(tiny_runner, limit_kw):
    """With the cache off and on, the outputs are each prompt's alone in Standard mode."""
    expected = alone(tiny_runner, SHARED_PROMPTS, 8)
    _, off, _ = shared_prefix_run(tiny_runner, False, "one by one", limit_kw)
    engine, run, hits = shared_prefix_run(tiny_runner, True, "one by one", limit_kw)
    assert_same_outputs(off, expected)
    assert_same_outputs(run, expected)
    assert hits == [0, 3 * BLOCK, 6 * BLOCK]  # the second and third reuse the three shared blocks
    assert engine.blocks.prefix_queried_tokens == sum(len(ids) for ids in SHARED_PROMPTS.values())


def test_prefix_cache_off_counts_nothing(tiny_runner):
    engine, _, hits = shared_prefix_run(tiny_runner, False, "one by one")
    assert hits == [0, 0, 0] and engine.blocks.prefix_queried_tokens == 0


@pytest.mark.parametrize("limit_kw, hits", [({}, 0), (MIX, 6 * BLOCK)], ids=["standard", "mix"])
def test_prefix_cache_with_requests_together_gives_the_same_outputs(tiny_runner, limit_kw, hits):
    """Arriving together: Standard computes the prefix three times in one step (nothing to hit yet); Mix
    chunks the first prompt (16 a step), and the others, admitted beside its last chunk, hit its blocks."""
    expected = alone(tiny_runner, SHARED_PROMPTS, 8)
    _, off, _ = shared_prefix_run(tiny_runner, False, "together", limit_kw)
    engine, run, _ = shared_prefix_run(tiny_runner, True, "together", limit_kw)
    assert_same_outputs(off, expected)
    assert_same_outputs(run, expected)
    assert engine.blocks.prefix_hit_tokens == hits


def test_mix_a_prompt_admitted_while_a_shared_prefix_is_chunked_reuses_the_blocks_computed_so_far(tiny_runner):
    """Chunks of 40: r0's first step computes 40 tokens (2 whole blocks); r1 and r2, admitted while r0's
    later pieces run (each piece waits for a budget it fits whole), find at least those 2 blocks each."""
    expected = alone(tiny_runner, SHARED_PROMPTS, 8)
    engine = Engine(tiny_runner, limits(mix=True, prefill_chunk_size=40), set(), prefix_cache=True)
    for rid, ids in SHARED_PROMPTS.items():
        engine.add_request(request(rid, ids, max_new_tokens=8, logprobs=TOP))
        if rid == "r0":
            run = Run()
            run.record(engine.step())
            assert engine.seqs["r0"].num_computed == 40
    run = run_until_idle(engine, run, check_blocks=True)
    assert_same_outputs(run, expected)
    assert engine.blocks.prefix_hit_tokens >= 2 * BLOCK + 2 * BLOCK
    assert_pool_whole(engine)


def test_a_follow_up_turn_reuses_the_blocks_of_the_previous_answer(tiny_runner):
    """The generated tokens' full blocks are cached too: a prompt that repeats the last exchange (40 prompt
    + 30 generated tokens, 69 of them computed) and adds 5 finds 4 whole blocks."""
    first = prompt(40, start=300)
    engine = Engine(tiny_runner, limits(), set(), prefix_cache=True)
    engine.add_request(request("turn1", first, max_new_tokens=30, logprobs=TOP, ignore_eos=True))
    run = run_until_idle(engine, check_blocks=True)
    follow_up = first + run.tokens["turn1"] + prompt(5, start=900)
    engine.add_request(request("turn2", follow_up, max_new_tokens=8, logprobs=TOP))
    run = run_until_idle(engine, run, check_blocks=True)
    assert engine.blocks.prefix_hit_tokens == 4 * BLOCK
    expected = alone(tiny_runner, {"turn2": follow_up}, 8)
    ours = Run()
    ours.record([e for e in run.events if e.id == "turn2"])
    assert_same_outputs(ours, expected)
    assert_pool_whole(engine)


def test_mix_a_hit_crossing_a_chunk_boundary_gives_the_outputs_of_no_cache_bit_for_bit(tiny_runner):
    """Chunks of 32: with the cache, r1's and r2's new tokens (from position 48) cross the boundary at 64 in
    one step; without it, their prompts go 0-32, 32-64, 64-end. Each row attends to keys ending where its
    segment does either way, and the linear layers are batch-invariant: the same numbers exactly."""
    mix32 = dict(mix=True, prefill_chunk_size=32)
    prompts = {f"r{i}": SHARED_IDS + prompt(20 + 3 * i, start=20 + 40 * i) for i in range(3)}
    runs = []
    for cache in (False, True):
        engine = Engine(tiny_runner, limits(**mix32), set(), prefix_cache=cache)
        run = Run()
        for rid, ids in prompts.items():
            engine.add_request(request(rid, ids, max_new_tokens=8, logprobs=TOP))
            run = run_until_idle(engine, run, check_blocks=True)
        runs.append((run, engine.blocks.prefix_hit_tokens))
    (off, _), (on, hits) = runs
    assert hits == 6 * BLOCK and on.tokens == off.tokens and outputs(on) == outputs(off)


SEEDED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)


@pytest.mark.parametrize("order", ["one by one", "together"])
def test_prefix_cache_leaves_seeded_sampling_unchanged(tiny_runner, order):
    expected = alone(tiny_runner, SHARED_PROMPTS, 8, seed=77, **SEEDED)
    _, off, _ = shared_prefix_run(tiny_runner, False, order, seed=77, **SEEDED)
    engine, run, _ = shared_prefix_run(tiny_runner, True, order, seed=77, **SEEDED)
    assert_same_outputs(off, expected)
    assert_same_outputs(run, expected)
    assert len({tuple(t) for t in run.tokens.values()}) == 3  # sampled, not all alike
    if order == "one by one":
        assert engine.blocks.prefix_hit_tokens == 6 * BLOCK


@pytest.mark.parametrize("limit_kw", [{}, MIX], ids=["standard", "mix"])
def test_preemption_with_prefix_cache_completes_everything_and_returns_the_pool(small_pool_runner, tiny_runner,
                                                                                limit_kw):
    """6 blocks of 16; three 20-token prompts sharing their first block, growing to 60 tokens (4 blocks
    each): they take turns, and a preempted one comes back over whatever of its blocks are still cached."""
    prompts = {f"p{i}": prompt(16, start=500) + prompt(4, start=10 + 40 * i) for i in range(3)}
    expected = alone(tiny_runner, prompts, 40)
    engine = Engine(small_pool_runner, limits(max_preempt_count=2, **limit_kw), set(), prefix_cache=True)
    for rid, ids in prompts.items():
        engine.add_request(request(rid, ids, max_new_tokens=40, logprobs=TOP))
    run = Run()
    run.record(engine.step())
    seqs = list(engine.seqs.values())
    run = run_until_idle(engine, run, check_blocks=True)
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was big enough: nothing was preempted"
    assert engine.blocks.prefix_hit_tokens > 0
    assert_same_outputs(run, expected)
    assert all(run.reason(rid) == "length" for rid in prompts)
    assert_pool_whole(engine)


# ---- the heartbeat carries the prefix-cache counters ------------------------------------------


def test_the_engine_heartbeat_carries_the_prefix_cache_counters(tiny_runner, tiny_model_dir, tmp_path):
    from services.engine.service import EngineService
    from shared.config import load_config
    from tests.conftest import write_config

    engine, _, _ = shared_prefix_run(tiny_runner, True, "one by one")
    service = EngineService(load_config(write_config(tmp_path, tiny_model_dir)), None, engine, "cpu", None)
    info = service.info()
    assert info.prefix_queried_tokens_total == sum(len(ids) for ids in SHARED_PROMPTS.values())
    assert info.prefix_hit_tokens_total == 6 * BLOCK
