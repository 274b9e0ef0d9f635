"""Every OpenAI-family validation rule: a 4xx in OpenAI's error shape, then a good request still works."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.test_openai_api import MESSAGES, PROMPT, client, post
from tests.media_items import PNG_URL

ERROR_KEYS = {"message", "type", "param", "code"}
MEDIA = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}  # refused: x is not an allowed host

BAD_SAMPLING = [  # (fields, param) — checked on both endpoints
    ({"temperature": -0.1}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2147483648}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"), ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": 2**63}, "seed"), ({"n": 0}, "n"),
    ({"n": 17}, "n"), ({"n": "2"}, "n"), ({"n": 2, "temperature": 0}, "n"), ({"best_of": 2}, "best_of"),
    ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": [1]}, "stop"), ({"stop": ["a" * 1025]}, "stop"),
    ({"stop_token_ids": "x"}, "stop_token_ids"), ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": 5}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"logit_bias": {"x": 5}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # past the vocabulary
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"use_beam_search": True}, "use_beam_search"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"), ({"user": 5}, "user"),
    ({"logits_processors": ["x"]}, "logits_processors"), ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"priority": 1}, "priority"), ({"priority": "1"}, "priority"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"), ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"),
    ({"request_id": 7}, "request_id"), ({"add_special_tokens": "no"}, "add_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"model": None}, "model"), ({"model": 5}, "model"), ({"model": ""}, "model"),
]
BAD_CHAT = [
    ({"add_special_tokens": True}, "add_special_tokens"), ({"documents": "x"}, "documents"),
    ({"documents": [{"title": 1}]}, "documents"),
    ({"messages": None}, "messages"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [1]}, "messages[0]"), ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, MEDIA]}]}, "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),  # > maxInputTokenLen 64
    ({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages[0].tool_calls[0]"),
    ({"tool_choice": "required"}, "tool_choice"), ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema"),
    ({"chat_template": "{{ x }}"}, "chat_template"), ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
    # a template of the client's own through the kwargs (its loops ran on the tokenizer, which then missed its lease)
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[1].function_call"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "function_call": {}}]},
     "messages[1].function_call"),
]
BAD_COMPLETION = [
    ({"prompt": None}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": [""]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt"), ({"prompt": [True]}, "prompt"), ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": "word " * 200}, "prompt"), ({"echo": "x"}, "echo"),
    ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
]


def chat_body(stack, fields: dict) -> dict:
    return {"model": stack.model, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion_body(stack, fields: dict) -> dict:
    return {"model": stack.model, "prompt": PROMPT, "max_tokens": 4, **fields}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else error["type"])
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serving(stack) -> None:
    r = post(stack, "/v1/chat/completions", chat_body(stack, {}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("fields,param", BAD_SAMPLING + BAD_CHAT, ids=lambda v: json.dumps(v)[:50])
def test_bad_chat_bodies_get_400(tiny_stack, fields, param):
    assert_openai_error(post(tiny_stack, "/v1/chat/completions", chat_body(tiny_stack, fields)), 400, param)
    assert_serving(tiny_stack)


@pytest.mark.parametrize("fields,param", BAD_SAMPLING + BAD_COMPLETION, ids=lambda v: json.dumps(v)[:50])
def test_bad_completion_bodies_get_400(tiny_stack, fields, param):
    assert_openai_error(post(tiny_stack, "/v1/completions", completion_body(tiny_stack, fields)), 400, param)
    assert_serving(tiny_stack)


def test_media_parts_name_the_text_only_limitation(tiny_stack):
    safe = {"type": "image_url", "image_url": {"url": PNG_URL}}
    body = chat_body(tiny_stack, {"messages": [{"role": "user", "content": [safe]}]})
    error = assert_openai_error(post(tiny_stack, "/v1/chat/completions", body), 400, "messages[0].content[0]")
    assert "text-only" in error["message"] and "image" in error["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_stack):
    r = post(tiny_stack, "/v1/completions", completion_body(tiny_stack, {"prompt": "word " * 200,
                                                                         "truncate_prompt_tokens": 10}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 10
    r = post(tiny_stack, "/v1/completions", completion_body(tiny_stack, {"prompt": "word " * 200,
                                                                         "truncate_prompt_tokens": -1}))
    assert r.json()["usage"]["prompt_tokens"] == 64  # maxInputTokenLen of the tiny stack


def test_text_parts_are_joined(tiny_stack):
    parts = [{"type": "text", "text": "My name is "}, {"type": "text", "text": "Olivier and I"}]
    joined = post(tiny_stack, "/v1/chat/completions", chat_body(tiny_stack, {
        "messages": [{"role": "user", "content": parts}], "temperature": 0}))
    plain = post(tiny_stack, "/v1/chat/completions", chat_body(tiny_stack, {"temperature": 0}))
    assert joined.json()["usage"] == plain.json()["usage"]
    assert joined.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_bodies_that_are_not_a_json_object_get_400(tiny_stack, path, content):
    assert_openai_error(post(tiny_stack, path, content), 400)
    assert_serving(tiny_stack)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_model_is_404_and_missing_model_400(tiny_stack, path):
    body = chat_body(tiny_stack, {}) if "chat" in path else completion_body(tiny_stack, {})
    error = assert_openai_error(post(tiny_stack, path, {**body, "model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    assert_openai_error(post(tiny_stack, path, {k: v for k, v in body.items() if k != "model"}), 400, "model")
    assert_serving(tiny_stack)


def test_the_client_raises_its_typed_errors(tiny_stack):
    api = client(tiny_stack)
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, temperature=-1)
    assert err.value.param == "temperature" and err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=tiny_stack.model, prompt=PROMPT, logprobs=9)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, top_logprobs=3)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt=PROMPT, stream=True)
    assert api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, max_tokens=2).choices


def test_litestar_errors_come_in_openai_shape(tiny_stack):
    r = httpx.get(tiny_stack.url + "/v1/chat/completions")
    error = assert_openai_error(r, 405)
    assert error["code"] == "method_not_allowed" and r.headers["allow"] == "OPTIONS, POST"
    assert_openai_error(httpx.delete(tiny_stack.url + "/v1/models"), 405)
    assert_openai_error(httpx.get(tiny_stack.url + "/v1/models/nope"), 404, "model")
    big = post(tiny_stack, "/v1/completions", completion_body(tiny_stack, {"prompt": "x" * (1024 * 1024 + 10)}))
    error = assert_openai_error(big, 413)
    assert error["message"] == "Request body too large. Maximum allowed size is 1MB."
    assert_serving(tiny_stack)
