"""Anthropic's Messages request, read into the chat request the OpenAI routes run.

The conversation becomes the OpenAI chat messages ``/v1/chat/completions`` would get for it (``system`` the
first message, text blocks the content, ``image`` blocks image parts through the same media checks,
``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages), and the tools
and ``tool_choice`` (``auto``, ``any`` → required, ``tool`` → named, ``none``) OpenAI's; so the model sees
exactly what a chat completion of the same conversation shows it. A last message of the assistant's is a
prefill: its turn is left open and the answer continues it (vLLM's continue_final_message); it may not end in
whitespace (Anthropic's 400). Consecutive messages of one role are one turn, as Anthropic combines them; the
``thinking`` and ``redacted_thinking`` blocks a client sends back in assistant turns are left out, as Anthropic
leaves earlier turns' thinking out of the context. Empty text is a 400, in Anthropic's words. A field the server
cannot honour (``thinking`` enabled, ``container``, …) is a 400 naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from services.gateway.anthropic.errors import invalid
from services.gateway.common.content import ListInput
from services.gateway.common.served import Served
from services.gateway.openai_api.params import Common, parse_common
from services.gateway.openai_api.schemas import chat_messages
from services.gateway.openai_api.tools import Tools, parse_tools
from services.gateway.web.validation import parse_json_object
from shared.config import Config
from shared.errors import SwitchboardError

PARSE_ERROR = "The request body must be a JSON object."
FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "metadata", "tools", "tool_choice", "stream",
          "temperature", "top_p", "top_k"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice"}
# Fields taken at the values that change nothing here (SDK wrappers send them): anything else is a 400 naming them.
AT_DEFAULT = {"thinking": ({"type": "disabled"},), "service_tier": ("auto", "standard_only")}
# a chat field's name (the start of a parameter's path, as the chat checks name it) as Anthropic's request names it
CHAT_NAMES = [(re.compile(r"^stop\b"), "stop_sequences"),
              (re.compile(r"^tools\[(\d+)\]\.function\.parameters\b"), r"tools.\1.input_schema"),
              (re.compile(r"^tools\[(\d+)\](\.function)?"), r"tools.\1"),
              (re.compile(r"^tool_choice\.function\b"), "tool_choice")]


@dataclass(frozen=True)
class MessagesRequest:
    common: Common
    messages: list[dict[str, Any]]  # as /v1/chat/completions reads them
    listed: tuple[ListInput, ...]
    tools: Tools | None
    prefill: bool = False  # the last message is the assistant's words: the answer continues them

    @property
    def turn(self) -> dict[str, bool]:
        """How the rendered conversation ends: the assistant's turn opened, or its prefill left open."""
        return {"add_generation_prompt": not self.prefill, "continue_final_message": self.prefill}


def parse_messages(body: bytes, cfg: Config, served: Served, counting: bool = False) -> MessagesRequest:
    """``counting``: a count_tokens body (no max_tokens, no sampling)."""
    data = parse_json_object(body, PARSE_ERROR)
    taken = COUNT_FIELDS if counting else FIELDS
    unknown = sorted(key for key in set(data) - taken if data[key] not in AT_DEFAULT.get(key, ()))
    if unknown:
        raise invalid(f"{', '.join(unknown)}: not supported by this server "
                      f"({'count_tokens takes' if counting else 'it takes'} {', '.join(sorted(taken))}).")
    try:
        return _parse(data, cfg, served, counting)
    except SwitchboardError as exc:
        if not exc.param or exc.param.startswith("messages"):
            raise
        name = anthropic_name(exc.param)
        raise SwitchboardError(exc.kind, exc.message.replace(exc.param, name), name) from None


def anthropic_name(param: str) -> str:
    """The Anthropic field a chat check's ``param`` names (``stop`` is ``stop_sequences``, ``tools[0].function``
    is ``tools.0``)."""
    for pattern, name in CHAT_NAMES:
        param = pattern.sub(name, param)
    return param


