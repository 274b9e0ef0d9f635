"""OpenAI's Responses request, read into the chat request the OpenAI routes run.

``input`` (a string, or items: messages with ``input_text`` / ``input_image`` / ``output_text`` parts,
``function_call``, ``function_call_output``) after the stored conversation of ``previous_response_id`` and
after ``instructions`` (a system message, not carried to the next response) becomes the chat messages;
``max_output_tokens``, ``temperature``, ``top_p``, the flat function ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``text.format`` (json_schema, json_object) become the chat fields; so
``parse_chat`` checks them all, and its errors name the Responses field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.common.served import Served
from services.gateway.openai_api.errors import OpenAIError, bad_param
from services.gateway.openai_api.schemas import ChatRequest, parse_chat
from services.gateway.web.validation import parse_json_object
from shared.config import Config
from shared.errors import SwitchboardError

PARSE_ERROR = "The request body must be a JSON object."
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "text", "stream", "store", "previous_response_id", "metadata", "parallel_tool_calls", "user", "truncation",
          "seed", "cache_salt"}  # seed, cache_salt: vLLM's extensions, as on chat completions
# a chat field's name (the start of a parameter's path) as the Responses request names it
CHAT_NAMES = [(re.compile(r"^max_tokens\b"), "max_output_tokens"),
              (re.compile(r"^response_format(\.json_schema)?\b"), "text.format"),
              (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"),  # Responses' tools are flat
              (re.compile(r"^tool_choice\.function\b"), "tool_choice")]


@dataclass(frozen=True)
class ResponsesRequest:
    data: dict[str, Any]  # the body (echoed in the response object)
    chat: ChatRequest
    history: list[dict[str, Any]]  # the conversation without instructions: what a next response continues
    before: int = 0  # the chat messages ahead of the input's own (instructions, a previous response's)

    @property
    def stream(self) -> bool:
        return self.chat.common.stream


# Hints that change nothing in an answer here: a prompt-cache routing key (the fleet routes by cache on its own),
# a service tier, an end user's id for abuse monitoring. Checked for their type, then set aside.
HINTS = {"prompt_cache_key": str, "safety_identifier": str, "service_tier": str}
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
# Fields this server takes only at their default (absent, null or empty): anything else is a 400 naming them.
DEFAULT_ONLY = {"include", "reasoning", "stream_options", "conversation", "prompt", "top_logprobs", "max_tool_calls",
                "background"}


def read_body(body: bytes) -> dict[str, Any]:
    data = parse_json_object(body, PARSE_ERROR)
    unknown = sorted(set(data) - FIELDS - set(HINTS) - DEFAULT_ONLY)
    if unknown:
        raise bad_param(unknown[0], f"{unknown[0]} is not supported by this server.")
    _set_aside(data)
    if data.get("truncation") not in (None, "disabled"):
        raise bad_param("truncation", 'truncation must be "disabled": no conversation items are dropped here ("auto"); '
                                      'an input over the limit is refused, or cut as ModelDeployConfig.truncation says.')
    for key in ("store", "stream", "parallel_tool_calls"):
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise bad_param(key, f"{key} must be boolean type.")
    if data.get("previous_response_id") is not None and not isinstance(data["previous_response_id"], str):
        raise bad_param("previous_response_id", "previous_response_id must be a string.")
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise bad_param("user", "user must be a string.")
    _check_metadata(data.get("metadata"))
    return data


def _check_metadata(value: Any) -> None:
    """OpenAI's metadata: at most 16 pairs, keys of up to 64 characters, string values of up to 512."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise bad_param("metadata", "metadata must be an object of at most 16 key-value pairs.")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise bad_param(f"metadata.{key[:64]}", "metadata keys must have at most 64 characters and its values "
                                                    "be strings of at most 512.")


