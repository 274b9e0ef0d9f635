"""Chat and completions request bodies (reference §3.25, §3.26) → small validated dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from services.gateway.common.content import ListInput, parse_list, template_content
from services.gateway.common.served import Served
from services.gateway.openai_api.errors import bad_param, content_error
from services.gateway.openai_api.params import Common, parse_common
from services.gateway.openai_api.tools import Tools, parse_tools
from services.gateway.web.validation import MAX_INPUT_CHARS, UINT64_MAX, Fields, parse_json_object
from shared.config import Config

PARSE_ERROR = "The request body must be a JSON object."
EMPTY_CONTENT = "Request param content len should not be 0"
COMPLETION_LOGPROBS_MAX = 5  # MindIE's (vLLM's max_logprobs is 20: prompt_logprobs and chat top_logprobs take 20)


@dataclass(frozen=True)
class ChatRequest:
    common: Common
    messages: list[dict[str, Any]]
    logprobs: bool
    top_logprobs: int
    chat_template_kwargs: dict[str, Any]
    listed: tuple[ListInput, ...] = ()  # the contents given as lists (each message's ``content`` is its joined text)
    tools: Tools | None = None  # declared tools and tool_choice (openai_api/tools.py)
    turn: dict[str, bool] = field(default_factory=dict)  # add_generation_prompt, continue_final_message (vLLM's)
    echoed: str = ""  # vLLM's echo: the last message's text when it is the assistant's, put before each answer


@dataclass(frozen=True)
class Prompt:
    """One completions prompt: text, or token ids (``text`` is then empty)."""

    text: str
    ids: list[int] | None = None


@dataclass(frozen=True)
class CompletionRequest:
    common: Common
    prompts: list[Prompt]
    echo: bool
    logprobs: int | None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) added to a text prompt


def parse_chat(body: bytes, cfg: Config, served: Served) -> ChatRequest:
    data = parse_json_object(body, PARSE_ERROR)
    f = Fields(data)
    messages, listed = chat_messages(data.get("messages"))
    logprobs = bool(f.boolean("logprobs", False))
    top = f.integer("top_logprobs", None, 0, 20)
    if top is not None and not logprobs:
        raise bad_param("top_logprobs", "when using top_logprobs, logprobs must be set to true.")
    top = top or 0
    common = parse_common(data, cfg, served, top if logprobs else None, chat=True)
    tools = parse_tools(data)
    grammar = tools.grammar() if tools is not None else None
    if grammar is not None:
        if common.sampling.grammar is not None:
            raise bad_param("response_format", "response_format cannot be combined with tool_choice required or a "
                                               "named function (the tool call's arguments are the output).")
        common = replace(common, sampling=msgspec.structs.replace(common.sampling, grammar=grammar))
    if tools is not None:
        _tool_roles(messages)
    turn, kwargs = template_options(data, f)
    return ChatRequest(common, messages, logprobs, top, kwargs, listed, tools, turn,
                       _echoed(messages) if f.boolean("echo", False) else "")


# apply_chat_template's own parameters: the request's fields set them (vLLM's chat_template_kwargs cannot either)
TEMPLATE_PARAMS = {"conversation": "messages", "messages": "messages", "tools": "tools", "documents": "documents",
                   "tokenize": None, "padding": None, "truncation": None, "max_length": None, "return_tensors": None,
                   "return_dict": None, "return_assistant_tokens_mask": None, "tokenizer_kwargs": None}
TURN_KWARGS = ("add_generation_prompt", "continue_final_message")


def template_options(data: dict[str, Any], f: Fields) -> tuple[dict[str, bool], dict[str, Any]]:
    """How the conversation ends (``chat_turn``) and the variables for the model's chat template: vLLM's
    ``chat_template_kwargs`` (an ``add_generation_prompt`` or ``continue_final_message`` among them overrides the
    request's, as vLLM merges them) and ``documents``. A template of the client's own is refused in either place
    (vLLM refuses one unless started with --trust-request-chat-template: a template is code the tokenizer runs)."""
    _refuse_chat_extras(f)
    kwargs = dict(f.obj("chat_template_kwargs").data)
    for key in sorted(kwargs):
        where = f"chat_template_kwargs.{key}"
        if key == "chat_template":
            raise bad_param(where, "chat_template overrides are not supported; the model's template is used.")
        if key in TEMPLATE_PARAMS:
            field = TEMPLATE_PARAMS[key]
            raise bad_param(where, f"{where} is apply_chat_template's own parameter"
                                   + (f"; give the request's {field}." if field else ", not a template variable."))
        if key in TURN_KWARGS and not isinstance(kwargs[key], bool):
            raise bad_param(where, f"{where} must be a boolean.")
    turn_fields = {key: kwargs.pop(key) for key in TURN_KWARGS if key in kwargs}
    merged = {**data, **turn_fields}
    return chat_turn(merged, Fields(merged)), {**kwargs, **documents_kwargs(f)}


def documents_kwargs(f: Fields) -> dict[str, Any]:
    """vLLM's ``documents`` (RAG sources: objects of strings) for the chat template, which places them (a
    template without a ``documents`` section leaves them out, as transformers and vLLM do)."""
    documents = f.data.get("documents")
    if documents is None:
        return {}
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise bad_param("documents", "documents must be an array of objects whose values are strings.")
    return {"documents": documents}


def _echoed(messages: list[dict[str, Any]]) -> str:
    """vLLM's chat ``echo``: the last message's content when its role is the answer's (the assistant's)."""
    last = messages[-1]
    return last["content"] if last["role"] == "assistant" and isinstance(last["content"], str) else ""


def chat_turn(data: dict[str, Any], f: Fields) -> dict[str, bool]:
    """vLLM's ``add_generation_prompt`` (default true) and ``continue_final_message`` (default false; it wins over
    an add_generation_prompt left out): how the rendered conversation ends, as the request's fields."""
    turn, final = bool(f.boolean("add_generation_prompt", True)), bool(f.boolean("continue_final_message", False))
    if turn and final and data.get("add_generation_prompt") is not None:
        raise bad_param("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                  "true.")
    return {"add_generation_prompt": turn and not final, "continue_final_message": final}


TOOL_ROLES = ("system", "user", "assistant", "tool")


def _tool_roles(messages: list[dict[str, Any]]) -> None:
    """With tools declared, the roles the templates' tool rendering knows (MindIE's check)."""
    for i, message in enumerate(messages):
        if message["role"] not in TOOL_ROLES:
            raise bad_param(f"messages[{i}].role", f"messages[{i}].role must be system, assistant, user or tool when "
                                                    f"tools are given, got {message['role']!r}.")


def _refuse_chat_extras(f: Fields) -> None:
    if f.data.get("chat_template") is not None:
        raise bad_param("chat_template", "chat_template overrides are not supported; the model's template is used.")
    if f.boolean("add_special_tokens", False):
        raise bad_param("add_special_tokens", "add_special_tokens applies to a prompt; the chat template places the "
                                              "special tokens of messages.")


def chat_messages(value: Any) -> tuple[list[dict[str, Any]], tuple[ListInput, ...]]:
    """The messages with string contents, and the contents that were given as lists."""
    if value is None:
        raise bad_param("messages", "messages is required.")
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "messages must be a non-empty array.")
    read = [_message(m, i) for i, m in enumerate(value)]
    messages = [message for message, _ in read]
    total = sum(len(m["content"]) if isinstance(m["content"], str) else len(listed.text) for m, listed in read)
    if total > MAX_INPUT_CHARS:
        raise bad_param("messages", f"messages must have at most {MAX_INPUT_CHARS} characters of content, got {total}.")
    return messages, tuple(listed for _, listed in read if listed is not None)


