"""Engine.step() bookkeeping: KV blocks back in the pool, preemption, timeouts, priorities."""

from __future__ import annotations

import time

from services.engine.engine import Engine
from services.engine.sequence import Sequence
from shared.errors import ErrorKind
from tests.unit.engine_helpers import (
    BLOCK, Run, assert_pool_whole, greedy_reference, limits, prompt, request, run_until_idle,
)


# ---- (c) block accounting ---------------------------------------------------------------------


def test_blocks_return_after_length_and_eos(tiny_runner):
    first = greedy_reference(tiny_runner, [prompt(10)], 1)[0][0]
    engine = Engine(tiny_runner, limits(), {first})
    engine.add_request(request("eos", prompt(10), max_new_tokens=50))
    engine.add_request(request("len", prompt(40, start=7), max_new_tokens=5))
    run = run_until_idle(engine)
    assert run.reason("eos") == "eos_token"
    assert run.tokens["eos"] == [first]
    assert run.reason("len") == "length"
    assert len(run.tokens["len"]) == 5
    assert_pool_whole(engine)


def test_abort_mid_generation_returns_blocks(tiny_runner):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("keep", prompt(20), max_new_tokens=8))
    engine.add_request(request("stop", prompt(30, start=9), max_new_tokens=100))
    run = Run()
    for _ in range(3):
        run.record(engine.step())
    assert engine.blocks.num_free < tiny_runner.num_blocks
    engine.abort("stop")
    events = engine.step()
    run.record(events)
    cancelled = [e for e in events if e.id == "stop"]
    assert len(cancelled) == 1
    assert cancelled[0].finish_reason == "cancelled"
    assert cancelled[0].token_ids == []
    assert cancelled[0].error is None
    run = run_until_idle(engine, run)
    assert len(run.tokens["stop"]) == 3
    assert run.reason("keep") == "length" and len(run.tokens["keep"]) == 8
    assert_pool_whole(engine)


def test_abort_of_a_waiting_request_and_of_an_unknown_id(tiny_runner):
    engine = Engine(tiny_runner, limits(max_batch_size=1, max_prefill_batch_size=1), set())
    engine.add_request(request("running", prompt(5), max_new_tokens=4))
    engine.add_request(request("waiting", prompt(5), max_new_tokens=4))
    run = Run()
    run.record(engine.step())
    assert engine.num_running == 1 and engine.num_waiting == 1
    engine.abort("waiting")
    engine.abort("no-such-request")
    run = run_until_idle(engine, run)
    assert run.reason("waiting") == "cancelled"
    assert run.tokens["waiting"] == []
    assert "no-such-request" not in run.tokens
    assert run.reason("running") == "length"
    assert_pool_whole(engine)


def test_abort_after_finish_says_nothing(tiny_runner):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("done", prompt(5), max_new_tokens=2))
    run = run_until_idle(engine)
    engine.abort("done")
    assert engine.step() == []
    assert run.reason("done") == "length"
    assert_pool_whole(engine)


def test_past_deadline_ends_with_a_timeout_error(tiny_runner):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("late", prompt(10), deadline=time.time() - 1, max_new_tokens=10))
    engine.add_request(request("fine", prompt(10), deadline=time.time() + 600, max_new_tokens=3))
    run = run_until_idle(engine)
    late = run.finish["late"]
    assert late.finish_reason == "error"
    assert late.token_ids == [] and run.tokens["late"] == []
    assert late.error is not None and late.error.kind is ErrorKind.TIMEOUT
    assert run.reason("fine") == "length"
    assert_pool_whole(engine)


def test_deadline_passing_mid_generation_frees_blocks(tiny_runner):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("soon", prompt(25), deadline=time.time() + 3600, max_new_tokens=100))
    run = Run()
    for _ in range(3):
        run.record(engine.step())
    engine.seqs["soon"].deadline = time.time() - 0.001  # the deadline passes
    run = run_until_idle(engine, run)
    assert run.finish["soon"].finish_reason == "error"
    assert run.finish["soon"].error.kind is ErrorKind.TIMEOUT
    assert len(run.tokens["soon"]) == 3
    assert_pool_whole(engine)


def test_preemption_completes_every_request_and_returns_blocks(small_pool_runner, tiny_runner):
    """6 blocks of 16; three 20-token prompts growing to 60 tokens (4 blocks each) must take turns."""
    prompts = [prompt(20, start=10 + 40 * i) for i in range(3)]
    expected = greedy_reference(tiny_runner, prompts, 40)
    engine = Engine(small_pool_runner, limits(max_preempt_count=2), set())
    for i, ids in enumerate(prompts):
        engine.add_request(request(f"p{i}", ids, max_new_tokens=40))
    run = Run()
    run.record(engine.step())
    seqs: list[Sequence] = list(engine.seqs.values())
    run = run_until_idle(engine, run)
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was big enough: nothing was preempted"
    for i in range(3):
        assert run.reason(f"p{i}") == "length"
        assert len(run.tokens[f"p{i}"]) == 40
        # recomputing a preempted sequence's cache does not change its greedy tokens
        assert run.tokens[f"p{i}"] == expected[i]
    assert_pool_whole(engine)


def test_without_preemption_requests_wait_for_reserved_blocks(small_pool_runner):
    """maxPreemptCount 0: admission reserves whole sequences, so the rest waits instead of preempting."""
    engine = Engine(small_pool_runner, limits(max_preempt_count=0), set())
    for i in range(3):
        engine.add_request(request(f"p{i}", prompt(20, start=10 + 40 * i), max_new_tokens=40, ignore_eos=True))
    run = Run()
    run.record(engine.step())
    seqs: list[Sequence] = list(engine.seqs.values())
    assert engine.num_running == 1  # 60 tokens = 4 of the 6 blocks
    run = run_until_idle(engine, run)
    assert all(s.num_preemptions == 0 for s in seqs)
    assert all(len(run.tokens[f"p{i}"]) == 40 for i in range(3))
    assert_pool_whole(engine)


