"""Steps launched ahead (services/engine/ahead.py) give exactly the tokens of steps read back one by one.

On the CPU the decode graphs' buffers run eagerly (``capture=False``), so a step launched ahead is computed at
once; what differs from the ordinary path is all that the GPU path has: the token ids copied from the last
step's tokens on the device (the graph's argmax, seeded draws over it), placeholders in the sequences, finishes seen one step late, a stray row for a
sequence that finished, blocks cached only once their tokens are known, preemption and cancels meanwhile."""

from __future__ import annotations

import pytest

from services.engine.ahead import PENDING
from services.engine.engine import Engine
from services.engine.graphs import GraphPlan
from services.engine.model_runner import ModelRunner
from shared.grammar import json_schema
from shared.messages import FinishReason
from tests.unit.engine_helpers import BLOCK, CPU, LOGPROB_ATOL, MIX, Run, block_bytes, limits, request

EOS = 2
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"], "additionalProperties": False}
TEXTS = [
    "The capital of France is",
    "Here is a long story about a dragon who lived in the mountains and guarded a treasure. One day,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A list of fruits: apple, banana, cherry,",
    "Once upon a time, in a small village by the sea,",
]


def graph_runner(path, num_blocks: int) -> ModelRunner:
    return ModelRunner(str(path), CPU, block_size=BLOCK, kv_budget_bytes=num_blocks * block_bytes(path),
                       max_blocks=num_blocks, graphs=GraphPlan(max_rows=8, max_seq_len=512, capture=False))


@pytest.fixture(scope="module")
def smol(smol_dir):
    return graph_runner(smol_dir, 64)


