"""One request never harms another: a step that raises ends only the requests that make it raise.

The tiny random model; each healthy request is compared with the same request run alone.
"""

from __future__ import annotations

import logging

import pytest

from services.engine.engine import Engine
from services.engine.isolation import run_isolated
from shared.errors import ErrorKind
from shared.messages import EngineRequest, Sampling
from tests.unit.engine_helpers import Run, assert_pool_whole, limits, prompt, request, run_until_idle

FLT_MAX = 3.4028234663852886e38
NEW_TOKENS = 8
SEEDED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=4321)
NAN = float("nan")


def healthy() -> list[EngineRequest]:
    """Greedy and seeded requests of different lengths."""
    return [
        request("greedy-a", prompt(7, start=120), max_new_tokens=NEW_TOKENS, ignore_eos=True),
        request("seeded-a", prompt(11, start=310), max_new_tokens=NEW_TOKENS, ignore_eos=True, **SEEDED),
        request("greedy-b", prompt(23, start=40), max_new_tokens=NEW_TOKENS + 3, ignore_eos=True),
        request("seeded-b", prompt(5, start=900), max_new_tokens=NEW_TOKENS, ignore_eos=True,
                **{**SEEDED, "seed": 7}),
    ]


@pytest.fixture(scope="module")
def solo(tiny_runner) -> dict[str, list[int]]:
    """Each healthy request's tokens when it runs alone."""
    out = {}
    for req in healthy():
        engine = Engine(tiny_runner, limits(), {2})
        engine.add_request(req)
        out[req.id] = run_until_idle(engine).tokens[req.id]
    return out


def run_with(tiny_runner, poisons: list[EngineRequest]) -> tuple[Engine, Run]:
    engine = Engine(tiny_runner, limits(), {2})
    requests = healthy()
    for i, poison in enumerate(poisons):
        requests.insert(1 + 2 * i, poison)
    for req in requests:
        engine.add_request(req)
    return engine, run_until_idle(engine)


def assert_isolated(engine: Engine, run: Run, solo: dict[str, list[int]], poisoned: list[str], words: str) -> None:
    for rid in poisoned:
        event = run.finish[rid]
        assert event.finish_reason == "error" and event.error.kind is ErrorKind.INTERNAL
        assert event.error.message.startswith("engine failure for this request: ")
        assert words in event.error.message
        assert run.tokens[rid] == []
    for rid, tokens in solo.items():
        assert run.tokens[rid] == tokens, rid
        assert run.reason(rid) == "length"
    assert_pool_whole(engine)


# ---- a poisoned request beside healthy ones ---------------------------------------------------


def test_a_nan_temperature_ends_only_its_own_request(tiny_runner, solo, caplog):
    poison = request("poison", prompt(9), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=NAN)
    with caplog.at_level(logging.WARNING, logger="switchboard.engine"):
        engine, run = run_with(tiny_runner, [poison])
    assert_isolated(engine, run, solo, ["poison"], "temperature is NaN")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.request_id for r in warnings] == ["poison"]
    assert warnings[0].phase == "prefill"


def test_a_prompt_id_outside_the_vocabulary_ends_only_its_own_request(tiny_runner, solo):
    vocab = tiny_runner.vocab_size
    poison = request("poison", prompt(6) + [vocab + 5], max_new_tokens=NEW_TOKENS)
    engine, run = run_with(tiny_runner, [poison])
    assert_isolated(engine, run, solo, ["poison"], f"token id {vocab + 5} is outside")


def test_several_poisons_in_one_batch_are_all_found(tiny_runner, solo):
    vocab = tiny_runner.vocab_size
    poisons = [request("bad-id", [vocab], max_new_tokens=4),
               request("bad-temp", prompt(4), max_new_tokens=4, do_sample=True, temperature=NAN),
               request("bad-penalty", prompt(4), max_new_tokens=4, repetition_penalty=-1.0)]
    engine, run = run_with(tiny_runner, poisons)
    assert_isolated(engine, run, solo, ["bad-id", "bad-temp", "bad-penalty"], "")


