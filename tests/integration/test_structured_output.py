"""Structured output through the whole stack with the real default model (SmolLM2-135M-Instruct), from the
clients users run: the ``openai`` client's ``response_format`` (``json_schema`` and ``json_object``, stream
and not) and ``text-generation``'s ``grammar`` (JSON and regex). Sampling at temperature 0.9 over several
seeds, every answer validates against its schema (matches its regex). A grammar the grammar engine gives up on
while it follows it is a 4xx naming its field; a large one is built off the gateway's loop and the engine's step."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.integration.stack import post
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


def test_a_grammar_the_engine_gives_up_on_is_a_4xx_naming_its_field(smol_stack):
    """These compile, but llguidance stops at one of its limits once it follows them (they were 500s with
    its parser's state dump)."""
    itself = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # requires itself
    for field, body in (("guided_regex", {"guided_regex": "a{1000000}"}),
                        ("response_format.json_schema.schema", {"response_format": {
                            "type": "json_schema", "json_schema": {"name": "loop", "schema": itself}}})):
        r = post(smol_stack, "/v1/completions", {"model": smol_stack.model, "prompt": "x", "max_tokens": 20, **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
        assert "is too complex for the grammar engine to follow" in error["message"] and "<state>" not in r.text
    r = post(smol_stack, "/generate", {"inputs": "x", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": "a{1000000}"}}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert "grammar is too complex" in r.json()["error"]


def test_a_large_grammar_holds_neither_the_gateway_nor_running_streams(smol_stack):
    """A Lark grammar of 50,000 alternatives takes about 3 s to check and as long to build: on the gateway's
    loop (other requests waited, and its engine leases ran out: 503s) and on the engine's step (every
    running stream stalled) before; now on worker threads."""
    large = {"model": smol_stack.model, "prompt": "x", "max_tokens": 2,
             "guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(50_000))}
    arrivals: list[float] = []
    until = [float("inf")]  # the stream is left at its first line after this

    def stream() -> None:
        body = {"model": smol_stack.model, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", smol_stack.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                arrivals.append(time.monotonic())
                if arrivals[-1] > until[0]:
                    return

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while len(arrivals) < 5 and reader.is_alive():
        time.sleep(0.05)
    sent = time.monotonic()
    result: dict = {}
    big = threading.Thread(target=lambda: result.update(r=post(smol_stack, "/v1/completions", large)))
    big.start()
    time.sleep(0.5)
    started = time.monotonic()
    plain = post(smol_stack, "/v1/completions", {"model": smol_stack.model, "prompt": "Hello", "max_tokens": 2})
    plain_s = time.monotonic() - started
    big.join(60)
    until[0] = time.monotonic() + 0.5
    reader.join(60)
    assert plain.status_code == 200 and plain_s < 2.0, (plain.text, plain_s)
    assert result["r"].status_code in (200, 400), result["r"].text
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent]
    assert gaps and max(gaps) < 1.5, max(gaps)