def _set_aside(data: dict[str, Any]) -> None:
    """Take the hints and the default-only fields out of ``data`` (Responses clients send them at their defaults:
    ``include: []``, ``reasoning: null``, ``store`` with ``prompt_cache_key``)."""
    for key, kind in HINTS.items():
        value = data.pop(key, None)
        if value is not None and not isinstance(value, kind):
            raise bad_param(key, f"{key} must be a string.")
        if key == "service_tier" and value is not None and value not in SERVICE_TIERS:
            raise bad_param(key, f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {value!r}.")
    for key in sorted(DEFAULT_ONLY & set(data)):
        value = data.pop(key)
        if key == "stream_options" and value is not None and data.get("stream") is not True:
            raise bad_param(key, "stream_options can only be given when stream is true.")
        if key == "stream_options" and isinstance(value, dict) and not value.get("include_obfuscation"):
            continue  # (no obfuscation is added to this server's events)
        if isinstance(value, dict) and all(v is None for v in value.values()):
            continue  # e.g. reasoning {"effort": null, "summary": null}: what OpenAI echoes for a plain model
        if value not in (None, [], {}, 0, False):
            raise bad_param(key, f"{key} is not supported by this server: leave it out or at its default "
                                 f"(null or empty), got {value!r}.")


def parse_responses(data: dict[str, Any], previous: list[dict[str, Any]], cfg: Config, served: Served) -> ResponsesRequest:
    """``previous``: the stored conversation ``previous_response_id`` names ([] for none)."""
    history = previous + input_messages(data.get("input"))
    _check_outputs(history)
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_param("instructions", "instructions must be a string.")
    temperature = data.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 2:
        raise bad_param("temperature", f"temperature must be in [0, 2], got {temperature}.")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat = {"model": data.get("model"), "messages": messages, "max_tokens": data.get("max_output_tokens"),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"), "stream": data.get("stream"),
            "seed": data.get("seed"), "cache_salt": data.get("cache_salt"),
            "parallel_tool_calls": data.get("parallel_tool_calls"), **_tools(data.get("tools"), data.get("tool_choice")),
            "response_format": _format(data.get("text"))}
    try:
        req = parse_chat(msgspec.json.encode({k: v for k, v in chat.items() if v is not None}), cfg, served)
    except SwitchboardError as exc:
        raise renamed(exc, len(messages) - len(history) + len(previous), messages) from None
    return ResponsesRequest(data, req, history, len(messages) - len(history) + len(previous))


def _check_outputs(history: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a function_call earlier in the conversation (OpenAI's rule)."""
    calls: set[str] = set()
    for message in history:
        calls.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in calls:
            raise bad_param("input", f"No tool call found for function call output with call_id "
                                     f"{message['tool_call_id']}.")


def renamed(exc: SwitchboardError, before: int, messages: list[dict[str, Any]] = ()) -> OpenAIError:
    """A chat check's error, naming the Responses field (``before``, ``messages``: as :func:`responses_name` takes
    them)."""
    name = responses_name(exc.param, before, messages)
    return OpenAIError(exc.kind, exc.message.replace(exc.param or "\0", name or ""), name, getattr(exc, "code", None))


def responses_name(param: str | None, before: int, messages: list[dict[str, Any]] = ()) -> str | None:
    """The Responses field a chat error's ``param`` names: ``messages[i]`` is ``input[i - before]`` (``before``:
    the messages ahead of the input's own, instructions and a previous response's), or ``input`` itself; a tool
    message's ``content`` is its function_call_output's ``output`` (``messages``: the chat messages)."""
    if not param:
        return param
    if param.startswith("messages"):
        index = re.match(r"^messages\[(\d+)\]", param)
        if index is None or int(index[1]) < before:
            return "input"
        rest = param[index.end():]
        if int(index[1]) < len(messages) and messages[int(index[1])].get("role") == "tool":
            rest = re.sub(r"^\.content", ".output", rest)
        return f"input[{int(index[1]) - before}]" + rest
    for pattern, name in CHAT_NAMES:
        param = pattern.sub(name, param)
    return param


# ---- input ------------------------------------------------------------------------------------


def input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_param("input", "input must be a string or a non-empty array of input items.")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_param(where, f"{where} must be an object.")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad_param(f"{where}.call_id", f"Missing required parameter: '{where}.call_id'.")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise bad_param(where, f"{where}: a function_call needs name and arguments (a JSON string).")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise bad_param(where, f"{where}: a function_call_output needs call_id and output.")
            content = output if isinstance(output, str) else _output_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        else:
            raise bad_param(f"{where}.type", f"{where}.type {kind!r} is not supported here (message, function_call, "
                                             "function_call_output).")
    return out


def _output_parts(parts: list[Any], where: str) -> str | list[dict[str, Any]]:
    """A function_call_output given as parts: their texts joined, or with images (a screenshot tool's answer)
    text and image parts of the tool message (a file a tool returned is a 400 naming it, not dropped)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad_param(f"{where}[{j}]", f"{where}[{j}] must be an input_text or input_image part (with "
                                             f"image_url), got {kind or type(part).__name__!r}.")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_param(f"{where}.role", f'{where}.role must be "user", "assistant", "system" or "developer".')
    role = "system" if role == "developer" else role
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_param(f"{where}.content", f"{where}.content must be a string or an array of content parts.")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})  # an earlier refusal is what it said
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad_param(f"{where}.content[{j}]", f"{where}.content[{j}] must be input_text, output_text, "
                                                     "refusal (an assistant's) or input_image (with image_url).")
    if role != "user" and any(p["type"] != "text" for p in parts):
        raise bad_param(f"{where}.content", f"{where}: only user messages carry images.")
    return {"role": role, "content": parts if role == "user" else "".join(p["text"] for p in parts)}


# ---- tools and text.format ------------------------------------------------------------------------


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_param("tools", "tools must be an array of function tools.")
        out["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)]
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                       f'"name": ...}}: this server runs function tools only, got {choice!r}.')
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_param(where, f'{where} must be {{"type": "function", "name", "parameters"}}: this server runs '
                               "function tools only.")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    function["strict"] = True if tool.get("strict") is None else tool["strict"]  # Responses' default (not chat's)
    return {"type": "function", "function": function}


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_param("text", "text must be an object.")
    for key in sorted(set(text) - {"format", "verbosity"}):
        raise bad_param(f"text.{key}", f"text.{key} is not supported by this server.")
    if text.get("verbosity") not in (None, "medium"):  # the default: a model here has no other
        raise bad_param("text.verbosity", f'text.verbosity must be "medium" here (the model has no other), '
                                          f"got {text['verbosity']!r}.")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        raise bad_param("text.format", 'text.format.type must be "text", "json_object" or "json_schema".')
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    for key in ("name", "schema"):
        if fmt.get(key) is None:
            raise bad_param(f"text.format.{key}", f"Missing required parameter: 'text.format.{key}'.")
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}