def test_a_request_failing_in_decode_ends_alone_and_the_rest_decode_on(tiny_runner, solo, caplog):
    engine = Engine(tiny_runner, limits(), {2})
    for req in healthy():
        engine.add_request(req)
    engine.add_request(request("poison", prompt(9), max_new_tokens=NEW_TOKENS))
    run = Run()
    for _ in range(3):  # prefill and two decode steps
        run.record(engine.step())
    assert "poison" not in run.finish and len(run.tokens["poison"]) == 3
    engine.seqs["poison"].sampling = Sampling(do_sample=True, top_p=NAN, max_new_tokens=NEW_TOKENS)
    with caplog.at_level(logging.WARNING, logger="switchboard.engine"):
        run = run_until_idle(engine, run)
    assert run.finish["poison"].error.kind is ErrorKind.INTERNAL
    assert len(run.tokens["poison"]) == 3
    assert [r.phase for r in caplog.records if r.levelno == logging.WARNING] == ["decode"]
    for rid, tokens in solo.items():
        assert run.tokens[rid] == tokens, rid
    assert_pool_whole(engine)


def test_bisection_runs_parts_and_keeps_batch_order():
    class Seq:
        def __init__(self, name):
            self.id = name

    seqs = [Seq(n) for n in "abcdefgh"]
    calls = []

    def fn(part):
        calls.append("".join(s.id for s in part))
        if any(s.id in "cf" for s in part):
            raise RuntimeError("boom")
        return [s.id.upper() for s in part]

    outcome = run_isolated(fn, seqs)
    assert [(s.id, r) for s, r in outcome.results] == [(n, n.upper()) for n in "abdegh"]
    assert [(s.id, str(e)) for s, e in outcome.failures] == [("c", "boom"), ("f", "boom")]
    assert calls == ["abcdefgh", "abcd", "ab", "cd", "c", "d", "efgh", "ef", "e", "f", "gh"]
    calls.clear()
    assert run_isolated(fn, seqs[:2]).failures == [] and calls == ["ab"]  # the healthy case runs once


# ---- numerically safe sampling at every value a family accepts --------------------------------


@pytest.mark.parametrize("temperature", [1e-300, 1e-6])
def test_a_temperature_below_eps_gives_the_greedy_tokens(tiny_runner, temperature):
    engine = Engine(tiny_runner, limits(), {2})
    engine.add_request(request("greedy", prompt(8), max_new_tokens=6, ignore_eos=True))
    engine.add_request(request("tiny", prompt(8), max_new_tokens=6, ignore_eos=True, do_sample=True,
                               temperature=temperature, seed=3))
    engine.add_request(request("tiny-warpers", prompt(8), max_new_tokens=6, ignore_eos=True, do_sample=None,
                               temperature=temperature, top_k=10, top_p=0.5))
    run = run_until_idle(engine)
    assert run.tokens["tiny"] == run.tokens["tiny-warpers"] == run.tokens["greedy"]
    assert len(run.tokens["greedy"]) == 6


EXTREMES = [
    dict(repetition_penalty=FLT_MAX), dict(repetition_penalty=1e-300), dict(temperature=FLT_MAX),
    dict(top_p=1e-300), dict(typical_p=1e-300), dict(top_k=2**31 - 1),
    dict(presence_penalty=2.0, frequency_penalty=2.0), dict(presence_penalty=-2.0, frequency_penalty=-2.0),
    dict(repetition_penalty=FLT_MAX, temperature=FLT_MAX, top_p=1e-300, typical_p=1e-300, top_k=2**31 - 1),
]


@pytest.mark.parametrize("params", EXTREMES, ids=lambda p: ",".join(f"{k}={v:g}" for k, v in p.items()))
def test_extreme_accepted_values_give_tokens(tiny_runner, params):
    engine = Engine(tiny_runner, limits(), {2})
    engine.add_request(request("sampled", prompt(8), max_new_tokens=5, ignore_eos=True, do_sample=True, seed=1,
                               **params))
    engine.add_request(request("greedy", prompt(8), max_new_tokens=5, ignore_eos=True, **params))
    run = run_until_idle(engine)
    for rid in ("sampled", "greedy"):
        assert run.reason(rid) == "length", run.finish[rid].error
        assert len(run.tokens[rid]) == 5
        assert all(0 <= t < tiny_runner.vocab_size for t in run.tokens[rid])
    assert_pool_whole(engine)
