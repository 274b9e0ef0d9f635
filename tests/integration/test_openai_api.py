"""The OpenAI family through the real `openai` client and raw HTTP (tiny random model; two smol tests)."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.integration.stack import sse_events

MESSAGES = [{"role": "user", "content": "My name is Olivier and I"}]
PROMPT = "My name is Olivier and I"
GREEDY = {"temperature": 0, "max_tokens": 8}

CHAT_KEYS = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "stop_reason"}
CHUNK_CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason", "stop_reason"}
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)


def post(stack, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(stack.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def stream_payloads(r: httpx.Response) -> list[dict]:
    """SSE payloads before the final ``data: [DONE]``, which must be the last event."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
    return sse_events(r.text[: -len("data: [DONE]\n\n")])


def chat(stack, **body) -> dict:
    r = post(stack, "/v1/chat/completions", {"model": stack.model, "messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


def complete(stack, **body) -> dict:
    r = post(stack, "/v1/completions", {"model": stack.model, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_usage(usage: dict) -> None:
    assert set(usage) == USAGE_KEYS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_models_list_and_retrieve(tiny_stack):
    r = httpx.get(tiny_stack.url + "/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"object", "data"} and body["object"] == "list"
    (card,) = body["data"]
    assert card == {"id": tiny_stack.model, "object": "model", "created": card["created"], "owned_by": "MindIE Server",
                    "root": card["root"], "parent": None, "max_model_len": 2560, "dtype": "float32",
                    "quantization": "none", "kv_cache_dtype": "float32"}  # MindIE's, vLLM's root/parent/max_model_len,
    # then ours; root: the configured weights
    assert card["root"] == json.loads(tiny_stack.config_path.read_text())["BackendConfig"]["ModelDeployConfig"][
        "ModelConfig"][0]["modelWeightPath"]
    assert time.time() - 3600 < card["created"] <= time.time()
    assert httpx.get(f"{tiny_stack.url}/v1/models/{tiny_stack.model}").json() == card
    api = client(tiny_stack)
    assert [m.id for m in api.models.list()] == [tiny_stack.model]
    assert api.models.retrieve(tiny_stack.model).owned_by == "MindIE Server"
    with pytest.raises(openai.NotFoundError) as err:
        api.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_chat_body_shape(tiny_stack):
    body = chat(tiny_stack, **GREEDY)
    assert set(body) == CHAT_KEYS
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == tiny_stack.model and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == CHAT_CHOICE_KEYS and choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None,
                                 "tool_calls": []}
    assert choice["finish_reason"] in ("stop", "length")
    check_usage(body["usage"])
    assert 0 < body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 8  # template added


def test_chat_with_the_client_sync_and_stream(tiny_stack):
    api = client(tiny_stack)
    done = api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, **GREEDY)
    text = done.choices[0].message.content
    assert text and done.usage.completion_tokens <= 8
    again = api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, **GREEDY)
    assert again.choices[0].message.content == text
    chunks = list(api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == done.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_framing_and_usage_placement(tiny_stack):
    body = {"model": tiny_stack.model, "messages": MESSAGES, "stream": True, **GREEDY}
    events = stream_payloads(post(tiny_stack, "/v1/chat/completions", body))
    for event in events:
        assert set(event) - {"usage"} == CHAT_KEYS - {"usage"}
        assert set(event["choices"][0]) == CHUNK_CHOICE_KEYS
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in e for e in events[:-1])  # without include_usage: only the last chunk has usage
    check_usage(events[-1]["usage"])
    with_usage = stream_payloads(post(tiny_stack, "/v1/chat/completions",
                                      {**body, "stream_options": {"include_usage": True}}))
    assert all(e["usage"] is None for e in with_usage[:-1])
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"] == events[-1]["usage"]
    assert with_usage[-1]["usage"] == chat(tiny_stack, **GREEDY)["usage"]


async def test_async_client_stream_with_include_usage(tiny_stack):
    api = openai.AsyncOpenAI(base_url=tiny_stack.url + "/v1", api_key="x", max_retries=0)
    stream = await api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    assert all(c.usage is None for c in chunks[:-1])
    await api.close()


def test_n_choices_sample_differently_and_count_usage(tiny_stack):
    api = client(tiny_stack)
    done = api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, n=2, max_tokens=8, seed=3)
    assert [c.index for c in done.choices] == [0, 1]
    assert done.choices[0].message.content != done.choices[1].message.content
    again = api.chat.completions.create(model=tiny_stack.model, messages=MESSAGES, n=2, max_tokens=8, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in done.choices]
    single = chat(tiny_stack, max_tokens=8)
    assert done.usage.prompt_tokens == single["usage"]["prompt_tokens"]  # the prompt is counted once
    events = stream_payloads(post(tiny_stack, "/v1/chat/completions", {
        "model": tiny_stack.model, "messages": MESSAGES, "n": 2, "max_tokens": 8, "seed": 3, "stream": True}))
    texts = {0: "", 1: ""}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"]["content"]
    assert [texts[0], texts[1]] == [c.message.content for c in done.choices]
    assert sum(1 for e in events for c in e["choices"] if c["finish_reason"]) == 2


def test_chat_logprobs(tiny_stack):
    done = client(tiny_stack).chat.completions.create(
        model=tiny_stack.model, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert "".join(entry.token for entry in content) == done.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy takes the top
    raw = chat(tiny_stack, logprobs=True, **GREEDY)["choices"][0]["logprobs"]["content"][0]
    assert set(raw) == {"token", "logprob", "bytes", "top_logprobs"}
    assert raw["top_logprobs"] == []


def test_stop_strings_cut_the_text(tiny_stack):
    seeded = {"seed": 11, "max_tokens": 16}  # greedy chat on the random model is only newlines
    text = chat(tiny_stack, **seeded)["choices"][0]["message"]["content"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"noise text too short to pick a stop string from: {text!r}"
    done = client(tiny_stack).chat.completions.create(model=tiny_stack.model, messages=MESSAGES, stop=stop,
                                                      **seeded)
    assert done.choices[0].message.content == text[: text.index(stop)]
    assert done.choices[0].finish_reason == "stop"
    kept = chat(tiny_stack, stop=[stop], include_stop_str_in_output=True, **seeded)
    assert kept["choices"][0]["message"]["content"] == text[: text.index(stop) + len(stop)]
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": PROMPT, "stream": True, "stop": stop, **seeded}))
    full = complete(tiny_stack, **seeded)["choices"][0]["text"]
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    assert stop not in streamed and full.startswith(streamed)


def test_stop_reason_names_the_stop_string_or_token_id_that_ended_the_answer(tiny_stack):
    """vLLM's ``stop_reason`` beside a completion's finish_reason, whole and streamed: the stop string, the
    stop_token_ids id the answer ended on, or null (the limit). (Chat choices keep MindIE's keys.)"""
    seeded = {"seed": 11, "max_tokens": 16, "logprobs": 1}
    first = complete(tiny_stack, **seeded)["choices"][0]
    assert first["finish_reason"] == "length" and first["stop_reason"] is None
    text = first["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"noise text too short to pick a stop string from: {text!r}"
    choice = complete(tiny_stack, **seeded, stop=[stop])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": PROMPT, "stream": True, "stop": [stop], **seeded}))
    assert [c["stop_reason"] for e in events for c in e["choices"]][-1] == stop
    fifth = tokenizer_ids(tiny_stack, first)[4]
    choice = complete(tiny_stack, **seeded, stop_token_ids=[fifth])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", fifth)
    # the stop token's text stays out of the answer, as vLLM leaves it, unless include_stop_str_in_output
    assert choice["text"] == "".join(first["logprobs"]["tokens"][:4])
    kept = complete(tiny_stack, **seeded, stop_token_ids=[fifth], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == "".join(first["logprobs"]["tokens"][:5])


def tokenizer_ids(stack, choice: dict) -> list[int]:
    """The generated tokens' ids of a completion choice with logprobs (``token_ids:<id>`` is not asked: its
    tokens are rendered text), through /tokenize of each token's text."""
    return [post(stack, "/tokenize", {"prompt": t, "add_special_tokens": False}).json()["tokens"][0]
            for t in choice["logprobs"]["tokens"]]


def test_chat_equals_completions_on_the_rendered_prompt(tiny_stack, smol_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    by_chat = chat(tiny_stack, temperature=0, max_tokens=12)
    by_completion = complete(tiny_stack, prompt=ids, temperature=0, max_tokens=12)
    assert by_completion["choices"][0]["text"] == by_chat["choices"][0]["message"]["content"]
    assert by_completion["usage"] == by_chat["usage"]


def test_completions_with_the_client_sync_and_stream(tiny_stack):
    api = client(tiny_stack)
    done = api.completions.create(model=tiny_stack.model, prompt=PROMPT, **GREEDY)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    text = done.choices[0].text
    chunks = list(api.completions.create(model=tiny_stack.model, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == done.usage.total_tokens
    body = complete(tiny_stack, **GREEDY)
    assert set(body) == CHAT_KEYS and set(body["choices"][0]) == COMPLETION_CHOICE_KEYS
    assert body["choices"][0]["text"] == text
    echoed = complete(tiny_stack, echo=True, **GREEDY)
    assert echoed["choices"][0]["text"] == PROMPT + text
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": PROMPT, "stream": True, "echo": True,
        "stream_options": {"include_usage": True}, **GREEDY}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT + text
    assert events[-1]["choices"] == [] and events[-1]["usage"] == done.usage.model_dump(exclude_none=True)


def test_completion_prompt_forms_and_choice_order(tiny_stack):
    first = complete(tiny_stack, **GREEDY)["choices"][0]["text"]
    second = complete(tiny_stack, prompt="Hello there", **GREEDY)["choices"][0]["text"]
    both = complete(tiny_stack, prompt=[PROMPT, "Hello there"], **GREEDY)
    assert [c["text"] for c in both["choices"]] == [first, second]
    assert [c["index"] for c in both["choices"]] == [0, 1]
    sampled = complete(tiny_stack, prompt=[PROMPT, "Hello there"], n=2, max_tokens=4, seed=5)
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2, 3]
    assert sampled["usage"]["completion_tokens"] <= 16
    ids = [5965, 1462, 314, 11256, 380, 1153, 284, 339]  # PROMPT tokenized
    assert complete(tiny_stack, prompt=ids, **GREEDY)["choices"][0]["text"] == first
    assert complete(tiny_stack, prompt=ids, echo=True, **GREEDY)["choices"][0]["text"] == PROMPT + first
    two = complete(tiny_stack, prompt=[ids, ids[:4]], **GREEDY)
    assert two["choices"][0]["text"] == first and len(two["choices"]) == 2
    assert two["usage"]["prompt_tokens"] == 12


def test_completion_logprobs(tiny_stack):
    done = client(tiny_stack).completions.create(model=tiny_stack.model, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert all(2 <= len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    raw = complete(tiny_stack, logprobs=0, **GREEDY)["choices"][0]["logprobs"]
    assert set(raw) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(len(top) == 1 for top in raw["top_logprobs"])


def test_logprobs_name_each_tokens_own_text_when_a_stop_string_holds_text_back(smol_stack):
    """While a stop string may be forming, text is released on later tokens; the logprobs still name each
    token's own text (as OpenAI's and vLLM's), the chosen token is its own single top entry, and the offsets
    run over those texts. (Greedy: "Paris is the capital of France, a country in Western Europe...".)"""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, prompt="Paris is the capital of France, a country in", logprobs=1,
               temperature=0, max_tokens=12)
    free = api.completions.create(**ask).choices[0]
    cut = api.completions.create(**ask, stop=["Europe"]).choices[0]
    assert "Europe" in free.text and cut.text == free.text[:free.text.index("Europe")]
    lp = cut.logprobs
    assert lp.tokens == free.logprobs.tokens[:len(lp.tokens)] and len(lp.tokens) >= 2
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    chat = dict(model=smol_stack.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                logprobs=True, top_logprobs=1, temperature=0, max_tokens=12)
    free = [e.token for e in api.chat.completions.create(**chat).choices[0].logprobs.content]
    assert "Paris" in "".join(free)
    entries = api.chat.completions.create(**chat, stop=["Paris"]).choices[0].logprobs.content
    assert [e.token for e in entries] == free[:len(entries)] and len(entries) >= 3
    assert all(e.top_logprobs[0].token == e.token and bytes(e.bytes) == e.token.encode() for e in entries)


async def test_disconnect_mid_stream_frees_the_engine(tiny_stack):
    body = {"model": tiny_stack.model, "messages": MESSAGES, "max_tokens": 2000, "temperature": 0.8, "n": 2,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", tiny_stack.url + "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break
    info = await tiny_stack.wait_engine_idle()
    assert (info.running, info.waiting, info.free_blocks) == (0, 0, info.total_blocks)
    assert chat(tiny_stack, **GREEDY)["choices"][0]["message"]["content"]


def test_smol_answers_paris_through_chat(smol_stack):
    done = client(smol_stack).chat.completions.create(
        model=smol_stack.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=20)
    assert "Paris" in done.choices[0].message.content


def test_smol_greedy_completion_matches_the_known_continuation(smol_stack):
    done = client(smol_stack).completions.create(model=smol_stack.model, prompt=PROMPT, temperature=0, max_tokens=20)
    assert done.choices[0].text == \
        "'m here to help you with your business. I'll be your go-to person to ensure your"


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(tiny_stack):
    """OpenAI's prompt_tokens_details.cached_tokens: whole blocks of a prompt seen before (the shipped config
    caches prefixes in blocks of 16), none for a new one; the openai client reads it."""
    prompt = " ".join(f"w{i}" for i in range(20))  # the tiny stack takes prompts of at most 64 tokens
    first = complete(tiny_stack, prompt=prompt, max_tokens=2, temperature=0)
    again = complete(tiny_stack, prompt=prompt, max_tokens=2, temperature=0)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < again["usage"]["prompt_tokens"]
    api = openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="x", max_retries=0)
    chat = [{"role": "user", "content": " ".join(prompt.split()[:6])}]  # the template adds a system prompt
    api.chat.completions.create(model=tiny_stack.model, messages=chat, max_tokens=2)
    done = api.chat.completions.create(model=tiny_stack.model, messages=chat, max_tokens=2)
    assert done.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_logprobs_bytes_are_each_tokens_own(smol_stack):
    """A character spread over several tokens (an emoji is 4 bytes, byte-level BPE gives them 2-3 tokens): each
    token's entry has its own bytes even while its text is still empty, so the entries' bytes joined are the
    content's UTF-8 (OpenAI's reading); the tokens' texts still add up to the content."""
    answer = chat(smol_stack, messages=[{"role": "user", "content": "Repeat exactly: 🙂😀🎉 日本"}], temperature=0,
                  max_tokens=24, logprobs=True, top_logprobs=2)["choices"][0]
    content, entries = answer["message"]["content"], answer["logprobs"]["content"]
    assert any(ord(c) > 0xFFFF for c in content), content  # an emoji in the answer: 4-byte characters
    assert bytes(b for e in entries for b in e["bytes"]) == content.encode("utf-8")
    assert "".join(e["token"] for e in entries) == content
    assert any(e["token"] == "" and e["bytes"] for e in entries)  # part of a character: bytes, no text yet
    for e in entries:
        assert all(isinstance(t["bytes"], list) for t in e["top_logprobs"])


def test_vllms_guided_decoding_fields_hold_the_output(tiny_stack):
    """guided_choice, guided_regex, guided_json and structured_outputs (vLLM's) constrain chat, completions and
    vLLM /generate through the grammar engine; two ways at once, a bad grammar and a field not honoured here are
    400s naming them."""
    seeded = {"seed": 5, "max_tokens": 12}
    choice = complete(tiny_stack, guided_choice=["yes", "no"], **seeded)["choices"][0]["text"]
    assert choice in ("yes", "no"), choice
    digits = chat(tiny_stack, guided_regex="[0-9]{3}", **seeded)["choices"][0]["message"]["content"]
    assert re.fullmatch("[0-9]{3}", digits), digits
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = json.loads(chat(tiny_stack, guided_json=schema, **{**seeded, "max_tokens": 24})["choices"][0]["message"][
        "content"])
    assert isinstance(answer["ok"], bool)
    picked = complete(tiny_stack, structured_outputs={"choice": ["left", "right"]}, **seeded)["choices"][0]["text"]
    assert picked in ("left", "right"), picked
    for grammar in ('start: "up" | "down"', 'root ::= "up" | "down"'):  # Lark, and GBNF as vLLM's docs write it
        said = chat(tiny_stack, guided_grammar=grammar, **seeded)["choices"][0]["message"]["content"]
        assert said in ("up", "down"), (grammar, said)
    generated = post(tiny_stack, "/generate", {"prompt": PROMPT, "guided_regex": "[a-c]{4}", "max_tokens": 8,
                                               "seed": 5}).json()["text"][0]
    assert re.fullmatch("[a-c]{4}", generated[len(PROMPT) + 1:]), generated
    for body, param in (({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice"),
                        ({"guided_regex": "("}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
                        ({"guided_grammar": 'root ::= "up'}, "guided_grammar"),
                        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
                         "response_format"),
                        ({"logits_processors": ["my.module:Processor"]}, "logits_processors")):
        r = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": PROMPT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