def test_prompt_larger_than_the_pool_is_refused(small_pool_runner):
    engine = Engine(small_pool_runner, limits(), set())
    engine.add_request(request("huge", prompt(6 * BLOCK), max_new_tokens=1))
    run = run_until_idle(engine)
    assert run.finish["huge"].finish_reason == "error"
    assert run.finish["huge"].error.kind is ErrorKind.GENERATION
    assert_pool_whole(engine)


def test_request_whose_reservation_exceeds_the_pool_does_not_wait_forever(small_pool_runner):
    engine = Engine(small_pool_runner, limits(max_preempt_count=0), set())
    engine.add_request(request("big", prompt(20), max_new_tokens=100))  # 120 tokens = 8 blocks > 6
    run = run_until_idle(engine, max_steps=200)
    assert run.finish["big"].error.kind is ErrorKind.GENERATION
    assert_pool_whole(engine)


def test_sequence_outgrowing_the_pool_with_preemption_does_not_wait_forever(small_pool_runner):
    engine = Engine(small_pool_runner, limits(max_preempt_count=1), set())
    engine.add_request(request("big", prompt(20), max_new_tokens=100))
    run = run_until_idle(engine, max_steps=200)
    assert "big" in run.finish
    assert_pool_whole(engine)


def test_fail_all_ends_everything_with_internal_errors(tiny_runner):
    engine = Engine(tiny_runner, limits(max_batch_size=2, max_prefill_batch_size=2), set())
    for i in range(4):
        engine.add_request(request(f"r{i}", prompt(10), max_new_tokens=50))
    run = Run()
    run.record(engine.step())
    events = engine.fail_all("boom")
    run.record(events)
    assert sorted(e.id for e in events) == ["r0", "r1", "r2", "r3"]
    assert all(e.finish_reason == "error" and e.error.kind is ErrorKind.INTERNAL for e in events)
    assert not engine.has_work
    assert_pool_whole(engine)


# ---- (d) priorities ---------------------------------------------------------------------------


def test_priority_orders_admission(tiny_runner):
    engine = Engine(tiny_runner, limits(max_batch_size=1, max_prefill_batch_size=1), set())
    for priority in (5, 1, 3):
        engine.add_request(request(f"prio{priority}", prompt(6), priority=priority, max_new_tokens=3))
    run = run_until_idle(engine)
    first_seen: list[str] = []
    for event in run.events:
        if event.token_ids and event.id not in first_seen:
            first_seen.append(event.id)
    assert first_seen == ["prio1", "prio3", "prio5"]
    # max_batch_size 1: each runs to the end before the next starts
    order = [e.id for e in run.events]
    assert order == ["prio1"] * 3 + ["prio3"] * 3 + ["prio5"] * 3
    assert_pool_whole(engine)


def test_same_priority_is_first_come_first_served(tiny_runner):
    engine = Engine(tiny_runner, limits(max_batch_size=1, max_prefill_batch_size=1), set())
    for name in ("a", "b", "c"):
        engine.add_request(request(name, prompt(6), max_new_tokens=1))
    run = run_until_idle(engine)
    assert [e.id for e in run.events] == ["a", "b", "c"]


def test_prefill_respects_prefill_batch_and_token_limits(tiny_runner):
    engine = Engine(tiny_runner, limits(max_batch_size=8, max_prefill_batch_size=2, max_prefill_tokens=4096), set())
    for i in range(5):
        engine.add_request(request(f"r{i}", prompt(10), max_new_tokens=4))
    assert len(engine.step()) == 2
    assert engine.num_running == 2

    engine = Engine(tiny_runner, limits(max_batch_size=8, max_prefill_batch_size=8, max_prefill_tokens=25), set())
    for i in range(5):
        engine.add_request(request(f"r{i}", prompt(10), max_new_tokens=4))
    assert len(engine.step()) == 2  # 10 + 10 <= 25 < 30
    run = run_until_idle(engine)
    assert len(run.finish) == 5


def test_idle_engine_holds_a_small_first_batch_for_max_queue_delay(tiny_runner):
    engine = Engine(tiny_runner, limits(max_prefill_batch_size=3, max_queue_delay_s=0.2), set())
    engine.add_request(request("a", prompt(6), max_new_tokens=2))
    before = time.time()
    assert engine.step() == [] and engine.num_running == 0  # held: one prompt, a batch holds three
    assert before < engine.held_until <= before + 0.2 + 0.05
    engine.add_request(request("b", prompt(6), max_new_tokens=2))
    engine.add_request(request("c", prompt(6), max_new_tokens=2))
    assert len(engine.step()) == 3 and engine.held_until is None  # full batch: launched at once
    engine.add_request(request("d", prompt(6), max_new_tokens=4))
    assert [e.id for e in engine.step()] == ["d"]  # something runs: no holding
    run_until_idle(engine)
    assert_pool_whole(engine)


def test_held_batch_launches_when_the_delay_is_over(tiny_runner):
    engine = Engine(tiny_runner, limits(max_prefill_batch_size=8, max_queue_delay_s=0.05), set())
    engine.add_request(request("a", prompt(6), max_new_tokens=2))
    assert engine.step() == []
    time.sleep(0.06)
    assert [e.id for e in engine.step()] == ["a"]
    run_until_idle(engine)
    assert_pool_whole(engine)
