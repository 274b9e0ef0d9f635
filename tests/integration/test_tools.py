"""The ``openai`` client's tool-call flow against the default model (SmolLM2-135M-Instruct, whose chat template
has no tool support: the tokenizer describes the tools in the Hermes format), unmodified: a forced call
(``required`` or a named function, guaranteed valid by the grammar), streamed or not, the tool's result
sent back, and the final answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.test_openai_api import client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.parametrize("seed", [1, 2])
def test_required_call_then_the_result_then_the_answer(smol_stack, seed):
    api = client(smol_stack)
    first = api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice="required", temperature=0.9, seed=seed, max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for call in calls:
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"} for c in calls)]
    final = api.chat.completions.create(model=smol_stack.model, messages=history, tools=[WEATHER, TIME],
                                        tool_choice="none", temperature=0, max_tokens=30)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_named_function_streams_its_id_and_name_first_then_the_arguments(smol_stack):
    chunks = list(client(smol_stack).chat.completions.create(
        model=smol_stack.model, messages=ASK, tools=[WEATHER, TIME], stream=True, temperature=0.9, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_required_calls_stream_and_auto_answers_parse(smol_stack):
    api = client(smol_stack)
    chunks = list(api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER], stream=True,
                                              tool_choice="required", parallel_tool_calls=False, temperature=0.9,
                                              seed=4, max_tokens=120))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
    streamed = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(streamed), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"  # as the whole answer's
    whole = api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0.9, seed=4, max_tokens=120)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.tool_calls[0].function.arguments == streamed  # the same text, not re-serialized
    auto = api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER], temperature=0,
                                       max_tokens=80)  # the client's default: tool_choice auto
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_partial_call(smol_stack):
    """As OpenAI answers it: finish_reason "length" and the call as far as it came, streamed or not."""
    api = client(smol_stack)
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut = api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                      temperature=0, max_tokens=4)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    chunks = list(api.chat.completions.create(model=smol_stack.model, messages=ASK, tools=[WEATHER],
                                              tool_choice=named, temperature=0, max_tokens=4, stream=True))
    streamed = "".join(delta.function.arguments or "" for c in chunks if c.choices and c.choices[0].delta.tool_calls
                       for delta in c.choices[0].delta.tool_calls)
    assert streamed == call.function.arguments and chunks[-1].choices[0].finish_reason == "length"


def test_a_strict_function_gets_no_undeclared_arguments(smol_stack):
    loose = {**WEATHER["function"]["parameters"]}
    loose.pop("additionalProperties")
    strict = {"type": "function", "function": {**WEATHER["function"], "parameters": loose, "strict": True}}
    answer = client(smol_stack).chat.completions.create(
        model=smol_stack.model, messages=ASK, tools=[strict], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    arguments = json.loads(answer.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, {**loose, "additionalProperties": False})