def _message(value: Any, i: int) -> tuple[dict[str, Any], ListInput | None]:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise bad_param(where, f"{where} must be an object.")
    role = value.get("role")
    if not isinstance(role, str) or not role:
        raise bad_param(f"{where}.role", f"{where}.role must be a non-empty string.")
    role = "system" if role == "developer" else role  # OpenAI's name for system messages to newer models
    if value.get("function_call") is not None:
        raise bad_param(f"{where}.function_call", f"{where}.function_call (legacy function calling) is not "
                                                  "supported; use tool_calls.")
    calls = _tool_calls(value.get("tool_calls"), where) if role == "assistant" else []
    content = value.get("content")
    if role == "assistant":
        content = _refusal_as_text(content, value.get("refusal"), where)
    text, listed = ("", None) if calls and content is None else _content(content, f"{where}.content")
    message = {"role": role, "content": template_content(listed) if listed is not None and listed.has_media else text}
    if isinstance(value.get("name"), str):
        message["name"] = value["name"]
    if calls:
        message["tool_calls"] = calls
    if role == "tool":
        if not isinstance(value.get("tool_call_id"), str) or not value["tool_call_id"]:
            raise bad_param(f"{where}.tool_call_id", f"{where}.tool_call_id is required for a tool message.")
        message["tool_call_id"] = value["tool_call_id"]
    return message, listed