def _parse(data: dict[str, Any], cfg: Config, served: Served, counting: bool) -> MessagesRequest:
    if not counting and data.get("max_tokens") is None:
        raise invalid("max_tokens: Field required")
    temperature = data.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise invalid(f"temperature: must be between 0 and 1, got {temperature}")
    _check_metadata(data.get("metadata"))
    top_k = data.get("top_k")
    if _is_int(top_k) and top_k < 0:
        raise invalid(f"top_k: Input should be greater than or equal to 0, got {top_k}")
    chat = {"model": data.get("model"), "max_tokens": 1 if counting else data.get("max_tokens"),
            "stream": data.get("stream"), "temperature": temperature, "top_p": data.get("top_p"),
            "top_k": -1 if _is_int(top_k) and top_k == 0 else top_k, "stop": _stop_sequences(data.get("stop_sequences")),
            **_tools(data.get("tools"), data.get("tool_choice"))}
    common = parse_common({k: v for k, v in chat.items() if v is not None}, cfg, served, None, chat=True)
    tools = parse_tools(chat)
    grammar = tools.grammar() if tools is not None else None
    if grammar is not None:  # "any" or a named tool: the output is the call, constrained as a chat's is
        common = replace(common, sampling=msgspec.structs.replace(common.sampling, grammar=grammar))
    messages, listed = chat_messages(openai_messages(data.get("system"), data.get("messages")))
    if tools is None and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        raise invalid("Requests which include `tool_use` or `tool_result` blocks must define tools.")
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last["content"]) and not last.get("tool_calls")
    if prefill and isinstance(last["content"], str) and last["content"] != last["content"].rstrip():
        raise invalid("messages: final assistant content cannot end with trailing whitespace")  # Anthropic's rule
    return MessagesRequest(common, messages, listed, tools, prefill)