@pytest.fixture(scope="module")
def prompts(smol_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    return [tokenizer(text).input_ids for text in TEXTS]


def drive(engine: Engine, arrivals: dict[int, list], aborts: dict[int, str] | None = None, max_steps: int = 400) -> Run:
    """Step until idle; ``arrivals[k]`` are added and ``aborts[k]`` cancelled before step k; blocks checked."""
    run, aborts = Run(), aborts or {}
    while engine.has_work or any(k >= run.steps for k in arrivals):
        for req in arrivals.get(run.steps, []):
            engine.add_request(req)
        if run.steps in aborts:
            engine.abort(aborts[run.steps])
        run.record(engine.step())
        run.steps += 1
        engine.blocks.check(engine.scheduler.running)
        assert run.steps <= max_steps, "the engine made no progress"
    return run


def workload(prompts, stop_token: int | None = None) -> dict[int, list]:
    first = [request("short", prompts[0], max_new_tokens=5),
             request("story", prompts[1], max_new_tokens=40),
             request("code", prompts[2], max_new_tokens=24, stop_token_ids=[stop_token] if stop_token is not None else []),
             request("probs", prompts[3], max_new_tokens=6, logprobs=2),
             request("drawn", prompts[3], max_new_tokens=30, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                     seed=11, logprobs=3),
             request("chosen", prompts[2], max_new_tokens=28, ignore_eos=True, logprobs=0),
             request("penalised", prompts[0], max_new_tokens=26, repetition_penalty=1.3, presence_penalty=0.5,
                     frequency_penalty=0.4, do_sample=True, temperature=0.7, seed=3),
             request("repeats", prompts[1][:12], max_new_tokens=30, repetition_penalty=3.0, frequency_penalty=2.0),
             request("json", prompts[4], max_new_tokens=10, grammar=json_schema(SCHEMA))]  # its steps: ordinary ones
    return {0: first, 9: [request("late", prompts[4], max_new_tokens=20, ignore_eos=True)]}


def positions_in_order(run: Run) -> None:
    seen: dict[str, int] = {}
    for event in run.events:
        if event.token_ids:
            assert event.position == seen.get(event.id, -1) + 1, event
            seen[event.id] = event.position


@pytest.mark.parametrize("mix", [False, True])
def test_steps_ahead_give_the_ordinary_steps_tokens(smol, prompts, mix):
    kw = MIX if mix else {}
    plain = drive(Engine(smol, limits(**kw), {EOS}), workload(prompts))
    stop = plain.tokens["code"][7]  # "code" then ends at its first occurrence, through stop_token_ids
    plain = drive(Engine(smol, limits(**kw), {EOS}), workload(prompts, stop), {14: "story"})
    engine = Engine(smol, limits(**kw), {EOS}, steps_ahead=True)
    ours = drive(engine, workload(prompts, stop), {14: "story"})
    assert engine.ahead.launches >= 10
    assert engine.ahead.flight is None and not engine.seqs
    for rid in ("short", "code", "probs", "late", "drawn", "chosen", "penalised", "repeats", "json"):
        assert ours.tokens[rid] == plain.tokens[rid], rid
        assert ours.finish[rid].finish_reason == plain.finish[rid].finish_reason, rid
    for rid in ("probs", "drawn", "chosen"):  # logprobs computed on the device, read back with the tokens (a batch
        # may hold a finished sequence's stray row: another shape, sums rounded apart by ~1e-5)
        theirs = [e.logprobs[0] for e in plain.events if e.id == rid and e.token_ids]
        mine = [e.logprobs[0] for e in ours.events if e.id == rid and e.token_ids]
        assert [lp.logprob for lp in mine] == pytest.approx([lp.logprob for lp in theirs], abs=LOGPROB_ATOL), rid
        assert [lp.top_ids for lp in mine] == [lp.top_ids for lp in theirs], rid
        assert [lp.top_logprobs for lp in mine] == [pytest.approx(lp.top_logprobs, abs=LOGPROB_ATOL) for lp in theirs], rid
    assert plain.finish["code"].finish_reason is FinishReason.EOS_TOKEN and plain.tokens["code"][-1] == stop
    assert len(plain.tokens["late"]) == 20
    # cancelled at step 14: the tokens it had were reported, the last one a step late
    assert plain.finish["story"].finish_reason is ours.finish["story"].finish_reason is FinishReason.CANCELLED
    theirs = plain.tokens["story"]
    assert ours.tokens["story"] == theirs[:len(ours.tokens["story"])] and len(ours.tokens["story"]) >= len(theirs) - 1
    positions_in_order(ours)
    assert PENDING not in {t for tokens in ours.tokens.values() for t in tokens}


def test_blocks_are_cached_once_their_tokens_are_known(smol, prompts):
    """A sequence's decode blocks fill while steps run ahead: they enter the prefix cache with the keys the
    ordinary steps give them, and a prompt that continues the text finds them."""
    def one_then_follow_up(steps_ahead: bool):
        engine = Engine(smol, limits(), {EOS}, prefix_cache=True, steps_ahead=steps_ahead)
        engine.add_request(request("first", prompts[1], max_new_tokens=3 * BLOCK + 5, ignore_eos=True))
        first = drive(engine, {})
        keys = set(engine.blocks.cached_keys())
        follow = prompts[1] + first.tokens["first"] + prompts[0]
        engine.add_request(request("next", follow, max_new_tokens=4))
        second = drive(engine, {})
        return engine, first, second, keys

    plain, first, second, keys = one_then_follow_up(False)
    engine, ahead_first, ahead_second, ahead_keys = one_then_follow_up(True)
    assert engine.ahead.launches >= 3 * BLOCK
    assert ahead_first.tokens == first.tokens and ahead_second.tokens == second.tokens
    assert ahead_keys == keys and len(keys) >= (len(prompts[1]) + 3 * BLOCK) // BLOCK
    assert ahead_second.events[0].cached_tokens == second.events[0].cached_tokens >= len(keys) * BLOCK - BLOCK


def test_preemption_and_a_failed_step_while_a_step_is_ahead(tiny_model_dir):
    """Six blocks for four growing sequences: the scheduler preempts a sequence in flight (its token lands
    while it waits, and it is recomputed with it); then every request ends at once with a step in flight."""
    runner = graph_runner(tiny_model_dir, 6)
    reqs = lambda: {0: [request(f"r{i}", [100 + 37 * i + 5 * j for j in range(9)], max_new_tokens=22, ignore_eos=True)
                        for i in range(4)]}
    plain_engine = Engine(runner, limits(max_preempt_count=4), {EOS})
    plain = drive(plain_engine, reqs())
    engine = Engine(runner, limits(max_preempt_count=4), {EOS}, steps_ahead=True)
    ours = drive(engine, reqs())
    assert engine.scheduler.num_preemptions > 0 and engine.ahead.launches > 10
    assert ours.tokens == plain.tokens and all(len(t) == 22 for t in ours.tokens.values())
    positions_in_order(ours)

    for req in reqs()[0]:
        engine.add_request(req)
    while engine.ahead.flight is None:
        engine.step()
    ended = engine.fail_all("engine failure: test")
    assert {e.id for e in ended} == {f"r{i}" for i in range(4)} and engine.ahead.flight is None
    assert not engine.has_work and engine.blocks.num_free == runner.num_blocks
