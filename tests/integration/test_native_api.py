"""MindIE-native /infer, /infer_token and /v1/tokenizer through all four services."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.stack import post, running_stack, sse_events
from tests.media_items import PNG_URL

PROMPT = "My name is Olivier and I"
PROMPT_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]
GREEDY = {"do_sample": False, "max_new_tokens": 6}


def assert_serving(stack) -> None:
    r = post(stack, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["generated_text"], str)


def test_infer_returns_text_and_details(tiny_stack):
    r = post(tiny_stack, "/infer", {"inputs": PROMPT, "stream": False, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"generated_text", "details"}
    details = body["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "generated_token_ids"}
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["generated_token_ids"]) <= 6
    assert set(post(tiny_stack, "/infer", {"inputs": PROMPT, "parameters": GREEDY}).json()) == {"generated_text"}


@pytest.mark.parametrize("path", ["/infer", "/infer_token"])
def test_token_ids_and_text_give_the_same_greedy_tokens(tiny_stack, path):
    by_text = post(tiny_stack, "/infer", {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}}).json()
    by_ids = post(tiny_stack, path, {"input_id": PROMPT_IDS, "parameters": {**GREEDY, "details": True}}).json()
    assert by_ids["details"]["generated_token_ids"] == by_text["details"]["generated_token_ids"]
    assert by_ids["generated_text"] == by_text["generated_text"]


def test_infer_stream_events_carry_timings_and_a_final_event(tiny_stack):
    r = post(tiny_stack, "/infer", {"inputs": PROMPT, "stream": True, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *tokens, final = events
    assert isinstance(tokens[0]["prefill_time"], int) and tokens[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and isinstance(e["decode_time"], int) for e in tokens[1:])
    assert all(set(e) == {"prefill_time", "decode_time", "token"} for e in tokens)
    assert set(final) == {"prefill_time", "decode_time", "generated_text", "details", "token"}
    assert final["token"]["text"] is None and len(final["token"]["id"]) == 1
    assert final["generated_text"].startswith("".join(e["token"]["text"] for e in tokens))
    assert final["details"]["generated_tokens"] == len(tokens) + 1
    # with a stop string that never comes, each token still carries its own text (seed 003), not text held back
    held = sse_events(post(tiny_stack, "/infer", {"inputs": PROMPT, "stream": True, "parameters": {
        **GREEDY, "details": True, "stop": ["\u2603\u2603 never"]}}).text)
    assert [e["token"] for e in held] == [e["token"] for e in events]


@pytest.fixture(scope="module")
def long_stack(tmp_path_factory, tiny_model_dir):
    """Room for 8000 new tokens: more than the tiny model generates in a second, however fast the engine."""
    with running_stack(tmp_path_factory.mktemp("long"), tiny_model_dir, **{
            "BackendConfig.ModelDeployConfig": {"maxSeqLen": 8192},
            "BackendConfig.ScheduleConfig": {"maxIterTimes": 8000}}) as stack:
        yield stack


def test_priority_and_timeout_are_honoured(long_stack):
    r = post(long_stack, "/infer", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 100000, "do_sample": False, "priority": 1, "timeout": 1}})
    assert r.status_code == 500, r.text
    assert r.json() == {"error": "Engine callback timeout: client timeout", "error_type": "Incomplete Generation"}
    assert_serving(long_stack)


def test_multimodal_items_name_the_limitation(tiny_stack):
    text_only = post(tiny_stack, "/infer", {"inputs": [{"type": "text", "text": PROMPT}], "parameters": GREEDY})
    assert text_only.status_code == 200, text_only.text
    r = post(tiny_stack, "/infer", {"inputs": [{"type": "text", "text": "What is this?"},
                                              {"type": "image_url", "image_url": PNG_URL}]})
    assert r.status_code == 422
    assert "text-only" in r.json()["error"] and r.json()["error_type"] == "Input Validation Error"


@pytest.mark.parametrize("body, message", [
    (b"{not json", "Failed to parse context to json body"),
    ({"parameters": {}}, "Not found inputs."),
    ({"inputs": None}, "Inputs must not be null"),
    ({"inputs": 5}, "The type of inputs is abnormal"),
    ({"inputs": ""}, "length in (0, 4194304], but the length of inputs is 0"),
    ({"inputs": []}, "Inputs arr is empty"),
    ({"inputs": PROMPT, "input_id": [1, 2]}, "Input conflict."),
    ({"input_id": None}, "Input_id should not be empty"),
    ({"input_id": "1 2"}, "Parameter input_id must be an array"),
    ({"input_id": [1, "2"]}, "Parameter input_id must be integer"),
    ({"input_id": [1, 1048577]}, "Data element in param input_id is invalid"),
    ({"input_id": []}, "Inputs token length must be in (0, 1048576], but got 0"),
    ({"input_id": [60000]}, "outside the vocabulary"),
    ({"inputs": PROMPT, "stream": "yes"}, "Stream must be boolean type."),
    ({"inputs": PROMPT, "parameters": []}, "parameters must be object type."),
    ({"inputs": PROMPT, "parameters": {"temperature": 0}}, "temperature must be in (0.0"),
    ({"inputs": PROMPT, "parameters": {"top_k": 0}}, "top_k must be in (0"),
    ({"inputs": PROMPT, "parameters": {"top_p": 1.0}}, "top_p must be in (0.0, 1.0)"),
    ({"inputs": PROMPT, "parameters": {"typical_p": 0}}, "typical_p must be in (0.0, 1.0]"),
    ({"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, "max_new_tokens must be in (0"),
    ({"inputs": PROMPT, "parameters": {"repetition_penalty": -1.0}}, "repetition_penalty must be in (0.0"),
    ({"inputs": PROMPT, "parameters": {"seed": -1}}, "seed must be unsigned type."),
    ({"inputs": PROMPT, "parameters": {"do_sample": "no"}}, "do_sample must be boolean type."),
    ({"inputs": PROMPT, "parameters": {"details": 1}}, "details must be boolean type."),
    ({"inputs": PROMPT, "parameters": {"watermark": 1}}, "watermark must be boolean type."),
    ({"inputs": PROMPT, "parameters": {"priority": -1}}, "priority must be unsigned type."),
    ({"inputs": PROMPT, "parameters": {"priority": 6}}, "Parameter priority must be in [1,5], got 6."),
    ({"inputs": PROMPT, "parameters": {"timeout": 0}}, "timeout must be in (0, 3600], got 0."),
    ({"inputs": PROMPT, "parameters": {"timeout": 3601}}, "timeout must be in (0, 3600], got 3601."),
    ({"inputs": PROMPT, "parameters": {"grammar": {"type": "regex", "value": "[0-9]+"}}},
     "parameters.grammar is a TGI parameter"),
    ({"inputs": PROMPT, "parameters": {"truncate": 2}}, "parameters.truncate is a TGI parameter"),
    ({"inputs": PROMPT, "parameters": {"return_full_text": True}}, "parameters.return_full_text is a TGI"),
    ({"inputs": PROMPT, "parameters": {"best_of": 2}}, "parameters.best_of is a TGI parameter"),
    ({"inputs": PROMPT, "parameters": {"adapter_id": "x"}}, "parameters.adapter_id is a TGI parameter"),
    ({"inputs": "word " * 200}, "more than the limit of 64"),
    # more characters than 64 tokens can hold: refused before it is tokenized (the tokenizer is not held up)
    ({"inputs": "a " * 200_000}, "400000 characters: more than the limit of 64 tokens"),
])
def test_bad_bodies_get_422_and_the_server_keeps_serving(tiny_stack, body, message):
    r = post(tiny_stack, "/infer_token" if isinstance(body, dict) and "input_id" in body else "/infer", body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "Input Validation Error"
    assert message in r.json()["error"]
    assert_serving(tiny_stack)


def test_tokenizer_counts_what_a_generate_reports(tiny_stack):
    for text in (PROMPT, "混合 text: héllo 🌍 wörld"):
        r = post(tiny_stack, "/v1/tokenizer", {"inputs": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"token_number", "tokens"}
        infer = post(tiny_stack, "/infer", {"inputs": text, "parameters": {**GREEDY, "details": True}}).json()
        prompt_tokens = post(tiny_stack, "/generate", {"inputs": text, "parameters": {
            "max_new_tokens": 1, "details": True}}).json()["details"]["prompt_tokens"]
        assert body["token_number"] == prompt_tokens
        assert "".join(body["tokens"]) == text and len(body["tokens"]) <= body["token_number"]
        assert infer["details"]["generated_tokens"] >= 1
    assert post(tiny_stack, "/v1/tokenizer", {"inputs": PROMPT, "do_decode": False}).json() == {
        "token_number": 8, "tokens": []}


@pytest.mark.parametrize("body, message", [
    (b"[", "Req body converts to json fail."),
    ({"inputs": None}, "Inputs in request body is invalid."),
    ({"inputs": 3}, "Inputs in request body is invalid."),
    ({"inputs": ""}, "but the length of inputs is 0"),
])
def test_tokenizer_validation(tiny_stack, body, message):
    r = post(tiny_stack, "/v1/tokenizer", body)
    assert r.status_code == 422 and message in r.json()["error"], r.text
    assert post(tiny_stack, "/v1/tokenizer", {"inputs": "ok"}).status_code == 200


def test_smollm2_infer_token_matches_hf_greedy(smol_stack):
    r = httpx.post(smol_stack.url + "/infer_token", json={"input_id": PROMPT_IDS, "parameters": {
        "do_sample": False, "max_new_tokens": 12}}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == "'m here to help you with your business. I'll be"
