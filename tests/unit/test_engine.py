"""services/engine: Engine.step() driven directly, no NATS.

SmolLM2 checks greedy output against transformers' generate; the tiny random model checks seeds,
block accounting, preemption, priorities and finish reasons quickly.
"""

from __future__ import annotations

import time

import pytest
import torch

from services.engine.devices import resolve_device
from services.engine.engine import Engine, Limits
from services.engine.model_runner import ModelRunner
from services.engine.sequence import Sequence
from shared.errors import ErrorKind
from shared.messages import EngineRequest, Sampling, TokenEvent

BLOCK = 16
CPU = resolve_device("cpu", "float32")


# ---- helpers ----------------------------------------------------------------------------------


def block_bytes(path) -> int:
    """K and V, every layer, one block of float32."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * 4


def make_runner(path, num_blocks: int) -> ModelRunner:
    """A runner whose KV budget holds ``num_blocks`` blocks (and a bit more, less than one block)."""
    budget = num_blocks * block_bytes(path) + block_bytes(path) // 2
    runner = ModelRunner(str(path), CPU, block_size=BLOCK, kv_budget_bytes=budget, max_blocks=10_000)
    assert runner.num_blocks == num_blocks
    assert runner.block_bytes == block_bytes(path)
    return runner


def limits(max_batch_size=8, max_prefill_batch_size=8, max_prefill_tokens=4096, max_seq_len=2048, **kw) -> Limits:
    return Limits(max_batch_size, max_prefill_batch_size, max_prefill_tokens, max_seq_len, **kw)


def request(rid: str, prompt_ids: list[int], priority: int = 3, deadline: float | None = None,
            **sampling) -> EngineRequest:
    sampling.setdefault("do_sample", False)
    return EngineRequest(id=rid, prompt_ids=prompt_ids, sampling=Sampling(**sampling), reply_to="x",
                         priority=priority, deadline=deadline)


def prompt(n: int, start: int = 100) -> list[int]:
    return [start + (7 * i) % 500 for i in range(n)]


class Run:
    """Everything the engine said, per request."""

    def __init__(self):
        self.events: list[TokenEvent] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, TokenEvent] = {}
        self.steps = 0

    def record(self, events: list[TokenEvent]) -> None:
        for event in events:
            assert event.id not in self.finish, f"event for {event.id} after it finished"
            self.events.append(event)
            self.tokens.setdefault(event.id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                self.finish[event.id] = event

    def reason(self, rid: str) -> str | None:
        return self.finish[rid].finish_reason if rid in self.finish else None


def run_until_idle(engine: Engine, run: Run | None = None, max_steps: int = 1000) -> Run:
    run = run or Run()
    while engine.has_work:
        run.record(engine.step())
        run.steps += 1
        assert run.steps <= max_steps, "the engine made no progress"
    return run


def assert_pool_whole(engine: Engine) -> None:
    assert engine.blocks.num_free == engine.runner.num_blocks
    assert sorted(engine.blocks.free_blocks) == list(range(engine.runner.num_blocks))
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.seqs


# ---- (a) SmolLM2 greedy equals transformers' generate -----------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a long story about a dragon who lived in the mountains and guarded a treasure of gold "
    "and jewels for a thousand years. One day,",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smol_runner(smol_dir):
    return make_runner(smol_dir, num_blocks=32)


@pytest.fixture(scope="module")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def hf_greedy(smol_dir, smol_tokenizer):
    """transformers' greedy generate for each prompt alone: (new token ids, logits per position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = torch.tensor([smol_tokenizer(text).input_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=2, eos_token_id=2,
                                 return_dict_in_generate=True, output_logits=True)
            new = out.sequences[0, ids.shape[1]:].tolist()
            logits = torch.stack(out.logits)[:, 0].float()
            results.append((new, logits))
    del model
    return results


def check_greedy_close(ours: list[int], theirs: list[int], their_logits: torch.Tensor, name: str,
                       max_gap: float = 1e-3) -> None:
    """vLLM's check_logprobs_close for greedy: equal until the first difference, which must be a near-tie.

    At the first position where the outputs differ, our token must be one of the reference's top-2 and
    the reference's top-2 log-probabilities must be within ``max_gap``; later tokens then follow other
    contexts and are not compared.
    """
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        logprobs = their_logits[position].log_softmax(-1)
        top2 = logprobs.topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert a in top2.indices.tolist(), f"{name}: position {position}: {a} is not in the reference's top-2"
        assert gap < max_gap, f"{name}: position {position}: {a} != {b} and the top-2 gap is {gap:.5f}"
        return
    assert len(ours) == len(theirs), f"{name}: {len(ours)} tokens vs {len(theirs)}"


def test_batched_greedy_matches_hf_generate(smol_runner, smol_tokenizer, hf_greedy):
    engine = Engine(smol_runner, limits(), {2})
    prompts = [smol_tokenizer(text).input_ids for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    for i, ids in enumerate(prompts):
        engine.add_request(request(f"r{i}", ids, max_new_tokens=NEW_TOKENS))
    # all four are prefilled together in the first step, then decode together
    first = engine.step()
    assert sorted(e.id for e in first) == [f"r{i}" for i in range(len(PROMPTS))]
    assert engine.num_running == len(PROMPTS)
    run = Run()
    run.record(first)
    run = run_until_idle(engine, run)
    assert run.steps <= NEW_TOKENS
    for i, (theirs, logits) in enumerate(hf_greedy):
        check_greedy_close(run.tokens[f"r{i}"], theirs, logits, PROMPTS[i][:20])
        assert run.reason(f"r{i}") == ("eos_token" if theirs[-1] == 2 else "length")
    assert_pool_whole(engine)


def test_check_greedy_close_rejects_a_clear_difference():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 0.0]])
    check_greedy_close([0, 1], [0, 1], logits, "same")
    with pytest.raises(AssertionError):
        check_greedy_close([1, 1], [0, 1], logits, "different")
    tie = torch.tensor([[2.0, 2.0 - 1e-5, 0.0]])
    check_greedy_close([1], [0], tie, "near tie")