def _refusal_as_text(content: Any, refusal: Any, where: str) -> Any:
    """An assistant's earlier refusal, as OpenAI returns one (``refusal`` beside a null content, or refusal
    parts), is what it said: its text (vLLM reads refusal parts as text too)."""
    if refusal is not None and not isinstance(refusal, str):
        raise bad_param(f"{where}.refusal", f"{where}.refusal must be a string.")
    if content is None and refusal:
        return refusal
    if isinstance(content, list):
        return [{"type": "text", "text": part["refusal"]} if isinstance(part, dict) and part.get("type") == "refusal"
                and isinstance(part.get("refusal"), str) else part for part in content]
    return content


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
    "arguments": <JSON text>}}]``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_param(f"{where}.tool_calls", f"{where}.tool_calls must be an array.")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise bad_param(at, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}.')
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return calls


def _content(value: Any, where: str) -> tuple[str, ListInput | None]:
    """A string, or a list of content parts (``services.gateway.common.content``): its text parts joined."""
    if isinstance(value, str):
        return value, None
    if value is None:
        raise bad_param(where, f"{where} is required.")
    if not isinstance(value, list):
        raise bad_param(where, f"{where} must be a string or an array of content parts.")
    listed = parse_list(value, where, content_error, EMPTY_CONTENT)
    return listed.text, listed


def parse_completion(body: bytes, cfg: Config, served: Served) -> CompletionRequest:
    data = parse_json_object(body, PARSE_ERROR)
    f = Fields(data)
    prompts = _prompts(data.get("prompt"))
    if data.get("suffix") is not None:
        raise bad_param("suffix", "suffix is not supported.")
    echo = bool(f.boolean("echo", False))
    logprobs = f.integer("logprobs", None, 0, UINT64_MAX)
    if logprobs is not None and logprobs > COMPLETION_LOGPROBS_MAX:  # MindIE's bound and words (reference §3.26)
        raise bad_param("logprobs", f"logprobs should be in range [0, {COMPLETION_LOGPROBS_MAX}], got {logprobs}.")
    common = parse_common(data, cfg, served, logprobs, chat=False, echo=echo)
    if echo and logprobs is not None:  # the echoed prompt's tokens carry logprobs too (as many alternatives as the
        k = max(logprobs, common.prompt_logprobs or 0)  # answer's; prompt_logprobs' may ask more)
        common = replace(common, sampling=msgspec.structs.replace(common.sampling, prompt_logprobs=k))
    return CompletionRequest(common, prompts, echo, logprobs, bool(f.boolean("add_special_tokens", True)))


PROMPT_FORMS = "prompt must be a string, an array of strings, an array of token ids or an array of token-id arrays."


def _prompts(value: Any) -> list[Prompt]:
    if value is None:
        raise bad_param("prompt", "prompt is required.")
    if isinstance(value, str):
        return [_text_prompt(value)]
    if not isinstance(value, list):
        raise bad_param("prompt", PROMPT_FORMS)
    if not value:
        raise bad_param("prompt", "prompt array cannot be empty.")
    if all(_is_id(v) for v in value):
        return [Prompt("", value)]
    if all(isinstance(v, str) for v in value):
        return [_text_prompt(v) for v in value]
    if all(isinstance(v, list) for v in value):
        return [_id_prompt(v) for v in value]
    raise bad_param("prompt", PROMPT_FORMS)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_prompt(text: str) -> Prompt:
    if not 0 < len(text) <= MAX_INPUT_CHARS:
        raise bad_param("prompt", f"each prompt must be 1 to {MAX_INPUT_CHARS} characters long, got {len(text)}.")
    return Prompt(text)


def _id_prompt(ids: list[Any]) -> Prompt:
    if not ids:
        raise bad_param("prompt", "a token-id prompt cannot be empty.")
    if not all(_is_id(i) for i in ids):
        raise bad_param("prompt", "all elements of a token-id prompt must be integers.")
    return Prompt("", ids)
