"""The TGI family and health endpoints through all four services (tiny random model)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.integration.stack import post, sse_events

PROMPT = "My name is Olivier and I"
GREEDY = {"do_sample": False, "max_new_tokens": 8}


def assert_serving(stack) -> None:
    ok = post(stack, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text
    assert isinstance(ok.json()["generated_text"], str)


def test_root_returns_an_array_with_details(tiny_stack):
    r = post(tiny_stack, "/", {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == 1
    details = body[0]["details"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["tokens"]) <= 8
    assert details["prefill"] == []
    assert isinstance(details["seed"], int) and details["prompt_tokens"] == 8
    for token in details["tokens"]:
        assert isinstance(token["id"], int) and isinstance(token["text"], str) and isinstance(token["special"], bool)
    assert body[0]["generated_text"] == "".join(t["text"] for t in details["tokens"])
    assert r.headers["requestuuid"]


def test_generate_returns_one_object_without_details(tiny_stack):
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": GREEDY, "stream": True})
    assert r.status_code == 200
    assert list(r.json()) == ["generated_text"]


def test_decoder_input_details_returns_prompt_tokens(tiny_stack):
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "decoder_input_details": True}})
    details = r.json()["details"]
    assert [t["id"] for t in details["prefill"]] == [5965, 1462, 314, 11256, 380, 1153, 284, 339]
    assert "".join(t["text"] for t in details["prefill"]) == PROMPT


def test_greedy_is_deterministic_and_return_full_text(tiny_stack):
    a = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": GREEDY}).json()["generated_text"]
    b = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "return_full_text": True}})
    assert b.json()["generated_text"] == f"{PROMPT} {a}"


def test_same_seed_same_text(tiny_stack):
    params = {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 77, "max_new_tokens": 12,
              "details": True}
    first, second = (post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": params}).json() for _ in range(2))
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 77


@pytest.mark.parametrize("path,body", [
    ("/", {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}, "stream": True}),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {**GREEDY, "details": True}}),
])
def test_streams_are_sse_token_events(tiny_stack, path, body):
    r = post(tiny_stack, path, body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events, r.text
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
        assert isinstance(event["token"]["id"], int)
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["generated_tokens"] == len(events)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))  # TGI's event numbers
    assert last["details"]["input_length"] == last["details"]["prompt_tokens"] == 8
    assert last["details"]["finish_reason"] in ("length", "eos_token")
    full = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": GREEDY}).json()["generated_text"]
    assert last["generated_text"] == full


def test_stop_sequence_cuts_the_text(tiny_stack):
    text = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "max_new_tokens": 16}}).json()
    text = text["generated_text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"noise text too short to pick a stop string from: {text!r}"
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "max_new_tokens": 16,
                                                                     "stop": [stop], "details": True}})
    body = r.json()
    assert body["generated_text"] == text[: text.index(stop)]
    assert body["details"]["finish_reason"] == "stop_sequence"
    stream = sse_events(post(tiny_stack, "/generate_stream", {"inputs": PROMPT, "parameters": {
        **GREEDY, "max_new_tokens": 16, "stop": stop, "details": True}}).text)
    assert stream[-1]["generated_text"] == text[: text.index(stop)]
    # each token's text is its own, as TGI's (the stop string's too): not text held back from earlier tokens
    # while a stop string might be forming, and not the end of the text on a special EOS token
    tokens = "".join(e["token"]["text"] for e in stream)
    assert tokens.startswith(text[: text.index(stop)] + stop) and text.startswith(tokens)
    assert [t["text"] for t in body["details"]["tokens"]] == [e["token"]["text"] for e in stream]
    never = post(tiny_stack, "/generate_stream", {"inputs": PROMPT, "parameters": {
        **GREEDY, "max_new_tokens": 16, "stop": ["\u2603\u2603\u2603 never"]}})
    events = sse_events(never.text)
    assert [e["token"]["text"] for e in events] == [e["token"]["text"] for e in sse_events(post(
        tiny_stack, "/generate_stream", {"inputs": PROMPT, "parameters": {**GREEDY, "max_new_tokens": 16}}).text)]
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == events[-1]["generated_text"]


BAD_PARAMETERS = [
    {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 2147483648}, {"max_new_tokens": 1.5},
    {"max_new_tokens": "10"}, {"repetition_penalty": 0}, {"repetition_penalty": -1.0}, {"repetition_penalty": "1"},
    {"seed": -1}, {"seed": 0}, {"seed": 1.5}, {"seed": 18446744073709551616}, {"temperature": 0}, {"temperature": -0.5},
    {"top_k": 0}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.0}, {"top_p": 1.5}, {"truncate": 0},
    {"typical_p": 0}, {"typical_p": 1.5}, {"watermark": "no"}, {"details": 1}, {"do_sample": "true"},
    {"decoder_input_details": "x"}, {"return_full_text": 0}, {"stop": 5}, {"stop": [""]}, {"stop": ["a" * 1025]},
    {"stop": ["a"] * 1025}, {"adapter_id": "bad id!"}, {"best_of": 2},
    {"frequency_penalty": 1.0},  # TGI's (a share of all tokens): refused, not ignored; repetition_penalty is taken
]


@pytest.mark.parametrize("parameters", BAD_PARAMETERS, ids=lambda p: json.dumps(p)[:40])
def test_bad_parameters_get_422_and_server_keeps_serving(tiny_stack, parameters):
    for path in ("/", "/generate", "/generate_stream"):
        r = post(tiny_stack, path, {"inputs": PROMPT, "parameters": parameters})
        assert r.status_code == 422, (path, r.text)
        body = r.json()
        assert body["error_type"] == "validation" and body["error"]
        assert r.headers["content-type"].startswith("application/json")
    assert_serving(tiny_stack)


@pytest.mark.parametrize("path,body", [
    ("/", b"{not json"),
    ("/", b"[1, 2]"),
    ("/", {"parameters": {}}),
    ("/", {"inputs": 123}),
    ("/", {"inputs": ""}),
    ("/", {"inputs": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "/x.png"}]}),
    ("/", {"inputs": PROMPT, "stream": "yes"}),
    ("/", {"inputs": PROMPT, "parameters": [1]}),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"decoder_input_details": True}}),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}),
    ("/generate", {"parameters": {}}),
    ("/generate", b"nope"),
    ("/", {"inputs": "word " * 200}),  # 200+ tokens > maxInputTokenLen 64
])
def test_bad_bodies_get_422(tiny_stack, path, body):
    r = post(tiny_stack, path, body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"
    assert_serving(tiny_stack)


def test_generate_without_inputs_or_prompt_uses_mindie_message(tiny_stack):
    r = post(tiny_stack, "/generate", {"parameters": {}})
    assert "`inputs` or `prompt` must be necessary" in r.json()["error"]


def test_truncate_keeps_the_last_tokens(tiny_stack):
    r = post(tiny_stack, "/generate", {"inputs": "word " * 200, "parameters": {**GREEDY, "truncate": 10,
                                                                           "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["prompt_tokens"] == 10
    long = post(tiny_stack, "/generate", {"inputs": "word " * 20_000, "parameters": {**GREEDY, "truncate": 10,
                                                                                  "details": True}})
    assert long.status_code == 200 and long.json()["details"]["prompt_tokens"] == 10, long.text


def test_body_over_max_request_length_is_413(tiny_stack):
    r = post(tiny_stack, "/generate", {"inputs": "x" * (1024 * 1024 + 10)})
    assert r.status_code == 413
    assert r.json() == {"message": "Request body too large. Maximum allowed size is 1MB."}
    assert_serving(tiny_stack)


def test_health_and_info_on_the_management_plane(tiny_stack):
    mgmt = tiny_stack.mgmt_url
    assert httpx.get(mgmt + "/health").status_code == 200
    assert httpx.get(mgmt + "/v2/health/live").status_code == 200
    assert httpx.get(mgmt + "/v2/health/ready").status_code == 200
    # HEAD answers as GET does, with no body (curl -I, probes that send HEAD); a POST-only route stays 405
    head, get = httpx.head(mgmt + "/info"), httpx.get(mgmt + "/info")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(tiny_stack.url + "/v1/models").status_code == 200
    assert httpx.head(tiny_stack.url + "/generate").status_code == 405
    assert httpx.head(mgmt + "/stopService").status_code == 405  # a GET that acts is not run by a HEAD
    info = get.json()
    assert info["max_input_length"] == 64 and info["max_best_of"] == 1
    model = info["models"][0]
    assert model["model_id"] == tiny_stack.model and model["model_dtype"] == "float32"
    assert model["model_device_type"] == "cpu" and model["max_total_tokens"] == 2560
    # planes are split: management routes are not on the business listener and vice versa
    assert httpx.get(tiny_stack.url + "/info").status_code == 404
    assert httpx.post(mgmt + "/generate", json={"inputs": PROMPT}).status_code in (404, 405)


async def test_disconnect_mid_stream_frees_the_engine(tiny_stack):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2000, "do_sample": False}}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", tiny_stack.url + "/generate_stream", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
    info = await tiny_stack.wait_engine_idle()
    assert (info.running, info.waiting, info.free_blocks) == (0, 0, info.total_blocks)
    assert_serving(tiny_stack)


async def test_disconnect_of_a_plain_request_frees_the_engine(tiny_stack):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2000, "do_sample": False}}
    # the client gives up long before the answer: maxIterTimes caps it at 512 tokens, which the tiny model
    # makes in ~0.5 s on a 2-core EPYC (a 0.5 s read timeout raced it)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=0.1)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(tiny_stack.url + "/generate", json=body)
    info = await tiny_stack.wait_engine_idle()
    assert (info.running, info.waiting, info.free_blocks) == (0, 0, info.total_blocks)


async def test_metrics_service_keeps_ttft_and_tbt(tiny_stack):
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": GREEDY})
    assert r.status_code == 200
    snapshot = await tiny_stack.metrics()
    assert snapshot.requests > 0
    assert snapshot.ttft_avg_ms > 0 and snapshot.tbt_avg_ms > 0
    assert any(ttft is not None and ttft > 0 for ttft, _tbt in snapshot.per_request.values())


async def test_a_stop_string_cancels_the_engine_side(tiny_stack):
    text = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {**GREEDY, "max_new_tokens": 6}})
    stop = text.json()["generated_text"][-3:]
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": 2500,
                                                                     "stop": [stop], "details": True}})
    assert r.json()["details"]["finish_reason"] == "stop_sequence"
    assert r.json()["details"]["generated_tokens"] <= 6
    info = await tiny_stack.wait_engine_idle(timeout=0.5)  # far less than 2500 more tokens would take
    assert (info.running, info.waiting, info.free_blocks) == (0, 0, info.total_blocks)


SEED_003_BODY = {"inputs": PROMPT, "parameters": {
    "decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
    "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10,
    "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "stop": ["stop1", "stop2"],
    "adapter_id": "None"}, "stream": False}
SEED_000_BODY = {"inputs": PROMPT, "parameters": {
    "best_of": 1, "decoder_input_details": False, "details": False, "do_sample": True, "max_new_tokens": 20,
    "repetition_penalty": 2, "return_full_text": False, "seed": 12, "temperature": 0.1, "top_k": 1, "top_p": 0.9,
    "truncate": 1024}, "stream": True}


def test_the_seed_documents_examples_work(tiny_stack):
    r = post(tiny_stack, "/", SEED_003_BODY)
    assert r.status_code == 200, r.text
    details = r.json()[0]["details"]
    assert details["generated_tokens"] >= 1 and len(details["prefill"]) == details["prompt_tokens"]
    r = post(tiny_stack, "/generate", {**SEED_000_BODY, "parameters": {
        "details": True, "do_sample": True, "repetition_penalty": 1.1, "return_full_text": False, "seed": None,
        "temperature": 1, "top_p": 0.99}, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["finish_reason"] in ("length", "eos_token")
    events = sse_events(post(tiny_stack, "/generate_stream", SEED_000_BODY).text)
    assert "error" not in events[-1] and events[-1]["generated_text"] is not None


def test_tgi_tokenize_gives_each_tokens_text_and_offsets(tiny_stack):
    """TGI's /tokenize body (``inputs``): id, text and [start, stop) offsets of each token, truncate keeping the
    last; its errors are TGI's; and ``stream`` on /generate is ignored, as the reference says."""
    tokens = post(tiny_stack, "/tokenize", {"inputs": PROMPT}).json()
    assert [t["text"] for t in tokens] == [PROMPT[t["start"]:t["stop"]] for t in tokens]
    assert "".join(t["text"] for t in tokens) == PROMPT and len(tokens) == 8
    kept = post(tiny_stack, "/tokenize", {"inputs": PROMPT, "parameters": {"truncate": 3}}).json()
    assert kept == tokens[-3:]
    bad = post(tiny_stack, "/tokenize", {"inputs": 5})
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation", bad.text
    assert post(tiny_stack, "/generate", {"inputs": PROMPT, "stream": "x", "parameters": GREEDY}).status_code == 200
    special = post(tiny_stack, "/generate", {"inputs": "<|im_start|>user\nhi<|im_end|>", "parameters": {
        **GREEDY, "decoder_input_details": True}}).json()["details"]["prefill"]
    assert [t["special"] for t in special if t["text"] in ("<|im_start|>", "<|im_end|>")] == [True, True]


