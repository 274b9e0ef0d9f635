"""Prompt logprobs (OpenAI ``echo`` with ``logprobs``, TGI ``decoder_input_details``): the engine computes each
prompt token's log-probability under the model, and the most likely alternatives, as the prompt runs. They
equal transformers' own log-softmax of the same weights within 1e-4, whether the prompt runs whole or in
Mix chunks, beside other requests, or with a prefix cache that holds the prompt (a request asking for
prompt logprobs computes its whole prompt)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.engine import Engine
from tests.unit.engine_helpers import limits, prompt, request, run_until_idle

TOP = 3
IDS = prompt(45)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each prompt position."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().log_softmax(dim=-1)


def first_event(run, rid: str):
    return next(e for e in run.events if e.id == rid)


def rank_range(row: torch.Tensor, token: int, tolerance: float = 1e-4) -> tuple[int, int]:
    """vLLM's rank of ``token`` (1: the likeliest) as far as float noise decides it: a random model's logprobs are
    close enough together that the engine's and transformers' sums may order near-ties differently."""
    value = float(row[token])
    return int((row > value + tolerance).sum()) + 1, int((row > value - tolerance).sum()) + 1


def check(lps, reference: torch.Tensor) -> None:
    assert len(lps) == len(IDS) and lps[0] is None
    for position in range(1, len(IDS)):
        row = reference[position - 1]
        lp = lps[position]
        assert abs(lp.logprob - float(row[IDS[position]])) < 1e-4, position
        assert rank_range(row, IDS[position])[0] <= lp.rank <= rank_range(row, IDS[position])[1], position
        top = row.topk(TOP)
        assert lp.top_ids == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < 1e-4


@pytest.mark.parametrize("mix", [False, True], ids=["whole", "mix-chunks"])
def test_prompt_logprobs_equal_the_models_log_softmax(tiny_runner, reference, mix):
    kw = {"mix": True, "prefill_chunk_size": 16} if mix else {}
    engine = Engine(tiny_runner, limits(**kw), set())
    engine.add_request(request("other", prompt(30, start=700), max_new_tokens=6))  # shares the steps
    engine.add_request(request("a", IDS, max_new_tokens=3, prompt_logprobs=TOP))
    run = run_until_idle(engine)
    check(first_event(run, "a").prompt_logprobs, reference)
    assert all(not e.prompt_logprobs for e in run.events if e.id != "a" or e.position > 0)
    assert not first_event(run, "other").prompt_logprobs


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_runner, reference):
    engine = Engine(tiny_runner, limits(), set(), prefix_cache=True)
    engine.add_request(request("warm", IDS, max_new_tokens=2))
    run_until_idle(engine)
    engine.add_request(request("a", IDS, max_new_tokens=2, prompt_logprobs=TOP))
    run = run_until_idle(engine)
    check(first_event(run, "a").prompt_logprobs, reference)


def test_no_alternatives_when_none_are_asked(tiny_runner, reference):
    engine = Engine(tiny_runner, limits(), set())
    engine.add_request(request("a", IDS, max_new_tokens=1, prompt_logprobs=0))
    lps = first_event(run_until_idle(engine), "a").prompt_logprobs
    assert lps[1].top_ids == [] and abs(lps[1].logprob - float(reference[0][IDS[1]])) < 1e-4
