"""Anthropic's Messages API through the ``anthropic`` SDK, unmodified, against the default model: text with a
system prompt and stop sequences, the stream's events and final message, a forced tool call, its tool_result
and the final answer, count_tokens equal to the usage the same request reports, greedy text equal to
/v1/chat/completions for the same conversation, and every bad body an Anthropic-shaped 4xx."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.integration.test_openai_api import client as openai_client

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


GREEDY = {"extra_body": {"temperature": 0}}  # the current SDK (2.x) has no temperature argument: older ones and curl send it


def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=60)


def test_text_with_a_system_prompt_equals_the_chat_completion(smol_stack):
    answer = client(smol_stack).messages.create(model=smol_stack.model, max_tokens=24, system=SYSTEM, messages=ASK,
                                                **GREEDY)
    assert answer.type == "message" and answer.role == "assistant" and answer.id.startswith("msg_")
    (block,) = answer.content
    assert block.type == "text" and "Paris" in block.text
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.stop_sequence is None
    chat = openai_client(smol_stack).chat.completions.create(
        model=smol_stack.model, max_tokens=24, **GREEDY, messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert block.text == chat.choices[0].message.content
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                       chat.usage.completion_tokens)


def test_a_stop_sequence_ends_the_answer_and_is_named(smol_stack):
    answer = client(smol_stack).messages.create(model=smol_stack.model, max_tokens=24, system=SYSTEM, messages=ASK,
                                                stop_sequences=["zzz", "Paris"], **GREEDY)
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == "Paris"
    assert "Paris" not in answer.content[0].text


def test_the_stream_gives_the_same_text_and_its_events_in_order(smol_stack):
    api = client(smol_stack)
    with api.messages.stream(model=smol_stack.model, max_tokens=24, system=SYSTEM, messages=ASK, **GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    whole = api.messages.create(model=smol_stack.model, max_tokens=24, system=SYSTEM, messages=ASK, **GREEDY)
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": smol_stack.model, "max_tokens": 8, "messages": ASK, "stream": True}
    with httpx.stream("POST", smol_stack.url + "/v1/messages", json=body, timeout=60) as r:
        names = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_forced_tool_call_its_result_and_the_final_answer(smol_stack):
    api = client(smol_stack)
    first = api.messages.create(model=smol_stack.model, max_tokens=120, messages=[
        {"role": "user", "content": "What is the weather like in Paris today?"}], tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [{"role": "user", "content": "What is the weather like in Paris today?"},
               {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "18 degrees and sunny"}]}]
    final = api.messages.create(model=smol_stack.model, max_tokens=30, messages=history, tools=[WEATHER],
                                tool_choice={"type": "none"}, **GREEDY)
    assert final.content[0].type == "text" and final.content[0].text and final.stop_reason != "tool_use"
    with api.messages.stream(model=smol_stack.model, max_tokens=120, messages=history[:1], tools=[WEATHER],
                             tool_choice={"type": "any"}, **GREEDY) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    jsonschema.validate([b for b in streamed.content if b.type == "tool_use"][0].input, WEATHER["input_schema"])


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(smol_stack):
    """Anthropic's prefill: the assistant's last words are left open (the chat template's continue_final_message)
    and the answer goes on from them, without repeating them; count_tokens counts the same prompt."""
    api = client(smol_stack)
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    answer = api.messages.create(model=smol_stack.model, max_tokens=8, system=SYSTEM, messages=prefill, **GREEDY)
    text = answer.content[0].text
    assert "Paris" in text and not text.lstrip().startswith("The capital"), text
    counted = api.messages.count_tokens(model=smol_stack.model, system=SYSTEM, messages=prefill)
    assert counted.input_tokens == answer.usage.input_tokens
    opened = api.messages.count_tokens(model=smol_stack.model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens > opened.input_tokens  # the prefill's words, without a closed turn


def test_consecutive_turns_of_one_role_are_one_and_replayed_thinking_is_left_out(smol_stack):
    """Anthropic combines consecutive user or assistant messages into one turn (they were two turns of the chat
    template, and only the last assistant message was the prefill), and leaves earlier turns' thinking blocks out
    of the context (they were a 400: clients replaying a conversation with thinking could not continue it)."""
    api = client(smol_stack)

    def count(messages) -> int:
        return api.messages.count_tokens(model=smol_stack.model, system=SYSTEM, messages=messages).input_tokens

    question = ASK[0]["content"]
    one = count([{"role": "user", "content": [{"type": "text", "text": "Hello. "}, {"type": "text", "text": question}]}])
    assert count([{"role": "user", "content": "Hello. "}, {"role": "user", "content": question}]) == one
    prefill = [*ASK, {"role": "assistant", "content": "The capital"}, {"role": "assistant", "content": " of France is"}]
    whole = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    assert count(prefill) == count(whole)
    answer = api.messages.create(model=smol_stack.model, max_tokens=8, system=SYSTEM, messages=prefill, **GREEDY)
    assert answer.content[0].text == api.messages.create(model=smol_stack.model, max_tokens=8, system=SYSTEM,
                                                         messages=whole, **GREEDY).content[0].text
    thought = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "France's capital...", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "ZGF0YQ=="}, {"type": "text", "text": "Paris."}]},
        {"role": "user", "content": "And of Spain?"}]
    plain = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    assert count(thought) == count(plain)
    assert api.messages.create(model=smol_stack.model, max_tokens=8, system=SYSTEM, messages=thought,
                               **GREEDY).usage.input_tokens == count(plain)


def test_a_forced_tool_call_cut_by_max_tokens_ends_with_its_incomplete_tool_use(smol_stack):
    """A call forced by tool_choice "any" and cut by max_tokens ends the answer as Anthropic's does: with its
    incomplete tool_use block (its docs: retry with a higher max_tokens), the body's input the object its JSON
    begins, as the SDK reads the stream's input_json_delta; the grammar's JSON never reaches the user as text."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, max_tokens=12, tools=[WEATHER], tool_choice={"type": "any"}, **GREEDY,
               messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    whole = api.messages.create(**ask)
    with api.messages.stream(**ask) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert len(deltas) > 1  # the arguments streamed as they were made
    for answer in (whole, streamed):
        assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 12
        (use,) = answer.content
        assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    assert whole.content[0].input == streamed.content[0].input


def test_with_tools_declared_text_streams_as_it_is_made(smol_stack):
    """Agent clients always declare tools: the answer's text streams token by token all the same (it was held
    to the end and sent as one delta), and the stream's final message is the body."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, max_tokens=16, tools=[WEATHER], system=SYSTEM, **GREEDY,
               messages=[{"role": "user", "content": "Tell me a story about a cat."}])
    whole = api.messages.create(**ask)
    with api.messages.stream(**ask) as s:
        pieces = list(s.text_stream)
        streamed = s.get_final_message()
    assert whole.content[0].type == "text" and len(pieces) > 4
    assert "".join(pieces) == streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason


def test_an_empty_answer_has_no_content_and_continues_as_a_conversation(smol_stack):
    """A stop sequence at the first token: no content blocks (an empty text block is no valid input, here as at
    Anthropic), streamed or not, and the conversation goes on from it."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, max_tokens=10, messages=ASK, stop_sequences=["The"], **GREEDY)
    whole = api.messages.create(**ask)
    with api.messages.stream(**ask) as s:
        streamed = s.get_final_message()
    for answer in (whole, streamed):
        assert answer.content == [] and answer.stop_reason == "stop_sequence" and answer.stop_sequence == "The"
    history = [*ASK, {"role": "assistant", "content": whole.content or "..."}, {"role": "user", "content": "Go on."}]
    assert api.messages.create(model=smol_stack.model, max_tokens=3, messages=history, **GREEDY).usage.output_tokens


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_count_tokens_equals_the_requests_input_tokens(smol_stack, tools):
    api = client(smol_stack)
    extra = {"tools": [WEATHER]} if tools else {}
    counted = api.messages.count_tokens(model=smol_stack.model, system=SYSTEM, messages=ASK, **extra)
    answer = api.messages.create(model=smol_stack.model, max_tokens=1, system=SYSTEM, messages=ASK, **extra)
    assert counted.input_tokens == answer.usage.input_tokens > 10


@pytest.mark.parametrize("body, status, named", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ({"max_tokens": 5, "messages": []}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": ""}]}, 400, "non-empty"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, 400, "non-empty"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}, *ASK]}, 400, "non-empty content"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 5, "messages": ASK, "model": "no-such-model"}, 404, "no-such-model"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, "document"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "disabled"}, "metadata": {"user_id": "u", "foo": 1}},
     400, "metadata.foo"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "Let me check."}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "sunny"}]}]}, 400, "toolu_nope"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER, WEATHER]}, 400, "tools.1.name 'get_weather' is declared twice"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400,
     "tools.0.input_schema.type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "type custom"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, 400, "stop_sequences"),
    ({"max_tokens": 5, "messages": ASK, "service_tier": "priority"}, 400, "service_tier"),
    ({"max_tokens": 5, "messages": ASK, "top_k": -1}, 400, "top_k"),
    ({"max_tokens": 5, "messages": ASK, "top_k": False}, 400, "top_k"),
    ({"max_tokens": 5, "messages": ASK, "top_k": 0.0}, 400, "top_k"),
    ({"max_tokens": 5, "messages": ASK, "metadata": {"user_id": "u" * 257}}, 400, "metadata.user_id"),
    ({"max_tokens": 5, "messages": ASK, "system": [{"type": "text", "text": ""}]}, 400, "non-empty"),
    ({"max_tokens": 5, "tools": [WEATHER], "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}, {"role": "user", "content": "ok?"}]},
     400, "toolu_1"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]}, 400, "must define tools"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "Sure "}]}, 400,
     "final assistant content cannot end with trailing whitespace"),  # Anthropic's rule
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]},
                                    {"role": "user", "content": "go on"}]}, 400, "messages.1.content.0.thinking"),
])
def test_bad_bodies_get_anthropic_shaped_4xx(tiny_stack, body, status, named):
    r = httpx.post(tiny_stack.url + "/v1/messages", json={"model": tiny_stack.model, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and named in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_fields_at_the_values_that_change_nothing_are_taken(tiny_stack):
    """SDK wrappers send ``thinking: disabled`` and ``service_tier: auto``; count_tokens names its own fields."""
    answer = client(tiny_stack).messages.create(model=tiny_stack.model, max_tokens=1, messages=ASK, service_tier="auto",
                                                thinking={"type": "disabled"})
    assert answer.usage.output_tokens == 1
    r = httpx.post(tiny_stack.url + "/v1/messages/count_tokens", timeout=30,
                   json={"model": tiny_stack.model, "messages": ASK, "max_tokens": 5})
    assert r.status_code == 400
    assert "count_tokens takes messages, model, system, tool_choice, tools" in r.json()["error"]["message"]


def test_the_sdk_raises_its_own_errors_and_bad_json_is_a_400(tiny_stack):
    api = client(tiny_stack)
    with pytest.raises(anthropic.BadRequestError):
        api.messages.create(model=tiny_stack.model, max_tokens=5, messages=[{"role": "system", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        api.messages.create(model="nope", max_tokens=5, messages=ASK)
    r = httpx.post(tiny_stack.url + "/v1/messages", content=b"{oops", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(tiny_stack.url + "/v1/messages", timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    assert json.loads(httpx.post(tiny_stack.url + "/v1/messages/count_tokens", json={"model": tiny_stack.model},
                                 timeout=30).text)["type"] == "error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    r = httpx.post(tiny_stack.url + "/v1/messages/count_tokens", timeout=30, json={
        "model": tiny_stack.model, "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]  # a text-only model takes none


def test_the_sdk_lists_and_retrieves_models_in_anthropics_shape(tiny_stack):
    api = client(tiny_stack)
    page = api.models.list()
    assert [m.id for m in page.data] == [tiny_stack.model] and page.has_more is False
    model = api.models.retrieve(tiny_stack.model)
    assert model.type == "model" and model.display_name == tiny_stack.model and model.created_at.year >= 2026
    with pytest.raises(anthropic.NotFoundError):
        api.models.retrieve("no-such-model")
    assert httpx.get(tiny_stack.url + "/v1/models", timeout=30).json()["object"] == "list"  # OpenAI's, without the header
