"""Structured output in the engine's batched step (``services/engine/grammar.py``): a constrained request's
every sampled token keeps its text within the grammar, even from a random-weight model sampling at
temperature 1; constrained and free requests in one batch each equal their solo runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from services.engine.engine import Engine
from shared.grammar import json_schema
from shared.messages import Grammar
from tests.unit.engine_helpers import limits, prompt, request, run_until_idle

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "ok": {"type": "boolean"},
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["id", "kind", "ok", "name", "tags"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(runner, reqs, **kw):
    engine = Engine(runner, limits(**kw), {2})
    for req in reqs:
        engine.add_request(req)
    return run_until_idle(engine)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_json_schema_always_validates_when_sampling(tiny_runner, tokenizer, seed):
    req = request("j", prompt(12), max_new_tokens=120, do_sample=True, temperature=1.0, seed=seed,
                  grammar=json_schema(SCHEMA))
    result = run(tiny_runner, [req])
    assert result.reason("j") == "eos_token"  # the grammar ended it, not max_new_tokens
    text = tokenizer.decode(result.tokens["j"][:-1])
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", [7, 8])
def test_a_regex_matches_whole(tiny_runner, tokenizer, seed):
    req = request("r", prompt(9), max_new_tokens=40, do_sample=True, temperature=1.0, seed=seed,
                  grammar=Grammar("regex", PHONE))
    result = run(tiny_runner, [req])
    assert re.fullmatch(PHONE, tokenizer.decode(result.tokens["r"][:-1]))


def test_constrained_and_free_requests_in_one_batch_equal_their_solo_runs(tiny_runner):
    free = request("free", prompt(20, start=300), max_new_tokens=24, logprobs=2, ignore_eos=True)
    constrained = request("json", prompt(15), max_new_tokens=80, do_sample=True, seed=11, logprobs=2,
                          grammar=json_schema(SCHEMA))
    together = run(tiny_runner, [free, constrained], mix=True, prefill_chunk_size=8)
    alone = {r.id: run(tiny_runner, [r]) for r in (free, constrained)}
    for rid in ("free", "json"):
        assert together.tokens[rid] == alone[rid].tokens[rid]
        ours = [lp.logprob for e in together.events if e.id == rid for lp in e.logprobs]
        theirs = [lp.logprob for e in alone[rid].events if e.id == rid for lp in e.logprobs]
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_a_resumed_request_continues_within_its_grammar(tiny_runner, tokenizer):
    first = run(tiny_runner, [request("j", prompt(12), max_new_tokens=120, grammar=json_schema(SCHEMA))])
    tokens = first.tokens["j"]
    resumed = request("j2", prompt(12), max_new_tokens=120, grammar=json_schema(SCHEMA))
    resumed.generated_ids = tokens[:5]  # what a resumed (or handed-over) request carries
    again = run(tiny_runner, [resumed])
    assert tokens[:5] + again.tokens["j2"] == tokens


def test_tokens_outside_the_grammar_end_a_resumed_request_with_an_error(tiny_runner):
    req = request("bad", prompt(12), max_new_tokens=10, grammar=Grammar("regex", PHONE))
    req.generated_ids = [prompt(1, start=900)[0]]  # not a digit
    result = run(tiny_runner, [req])
    assert result.reason("bad") == "error" and "grammar" in result.finish["bad"].error.message


def test_a_refused_one_of_points_to_any_of_not_to_an_option_no_api_has():
    from shared.grammar import problem

    why = problem(json_schema({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                                         {"type": "object", "properties": {"b": {"type": "integer"}}}]}))
    assert "Use anyOf instead" in why and "coerce_one_of" not in why
