"""Engine.step() outputs: greedy parity with HF generate (SmolLM2), seeds, finish reasons."""

from __future__ import annotations


import pytest
import torch

from services.engine.engine import Engine
from tests.unit.engine_helpers import (
    Run, assert_pool_whole, greedy_reference, limits, make_runner, prompt, request, run_until_idle,
)


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


def test_stop_token_ids_end_like_eos(tiny_runner):
    reference = greedy_reference(tiny_runner, [prompt(10)], 6)[0]
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("r", prompt(10), max_new_tokens=6, stop_token_ids=[reference[3]]))
    run = run_until_idle(engine)
    assert run.tokens["r"] == reference[: reference.index(reference[3]) + 1]
    assert run.reason("r") == "eos_token"
    assert_pool_whole(engine)


def test_stop_token_ids_end_it_with_ignore_eos_too(tiny_runner):
    """ignore_eos skips the model's EOS only (vLLM's check_stop): the client's stop ids still end the request."""
    reference = greedy_reference(tiny_runner, [prompt(10)], 6)[0]
    engine = Engine(tiny_runner, limits(), {reference[3]})  # the model's EOS is ignored ...
    engine.add_request(request("eos", prompt(10), max_new_tokens=6, ignore_eos=True))
    engine.add_request(request("stop", prompt(10), max_new_tokens=6, ignore_eos=True, stop_token_ids=[reference[2]]))
    run = run_until_idle(engine)
    assert run.tokens["eos"] == reference and run.reason("eos") == "length"
    assert run.tokens["stop"] == reference[: reference.index(reference[2]) + 1]  # ... a stop id is not
    assert run.reason("stop") == "eos_token"
    assert_pool_whole(engine)


def test_min_tokens_holds_back_eos_and_stop_ids_until_then(tiny_runner):
    """vLLM's min_tokens: before it, the model's EOS and the request's stop ids are not sampled (the draw takes the
    next token its seed ranks first); from it on they end the request as usual."""
    drawn = dict(do_sample=True, temperature=1.0, seed=7)
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("ref", prompt(10), max_new_tokens=8, **drawn))
    reference = run_until_idle(engine).tokens["ref"]
    k = next(k for k in range(1, 4) if reference[k] not in reference[:k])  # the first new token after the first
    ends = reference[k]
    engine = Engine(tiny_runner, limits(), {ends})
    engine.add_request(request("free", prompt(10), max_new_tokens=8, **drawn))
    engine.add_request(request("held", prompt(10), max_new_tokens=8, min_tokens=5, **drawn))
    engine.add_request(request("stop", prompt(10), max_new_tokens=8, min_tokens=5, ignore_eos=True,
                               stop_token_ids=[ends], **drawn))
    run = run_until_idle(engine)
    assert run.tokens["free"] == reference[:k + 1] and run.reason("free") == "eos_token"
    for name in ("held", "stop"):
        tokens = run.tokens[name]
        assert tokens[:k] == reference[:k] and ends not in tokens[:5] and len(tokens) >= 5, (name, tokens, k)
    assert_pool_whole(engine)


def test_logprobs_ride_on_token_events(tiny_runner):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("lp", prompt(10), max_new_tokens=3, logprobs=2))
    engine.add_request(request("plain", prompt(10), max_new_tokens=3))
    events = []
    while engine.has_work:
        events += engine.step()
    with_lp = [e for e in events if e.id == "lp"]
    assert all(len(e.logprobs) == 1 and len(e.logprobs[0].top_ids) == 2 for e in with_lp)
    assert all(e.logprobs[0].top_ids[0] == e.token_ids[0] for e in with_lp)  # greedy picks the top one
    assert all(not e.logprobs for e in events if e.id == "plain")