def _is_int(value: Any) -> bool:
    """An integer as JSON writes one: ``false`` and ``0.0`` are not 0 (the chat checks name their type)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_metadata(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not isinstance(value.get("user_id", ""), (str, type(None))):
        raise invalid("metadata: must be an object whose user_id is a string")
    if len(value.get("user_id") or "") > 256:
        raise invalid("metadata.user_id: String should have at most 256 characters")
    for key in sorted(set(value) - {"user_id"}):
        raise invalid(f"metadata.{key}: Extra inputs are not permitted")


def _stop_sequences(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop_sequences: must be an array of strings")
    return value


# ---- the conversation -----------------------------------------------------------------------------


def openai_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    out = []
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: must be a non-empty array of {role, content}")
    calls: set[str] = set()  # the previous turn's tool_use ids: what its next turn's tool_results answer
    for role, blocks, where in _turns(messages):
        converted = _turn(role, blocks)
        _check_results(converted, calls, where)
        _check_answered(converted, calls, where)
        calls = {call["id"] for m in converted for call in m.get("tool_calls", ())}
        out.extend(converted)
    return out


Block = tuple[Any, str]  # a content block and where it is (messages.1.content.0)


def _turns(messages: list[Any]) -> list[tuple[str, list[Block], str]]:
    """Each turn's role, content blocks and where it starts: consecutive messages of one role are one turn, as
    Anthropic combines them."""
    turns: list[tuple[str, list[Block], str]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role, blocks = _blocks(message, where, last=i == len(messages) - 1)
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks, where))
    return turns


def _check_results(converted: list[dict[str, Any]], calls: set[str], where: str) -> None:
    unanswerable = [m["tool_call_id"] for m in converted if m["role"] == "tool" and m["tool_call_id"] not in calls]
    if unanswerable:
        raise invalid(f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {', '.join(unanswerable)}. "
                      "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.")


def _check_answered(converted: list[dict[str, Any]], calls: set[str], where: str) -> None:
    """Each tool_use of the previous message is answered by a tool_result in this one (Anthropic's rule)."""
    missing = sorted(calls - {m["tool_call_id"] for m in converted if m["role"] == "tool"})
    if missing:
        raise invalid(f"{where}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                      f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                      "in the next message.")


EMPTY_TEXT = "messages: text content blocks must be non-empty"  # Anthropic's words
THINKING = {"thinking": "thinking", "redacted_thinking": "data"}  # a client's replayed thinking blocks: their text field


def _blocks(message: Any, where: str, last: bool) -> tuple[str, list[Block]]:
    """A message's role and content blocks (a string is one text block); an empty final assistant message has
    none (nothing to continue from)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise invalid(f"{where}.role: must be \"user\" or \"assistant\"")
    role, content = message["role"], message.get("content")
    if content == "" or content == []:
        if not (last and role == "assistant"):
            raise invalid(EMPTY_TEXT if content == "" else f"{where}: all messages must have non-empty content "
                                                         "except for the optional final assistant message")
        return role, []
    if isinstance(content, str):
        return role, [({"type": "text", "text": content}, f"{where}.content")]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: must be a string or an array of content blocks")
    return role, [(block, f"{where}.content.{j}") for j, block in enumerate(content)]


def _turn(role: str, blocks: list[Block]) -> list[dict[str, Any]]:
    """One turn as chat messages: a user's tool results as tool messages, then its words; an assistant's words
    and tool calls as one message (none when it says nothing, e.g. only earlier thinking)."""
    read = [_block(block, where, role) for block, where in blocks]
    results = [b for kind, b in read if kind == "tool_result"]
    parts = [b for kind, b in read if kind == "part"]
    calls = [b for kind, b in read if kind == "tool_use"]
    out = list(results)  # tool messages answer the assistant's calls before the user's own words
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        if text or calls:
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _block(block: Any, where: str, role: str) -> tuple[str, dict[str, Any]]:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise invalid(f"{where}.text: must be a string")
        if not block["text"]:
            raise invalid(EMPTY_TEXT)
        return "part", {"type": "text", "text": block["text"]}
    if kind == "image" and role == "user":
        return "part", {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{where}.source")}}
    if kind == "tool_use" and role == "assistant":
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                or not isinstance(block.get("input"), dict):
            raise invalid(f"{where}: a tool_use block needs id, name and input (an object)")
        return "tool_use", {"id": block["id"], "type": "function",
                            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}
    if kind in THINKING and role == "assistant":
        field = THINKING[kind]
        if not isinstance(block.get(field), str):
            raise invalid(f"{where}.{field}: must be a string")
        return "thinking", {}  # an earlier turn's thinking: Anthropic leaves it out of the context too
    if kind == "tool_result" and role == "user":
        if not isinstance(block.get("tool_use_id"), str):
            raise invalid(f"{where}.tool_use_id: must be a string")
        content = _result_of(block.get("content", ""), f"{where}.content")
        if block.get("is_error"):
            content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error: "}, *content]
        return "tool_result", {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
    raise invalid(f"{where}.type: {kind!r} blocks are not supported in {role} messages here "
                  f"(user: text, image, tool_result; assistant: text, tool_use, thinking, redacted_thinking)")


def _result_of(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: a string, text blocks joined, or text and image blocks as chat parts (a
    screenshot tool's answer, as Anthropic's API takes it)."""
    if not isinstance(value, list) or not any(isinstance(b, dict) and b.get("type") == "image" for b in value):
        return _text_of(value, where)
    parts = []
    for j, b in enumerate(value):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), f"{where}.{j}.source")}})
        elif kind == "text" and isinstance(b.get("text"), str) and b["text"]:
            parts.append({"type": "text", "text": b["text"]})
        else:
            raise invalid(f"{where}.{j}: must be a non-empty text block or an image block")
    return parts


def _text_of(value: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        if any(not b["text"] for b in value):
            raise invalid(f"{where}: text content blocks must be non-empty")
        return "".join(b["text"] for b in value)
    raise invalid(f"{where}: must be a string or an array of text blocks")


def _image_url(source: Any, where: str) -> str:
    if not isinstance(source, dict):
        raise invalid(f"{where}: must be an object")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in ("image/jpeg", "image/png", "image/gif", "image/webp") or not isinstance(data, str):
            raise invalid(f"{where}: a base64 source needs media_type (image/jpeg, image/png, image/gif or "
                          "image/webp) and data")
        return f"data:{media};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise invalid(f"{where}.type: must be \"base64\" or \"url\"")


# ---- tools --------------------------------------------------------------------------------------


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` for Anthropic's."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools: must be an array")
        out["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(tools)]
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise invalid("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
        kind = choice["type"]
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise invalid("tool_choice.name: required for type \"tool\"")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
        raise invalid(f"{where}.type: {tool['type']!r}: this server runs the client's own tools only (type custom)")
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise invalid(f"{where}: a tool needs name and input_schema (an object)")
    if tool["input_schema"].get("type") != "object":
        raise invalid(f"{where}.input_schema.type: Input should be 'object'")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}
