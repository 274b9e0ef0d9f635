"""Nothing silently ignored: parameters that used to be accepted and dropped are honoured or refused."""

from __future__ import annotations

import re

import pytest
from text_generation import Client

from tests.integration.stack import post, sse_events

PROMPT = "My name is Olivier and I"
TINY = 1e-300  # accepted by every family; must behave as greedy, never poison the sampler


def test_kserve_generate_max_tokens_is_honoured(tiny_stack):
    """litellm's triton/ client sends parameters.max_tokens (the KServe generate extension)."""
    path = f"/v2/models/{tiny_stack.model}/generate"
    r = post(tiny_stack, path, {"text_input": PROMPT, "parameters": {"max_tokens": 3, "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 3
    both = post(tiny_stack, path, {"text_input": PROMPT, "parameters": {"max_tokens": 3, "max_new_tokens": 5,
                                                                        "details": True}})
    assert both.json()["details"]["generated_tokens"] == 5  # max_new_tokens wins when both are given
    bad = post(tiny_stack, path, {"text_input": PROMPT, "parameters": {"max_tokens": 0}})
    assert bad.status_code == 422 and "max_tokens" in bad.json()["error"]


def test_tgi_tokens_carry_their_logprob_without_top_n_tokens(tiny_stack):
    """TGI reports every generated token's logprob, in details and in the stream."""
    client = Client(tiny_stack.url)
    done = client.generate(PROMPT, max_new_tokens=4)
    assert done.details.top_tokens is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in done.details.tokens)
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=4))
    assert [r.token.logprob for r in streamed] == pytest.approx([t.logprob for t in done.details.tokens], abs=1e-4)


def test_tgi_top_n_tokens_in_details_and_stream(tiny_stack):
    client = Client(tiny_stack.url)
    done = client.generate(PROMPT, max_new_tokens=4, top_n_tokens=3)  # the client always asks for details
    tops = done.details.top_tokens
    assert len(tops) == 4 and all(len(step) == 3 for step in tops)
    for token, step in zip(done.details.tokens, tops):
        assert token.logprob is not None and token.logprob <= 0
        assert [t.logprob for t in step] == sorted((t.logprob for t in step), reverse=True)
        assert step[0].logprob >= token.logprob  # greedy: the sampled token is the most likely one
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=4, top_n_tokens=2))
    assert [len(r.top_tokens) for r in streamed] == [2] * 4
    assert [r.token.id for r in streamed] == [t.id for t in done.details.tokens]
    for bad in (6, -1, 1.5, "3"):  # 0 means none, as on TGI's server
        r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {"top_n_tokens": bad}})
        assert r.status_code == 422 and "top_n_tokens" in r.json()["error"], (bad, r.text)


@pytest.mark.parametrize("grammar", [
    "json", {"type": "xml", "value": "x"}, {"type": "regex", "value": 5}, {"type": "regex", "value": "[0-9"},
    {"type": "json", "value": 5}, {"type": "json", "value": {"type": "nonsense"}}, {"type": "json", "value": "{bad"},
    {"type": "json_schema", "value": {"name": "x"}},
])
def test_tgi_grammars_that_cannot_be_compiled_are_422_before_anything_runs(tiny_stack, grammar):
    for path in ("/generate", "/generate_stream", "/"):
        r = post(tiny_stack, path, {"inputs": PROMPT, "parameters": {"grammar": grammar}})
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation" and "grammar" in r.json()["error"]


def test_completions_default_max_tokens_is_16(tiny_stack):
    r = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": PROMPT, "ignore_eos": True,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


def test_openai_refusal_fields_and_the_backends_fingerprint(tiny_stack):
    """system_fingerprint is a string naming the backend configuration (TGI's own client requires it): the same
    for every answer of one configuration, on chat and completions."""
    r = post(tiny_stack, "/v1/chat/completions", {
        "model": tiny_stack.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 1})
    body = r.json()
    assert re.fullmatch(r"fp_[0-9a-f]{10}", body["system_fingerprint"])
    completion = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": PROMPT, "max_tokens": 1})
    assert completion.json()["system_fingerprint"] == body["system_fingerprint"]
    choice = body["choices"][0]
    assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None


def test_seed_zero_is_refused_where_the_seeds_say_so(tiny_stack):
    for path, body in (("/generate", {"inputs": PROMPT, "parameters": {"seed": 0}}),
                       ("/infer", {"inputs": PROMPT, "parameters": {"seed": 0}}),
                       (f"/v2/models/{tiny_stack.model}/generate", {"text_input": PROMPT, "parameters": {"seed": 0}})):
        r = post(tiny_stack, path, body)
        assert r.status_code == 422 and "seed" in r.json()["error"], (path, r.text)
    top = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {"seed": 2**64 - 1, "do_sample": True,
                                                                          "max_new_tokens": 2}})
    assert top.status_code == 200, top.text
    assert post(tiny_stack, "/generate", {"prompt": PROMPT, "seed": 0, "max_tokens": 2}).status_code == 200


def test_a_tiny_temperature_is_greedy_on_every_family(tiny_stack):
    model = tiny_stack.model
    cases = [  # (path, greedy body, tiny-temperature body, text of the answer)
        ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}},
         {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "do_sample": True, "temperature": TINY}},
         lambda j: j["generated_text"]),
        ("/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}},
         {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "do_sample": True, "temperature": TINY}},
         lambda j: j["generated_text"]),
        (f"/v2/models/{model}/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": 6}},
         {"text_input": PROMPT, "parameters": {"max_new_tokens": 6, "do_sample": True, "temperature": TINY}},
         lambda j: j["text_output"]),
        ("/generate", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
         {"prompt": PROMPT, "max_tokens": 6, "temperature": 5e-324}, lambda j: j["text"][0]),
        ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
         {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": TINY},
         lambda j: j["choices"][0]["text"]),
    ]
    for path, greedy, tiny, text in cases:
        expected, got = post(tiny_stack, path, greedy), post(tiny_stack, path, tiny)
        assert expected.status_code == got.status_code == 200, (path, expected.text, got.text)
        assert text(got.json()) == text(expected.json()), path
    stream = post(tiny_stack, "/generate_stream", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "do_sample": True, "temperature": TINY}})
    events = sse_events(stream.text)
    assert all("error" not in e for e in events), events
    assert events[-1]["generated_text"] == post(tiny_stack, "/generate", cases[0][1]).json()["generated_text"]
