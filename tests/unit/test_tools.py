"""Tool calling's pure parts: the request's tools and tool_choice, the grammar for required and named
functions, reading calls out of whole answers and streams (``services/gateway/openai_api/tools.py``), and
rendering a chat with tools through chat templates with and without tool support
(``services/tokenizer/tools.py``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from services.gateway.openai_api.errors import OpenAIError
from services.gateway.openai_api.tools import ToolStream, extract, parse_tools
from services.tokenizer.tools import with_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}, "required": ["zone"]}}}


def tools(**data):
    return parse_tools({"tools": [WEATHER, TIME], **data})


@pytest.mark.parametrize("data, param", [
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(data, param):
    with pytest.raises(OpenAIError) as err:
        parse_tools(data)
    assert err.value.param == param


def test_choices_and_their_grammars():
    assert tools().choice == "auto" and tools().grammar() is None
    assert parse_tools({"tools": []}) is None and parse_tools({}) is None
    named = tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.named) == ("named", "get_time")
    assert json.loads(named.grammar().value) == TIME["function"]["parameters"]
    by_name = tools(tool_choice="get_time")  # TGI's form (its client types tool_choice as a string)
    assert (by_name.choice, by_name.named) == ("named", "get_time")
    required = json.loads(tools(tool_choice="required", parallel_tool_calls=False).grammar().value)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2


def test_whole_answers():
    content, calls = extract(tools(tool_choice="required"),
                             '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                             '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    named = tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert extract(named, '{"zone": "UTC"}')[1][0]["function"]["arguments"] == '{"zone": "UTC"}'
    auto = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = extract(tools(), auto)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert extract(tools(), "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>")[1] == []
    assert extract(tools(tool_choice="none"), auto) == (auto, [])


def replay(stream: ToolStream, text: str, size: int) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` in pieces; (content, calls by index with their arguments joined)."""
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces):
        delta, deltas = stream.feed(piece, n == len(pieces) - 1)
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": d.get("id"), "name": d.get("function", {}).get("name"),
                                                  "arguments": ""})
            assert d.get("id") is None or call["id"] == d["id"]
            call["arguments"] += d["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streams_give_ids_and_names_first_then_arguments(size):
    required = '[{"name": "get_weather", "arguments": {"city": "Pa{r}is \\"x\\""}}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    content, calls = replay(ToolStream(tools(tool_choice="required")), required, size)
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": 'Pa{r}is "x"'}, {"zone": "CET"}]
    named = tools(tool_choice={"type": "function", "function": {"name": "get_time"}})
    content, calls = replay(ToolStream(named), '{"zone": "UTC"}', size)
    assert calls[0]["name"] == "get_time" and calls[0]["arguments"] == '{"zone": "UTC"}'
    text = 'Sure <tool_ <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> done <tool'
    content, calls = replay(ToolStream(tools()), text, size)
    assert content == "Sure <tool_  done <tool" and json.loads(calls[0]["arguments"]) == {"city": "Rome"}


def test_a_template_without_tool_support_gets_them_described(smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    messages, extra = with_tools(tokenizer, history, [WEATHER], "auto")
    assert extra == {} and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and "<tool_response>" in text


def test_a_template_with_tool_support_gets_them_as_they_are(smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\\n{% endfor %}{% for m in messages %}"
        "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
        "</tool_call>{% endfor %}\\n{% endfor %}")
    history = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    messages, extra = with_tools(tokenizer, history, [WEATHER], "auto")
    text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
    assert text.startswith("TOOL get_weather") and '"arguments": {"city": "Paris"}' in text
    tokenizer.chat_template = "{% for t in tools %}<fn>{% endfor %}{{ messages[0].content }}"  # a format not parsed
    with pytest.raises(Exception, match="tool_choice auto"):
        with_tools(tokenizer, [{"role": "user", "content": "x"}], [WEATHER], "auto")
    assert with_tools(tokenizer, [{"role": "user", "content": "x"}], [WEATHER], "required")[1] == {"tools": [WEATHER]}
    jsonschema.Draft202012Validator.check_schema(WEATHER["function"]["parameters"])


@pytest.mark.parametrize("fmt, text", [
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}};'
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_mistral_and_llama3_formats_whole_and_streamed(fmt, text, size):
    content, calls = extract(tools(), text, fmt)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    content, streamed = replay(ToolStream(tools(), fmt), text, size)
    assert content == "" and [c["name"] for c in streamed.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in streamed.values()] == [{"city": "Rome"}, {"zone": "CET"}]
    prose = "The weather in Rome is sunny {mostly}."
    assert extract(tools(), prose, fmt) == (prose, [])
    assert replay(ToolStream(tools(), fmt), prose, size) == (prose, {})


def test_the_tool_format_is_read_off_the_chat_template(smol_dir):
    from services.tokenizer.tools import tool_format

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    assert tool_format(tokenizer) == "hermes"  # no tool support: the format the tokenizer describes
    for template, fmt in (("{{ tools }}<tool_call>", "hermes"), ("{{ tools }}[TOOL_CALLS]", "mistral"),
                          ("{{ tools }}<|python_tag|>", "llama3_json"), ("{{ tools }}<fn>", "")):
        tokenizer.chat_template = template
        assert tool_format(tokenizer) == fmt


def test_a_forced_call_cut_short_is_a_partial_call():
    """What OpenAI returns with finish_reason "length": the call as far as it came, never the raw JSON as content
    (by max_tokens, or by a stop sequence); finished calls keep their whole arguments."""
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, (call,) = extract(named, '{"city": "Par')
    assert content is None and call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    required = tools(tool_choice="required")
    cut = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zo'
    content, calls = extract(required, cut)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"zo']
    content, calls = extract(required, '[{"name":"get_weather","arguments":{"city":"Paris"}},{"')  # the next one begun
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city":"Paris"}']
    assert extract(required, '[{"name": "get_wea') == (None, [])  # no whole name yet


def test_a_cut_answer_is_the_calls_its_stream_sent():
    """Cut after any character, a required answer's calls read whole equal what its stream sent."""
    required = tools(tool_choice="required")
    answer = '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, {"a": 2}]}},{"name":"get_time","arguments":{}}]'
    for n in range(len(answer) + 1):
        stream, sent = ToolStream(required), {}
        for i in range(0, n, 3):
            for delta in stream.feed(answer[i:min(i + 3, n)], final=False)[1]:
                call = sent.setdefault(delta["index"], {"name": delta["function"].get("name"), "arguments": ""})
                call["arguments"] += delta["function"].get("arguments", "")
        content, calls = extract(required, answer[:n])
        assert content is None
        assert [c["function"] | {} for c in calls] == [{"name": c["name"], "arguments": c["arguments"]}
                                                        for _, c in sorted(sent.items())], n


def test_strict_functions_take_no_undeclared_keys():
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    named = parse_tools({"tools": [strict, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    schema = json.loads(named.grammar().value)
    assert schema["additionalProperties"] is False
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "country": "France"}, schema)
    loose = json.loads(tools(tool_choice={"type": "function", "function": {"name": "get_weather"}}).grammar().value)
    assert "additionalProperties" not in loose  # without strict, the declared schema as it is
    required = json.loads(parse_tools({"tools": [strict, TIME], "tool_choice": "required"}).grammar().value)
    weather, time_ = (c["properties"]["arguments"] for c in required["items"]["anyOf"])
    assert weather["additionalProperties"] is False and "additionalProperties" not in time_
    assert named.declared[0]["function"] == WEATHER["function"]  # the template sees the declaration unchanged


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_without_parallel_tool_calls_an_auto_answer_makes_one_call(size):
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    assert len(extract(tools(), two)[1]) == 2
    content, calls = extract(tools(parallel_tool_calls=False), two)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    content, streamed = replay(ToolStream(tools(parallel_tool_calls=False)), two, size)
    assert content.strip() == "" and [c["name"] for c in streamed.values()] == ["get_weather"]


def test_a_strict_response_format_closes_its_objects_as_strict_tools_do():
    from services.gateway.openai_api.response_format import response_format

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}},
              "patternProperties": {"^x": {"type": "object"}}}
    strict = json.loads(response_format({"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": schema}}).value)
    assert strict["additionalProperties"] is False and strict["properties"]["a"]["additionalProperties"] is False
    assert strict["patternProperties"]["^x"]["additionalProperties"] is False
    loose = json.loads(response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).value)
    assert loose == schema
