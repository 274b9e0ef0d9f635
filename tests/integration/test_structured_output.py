"""Structured output through the whole stack with the real default model (SmolLM2-135M-Instruct), from the
clients users run: the ``openai`` client's ``response_format`` (``json_schema`` and ``json_object``, stream
and not) and ``text-generation``'s ``grammar`` (JSON and regex). Sampling at temperature 0.9 over several
seeds, every answer validates against its schema (matches its regex)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.integration.test_openai_api import client

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                           "maxItems": 3}},
    "required": ["name", "age", "city", "pets"], "additionalProperties": False}
ASK = "Describe a person called Anna who lives in Paris, as JSON."
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_openai_json_schema_always_validates(smol_stack, seed):
    done = client(smol_stack).chat.completions.create(
        model=smol_stack.model, messages=[{"role": "user", "content": ASK}], temperature=0.9, seed=seed,
        max_tokens=160, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                "strict": True}})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)


def test_openai_json_object_streams_valid_json(smol_stack):
    chunks = client(smol_stack).chat.completions.create(
        model=smol_stack.model, messages=[{"role": "user", "content": ASK}], temperature=0.9, seed=4,
        max_tokens=200, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_take_response_format_too(smol_stack):
    done = client(smol_stack).completions.create(
        model=smol_stack.model, prompt="Anna, 31, Paris. As JSON: ", temperature=0.9, seed=5, max_tokens=160,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


@pytest.mark.parametrize("seed", [6, 7])
def test_tgi_json_grammar_always_validates(smol_stack, seed):
    tgi = Client(smol_stack.url, timeout=120)
    out = tgi.generate(ASK, max_new_tokens=160, do_sample=True, temperature=0.9, seed=seed,
                       grammar=Grammar(type=GrammarType.Json, value=PERSON))
    jsonschema.validate(json.loads(out.generated_text), PERSON)


def test_tgi_regex_grammar_matches(smol_stack):
    tgi = Client(smol_stack.url, timeout=120)
    out = tgi.generate("Call me at ", max_new_tokens=30, do_sample=True, temperature=0.9, seed=8,
                       grammar=Grammar(type=GrammarType.Regex, value=PHONE))
    assert re.fullmatch(PHONE, out.generated_text), out.generated_text
