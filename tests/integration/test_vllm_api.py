"""vLLM's POST /generate (a `prompt` body) beside TGI's on the same URL (reference §3.23)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.stack import post
from tests.media_items import PNG_URL

PROMPT = "My name is Olivier and I"
GREEDY = {"temperature": 0, "max_tokens": 6}


def nul_chunks(body: bytes) -> list[dict]:
    """vLLM's stream: JSON objects each terminated by a NUL byte, no SSE framing."""
    assert body.endswith(b"\0"), body[-20:]
    return [json.loads(part) for part in body.split(b"\0")[:-1]]


def test_prompt_body_is_vllm_and_inputs_body_is_tgi(tiny_stack):
    vllm = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY})
    assert vllm.status_code == 200, vllm.text
    assert set(vllm.json()) == {"text"}
    [text] = vllm.json()["text"]
    assert text.startswith(PROMPT + " ")
    tgi = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": 6}})
    assert text == f"{PROMPT} {tgi.json()['generated_text']}"
    both = post(tiny_stack, "/generate", {"prompt": PROMPT, "inputs": "ignored", **GREEDY})
    assert both.json() == vllm.json()  # `prompt` is checked first


def test_n_with_a_seed_gives_n_reproducible_sequences(tiny_stack):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "top_k": 50, "seed": 7, "n": 3}
    first = post(tiny_stack, "/generate", body).json()["text"]
    assert len(first) == 3 and len(set(first)) > 1
    assert post(tiny_stack, "/generate", body).json()["text"] == first


def test_best_of_returns_the_n_most_likely(tiny_stack):
    r = post(tiny_stack, "/generate", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": 3,
                                        "n": 2, "best_of": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["text"]) == 2


def test_stream_is_nul_terminated_json(tiny_stack):
    r = post(tiny_stack, "/generate", {"prompt": PROMPT, "stream": True, **GREEDY})
    assert r.status_code == 200, r.text
    chunks = nul_chunks(r.content)
    assert all(set(c) == {"text"} and len(c["text"]) == 1 for c in chunks)
    whole = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY}).json()["text"][0]
    assert PROMPT + " " + "".join(c["text"][0] for c in chunks) == whole


def test_stop_and_stop_token_ids(tiny_stack):
    whole = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY}).json()["text"][0][len(PROMPT) + 1:]
    stop = whole[3:6]
    cut = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY, "stop": stop}).json()["text"][0]
    assert cut == f"{PROMPT} {whole[:whole.index(stop)]}"
    kept = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY, "stop": [stop],
                                           "include_stop_str_in_output": True}).json()["text"][0]
    assert kept == f"{PROMPT} {whole[:whole.index(stop) + len(stop)]}"
    ids = post(tiny_stack, "/infer", {"inputs": PROMPT, "parameters": {
        "do_sample": False, "max_new_tokens": 6, "details": True}}).json()["details"]["generated_token_ids"]
    one = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY, "stop_token_ids": [ids[1], -5]}).json()
    kept = post(tiny_stack, "/generate", {"prompt": PROMPT, **GREEDY, "stop_token_ids": [ids[1]],
                                          "include_stop_str_in_output": True}).json()

    def upto(n: int) -> str:  # the first n greedy tokens' text
        return post(tiny_stack, "/infer", {"inputs": PROMPT, "parameters": {
            "do_sample": False, "max_new_tokens": n}}).json()["generated_text"] if n else ""

    # the stop token's text is left out unless include_stop_str_in_output (reference §3.23b: read with stop ids too)
    assert one["text"][0] == f"{PROMPT} {upto(ids.index(ids[1]))}"
    assert kept["text"][0] == f"{PROMPT} {upto(ids.index(ids[1]) + 1)}"


@pytest.mark.parametrize("body, message", [
    ({"prompt": 5}, "prompt must be string type."),
    ({"prompt": ""}, "prompt must be 1 to"),
    ({"prompt": [{"type": "image_url", "image_url": "x.png"}]}, "local media files are not allowed"),
    ({"prompt": [{"type": "image_url", "image_url": PNG_URL}]}, "text-only"),
    ({"prompt": []}, "Inputs arr is empty"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens must be in (0"),
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature must be in [0.0"),
    ({"prompt": PROMPT, "top_k": 0}, "top_k must be -1 (disabled) or in (0, 2147483647], got 0."),
    ({"prompt": PROMPT, "top_k": -2}, "top_k must be in [-1"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p must be in (0.0, 1.0]"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p must be in (0.0, 1.0]"),
    ({"prompt": PROMPT, "seed": -1}, "seed must be unsigned type."),
    ({"prompt": PROMPT, "seed": 2**63}, "seed must be in [0, 9223372036854775807]"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty must be in (0.0"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty must be in [-2.0, 2.0]"),
    ({"prompt": PROMPT, "ignore_eos": "y"}, "ignore_eos must be boolean type."),
    ({"prompt": PROMPT, "skip_special_tokens": 1}, "skip_special_tokens must be boolean type."),
    ({"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs is not supported on /generate"),
    ({"prompt": PROMPT, "stream": "y"}, "stream must be boolean type."),
    ({"prompt": PROMPT, "stop": 3}, "stop must be string or array of strings type."),
    ({"prompt": PROMPT, "stop": ["ok", ""]}, "each stop item must be 1 to 1024 characters long"),
    ({"prompt": PROMPT, "stop_token_ids": [1, "2"]}, "stop_token_ids must be array of integers type."),
    ({"prompt": PROMPT, "n": 0}, "n must be in [1, 8192], got 0."),
    ({"prompt": PROMPT, "n": 17, "temperature": 1}, "n must be at most 16"),
    ({"prompt": PROMPT, "best_of": 129}, "best_of must be in [1, 128], got 129."),
    ({"prompt": PROMPT, "n": 3, "best_of": 2, "temperature": 1}, "best_of must be greater than or equal to n"),
    ({"prompt": PROMPT, "n": 2}, "n and best_of must be 1 when temperature is 0 or absent"),
    ({"prompt": "word " * 200}, "more than the limit of 64"),
])
def test_bad_vllm_bodies_get_422_in_mindie_shape(tiny_stack, body, message):
    r = post(tiny_stack, "/generate", body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "Input Validation Error"
    assert message in r.json()["error"]
    assert post(tiny_stack, "/generate", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_unknown_model_is_404(tiny_stack):
    r = post(tiny_stack, "/generate", {"prompt": PROMPT, "model": "nope", **GREEDY})
    assert r.status_code == 404
    assert r.json() == {"error": "Model nope not found.", "error_type": "NotFoundError"}
    assert post(tiny_stack, "/generate", {"prompt": PROMPT, "model": tiny_stack.model, **GREEDY}).status_code == 200


async def test_disconnect_mid_stream_frees_the_engine(tiny_stack):
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", tiny_stack.url + "/generate", json=body) as r:
            async for _ in r.aiter_bytes():
                break
    info = await tiny_stack.wait_engine_idle()
    assert (info.running, info.waiting, info.free_blocks) == (0, 0, info.total_blocks)


def test_a_field_vllm_generate_does_not_take_is_a_422_naming_it(tiny_stack):
    """response_format (the OpenAI routes') or a misspelt field would otherwise be set aside in silence."""
    for field, value in (("response_format", {"type": "json_object"}), ("max_new_tokens", 4)):
        r = post(tiny_stack, "/generate", {"prompt": PROMPT, field: value})
        assert r.status_code == 422 and field in r.json()["error"], r.text