def test_tgis_own_client_chats_as_tgis_messages_api(tiny_stack):
    """text_generation's Client.chat sends model "tgi" (TGI's Messages API docs tell every client to): it is the
    served model, named as such in the answer (it was a 404 model_not_found), and the answer carries the
    system_fingerprint the client requires; streamed too. (The client's own streaming reader wants a tool_calls
    key on every delta under pydantic 2, which TGI's server does not send either: the stream is read here.)"""
    from text_generation import Client
    from text_generation.types import Message

    tgi = Client(tiny_stack.url, timeout=60)
    answer = tgi.chat(messages=[Message(role="user", content="Hello")], max_tokens=4, temperature=0.0)
    assert answer.model == tiny_stack.model and answer.usage["completion_tokens"] == 4
    assert answer.choices[0].message.content and answer.system_fingerprint.startswith("fp_")
    r = httpx.post(tiny_stack.url + "/v1/chat/completions", timeout=60, json={
        "model": "tgi", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0,
        "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert {c["model"] for c in chunks} == {tiny_stack.model}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        answer.choices[0].message.content


def test_tgi_clients_defaults_sample_when_asked_and_its_routes_and_forms_are_taken(tiny_stack):
    """What TGI's own clients send: text_generation always sends do_sample false, and TGI samples whenever a
    warper (temperature, top_k, top_p, typical_p) is set (it was greedy: temperature was ignored); SageMaker's
    /invocations answers as / and /ping as /health (vLLM's /version too); huggingface_hub's "dummy" model and its {"type": "json_object", "value": schema}
    response_format (the schema was ignored) and TGI's {"type": "regex"}."""
    from text_generation import Client

    tgi = Client(tiny_stack.url, timeout=60)
    texts = {tgi.generate(PROMPT, max_new_tokens=8, temperature=1.5, seed=s).generated_text for s in range(1, 6)}
    assert len(texts) > 1  # sampled (seeded differently), not greedy
    greedy = {tgi.generate(PROMPT, max_new_tokens=8).generated_text for _ in range(2)}
    assert len(greedy) == 1
    r = httpx.post(tiny_stack.url + "/invocations", timeout=60,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    assert r.status_code == 200 and r.json()[0]["details"]["generated_tokens"] == 3
    for method in ("GET", "POST", "HEAD"):  # SageMaker's health check, where it sends /invocations (vLLM's too)
        r = httpx.request(method, tiny_stack.url + "/ping", timeout=60)
        assert r.status_code == 200 and r.content == b"", (method, r.text)
    r = httpx.get(tiny_stack.url + "/version", timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 12, "seed": 3}
    for form in ({"type": "json_object", "value": schema}, {"type": "json", "value": schema}):
        r = httpx.post(tiny_stack.url + "/v1/chat/completions", timeout=60,
                       json={"model": "dummy", "response_format": form, **chat})
        assert r.status_code == 200 and r.json()["model"] == tiny_stack.model, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert re.match(r'\{\s*"n"\s*:', content), content  # the schema's one key first, even if cut by length
        assert r.json()["choices"][0]["finish_reason"] == "length" or set(json.loads(content)) == {"n"}, content
    r = httpx.post(tiny_stack.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tgi", "response_format": {"type": "regex", "value": "[0-9]{3}"}, **chat})
    assert re.fullmatch("[0-9]{3}", r.json()["choices"][0]["message"]["content"]), r.text