# ---- the tiny random model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_blocks=64)


@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_blocks=6)


def greedy_reference(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt generated alone, ignoring EOS."""
    out = []
    for ids in prompts:
        engine = Engine(runner, limits(), set())
        engine.add_request(request("g", ids, max_new_tokens=new_tokens))
        out.append(run_until_idle(engine).tokens["g"])
    return out


SEEDED = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=16, ignore_eos=True)


def test_seeded_sampling_is_independent_of_the_batch(tiny_runner):
    alone = Engine(tiny_runner, limits(), {2})
    alone.add_request(request("me", prompt(9), seed=1234, **SEEDED))
    expected = run_until_idle(alone).tokens["me"]
    assert len(expected) == 16

    batch = Engine(tiny_runner, limits(max_batch_size=16, max_prefill_batch_size=16), {2})
    for i in range(4):
        batch.add_request(request(f"s{i}", prompt(5 + 3 * i, start=200 + i), seed=i,
                                  **{**SEEDED, "temperature": 1.2}))
    batch.add_request(request("me", prompt(9), seed=1234, **SEEDED))
    for i in range(4):
        batch.add_request(request(f"g{i}", prompt(12 + i, start=300), max_new_tokens=10 + i, ignore_eos=True))
    run = run_until_idle(batch)
    assert len(run.finish) == 9
    assert run.tokens["me"] == expected
    assert_pool_whole(batch)


def test_seeded_sampling_is_independent_of_arrival_time(tiny_runner):
    """Joining a batch that is already decoding does not change a seeded request's tokens."""
    alone = Engine(tiny_runner, limits(), {2})
    alone.add_request(request("me", prompt(9), seed=1234, **SEEDED))
    expected = run_until_idle(alone).tokens["me"]

    engine = Engine(tiny_runner, limits(), {2})
    for i in range(3):
        engine.add_request(request(f"early{i}", prompt(20, start=400 + i), seed=i, **SEEDED))
    run = Run()
    for _ in range(5):
        run.record(engine.step())
    engine.add_request(request("me", prompt(9), seed=1234, **SEEDED))
    run = run_until_idle(engine, run)
    assert run.tokens["me"] == expected


def test_different_seeds_give_different_tokens(tiny_runner):
    engine = Engine(tiny_runner, limits(), {2})
    for seed in (1, 2, 3):
        engine.add_request(request(f"seed{seed}", prompt(9), seed=seed, **SEEDED))
    engine.add_request(request("again1", prompt(9), seed=1, **SEEDED))
    run = run_until_idle(engine)
    outputs = [run.tokens[f"seed{s}"] for s in (1, 2, 3)]
    assert outputs[0] != outputs[1] and outputs[0] != outputs[2] and outputs[1] != outputs[2]
    assert run.tokens["again1"] == outputs[0]  # same seed, same prompt, same tokens


def test_greedy_is_independent_of_the_batch(tiny_runner):
    prompts = [prompt(n, start=50 + n) for n in (3, 17, 33, 8)]
    expected = greedy_reference(tiny_runner, prompts, 10)
    engine = Engine(tiny_runner, limits(), set())
    for i, ids in enumerate(prompts):
        engine.add_request(request(f"r{i}", ids, max_new_tokens=10))
    run = run_until_idle(engine)
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == expected


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


# ---- (e) max_new_tokens, max_seq_len, ignore_eos ----------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_ends_with_length(tiny_runner, max_new_tokens):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("r", prompt(10), max_new_tokens=max_new_tokens))
    run = run_until_idle(engine)
    assert len(run.tokens["r"]) == max_new_tokens
    assert run.reason("r") == "length"
    assert [e.finish_reason for e in run.events] == [None] * (max_new_tokens - 1) + ["length"]


def test_max_seq_len_ends_with_length(tiny_runner):
    engine = Engine(tiny_runner, limits(max_seq_len=14), set())
    engine.add_request(request("r", prompt(10), max_new_tokens=100))
    run = run_until_idle(engine)
    assert run.reason("r") == "length"
    assert len(run.tokens["r"]) == 4  # 10 + 4 = max_seq_len
    assert_pool_whole(engine)


def test_eos_ends_unless_ignore_eos(tiny_runner):
    reference = greedy_reference(tiny_runner, [prompt(10)], 6)[0]
    eos = reference[2]
    engine = Engine(tiny_runner, limits(), {eos})
    engine.add_request(request("stops", prompt(10), max_new_tokens=6))
    engine.add_request(request("ignores", prompt(10), max_new_tokens=6, ignore_eos=True))
    run = run_until_idle(engine)
    stop_at = reference.index(eos) + 1
    assert run.tokens["stops"] == reference[:stop_at]
    assert run.reason("stops") == "eos_token"
    assert run.tokens["ignores"] == reference
    assert run.reason("ignores") == "length"
    assert_pool_whole(engine)
