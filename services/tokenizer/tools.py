"""A chat with tools through the model's chat template.

A template that takes ``tools`` gets them, and the conversation's assistant ``tool_calls`` (arguments as
objects, as templates print them with ``tojson``) and ``tool`` messages as they are. A template without
tool support (SmolLM2's, say) would drop them silently; instead the tools are described in the system
message in the Hermes format — each call a ``<tool_call>{"name": …, "arguments": …}</tool_call>`` block,
each result a ``<tool_response>`` — which is also what the gateway parses for ``tool_choice: auto``
(``services/gateway/openai_api/tools.py``). The format a template prints calls in (``tool_format``: Hermes,
Mistral's ``[TOOL_CALLS]`` or Llama 3's JSON) goes to the gateway in ``Started``; a template with tools in
another format cannot be parsed: ``auto`` is refused there (``required`` and named functions are
grammar-constrained and need no parser).
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import validation

TOOL_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions are described as JSON "
    "within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON object "
    "holding its name and arguments within <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>'
)


# the tool-call formats the gateway parses for tool_choice auto, by a marker of the chat template that prints it
FORMATS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
           ("ipython", "llama3_json"))


def takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tool_format(tokenizer) -> str:
    """The format the model writes tool calls in, as its chat template shows it; "hermes" for a template
    without tool support (the format ``with_tools`` describes); "" when the template's format is unknown."""
    if not takes_tools(tokenizer):
        return "hermes"
    return next((name for marker, name in FORMATS if marker in tokenizer.chat_template), "")


def with_tools(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]], choice: str
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template arguments) for a chat that declares ``tools``."""
    if takes_tools(tokenizer):
        if choice == "auto" and not tool_format(tokenizer):
            raise validation("tool_choice auto: the model's chat template has a tool-call format this server "
                             "cannot parse; use tool_choice required or a named function", "tool_choice")
        return [_templated(m) for m in messages], {"tools": tools}
    described = TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
    out = [_hermes(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, {}


def _templated(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as objects (the OpenAI wire carries them as JSON text)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, ValueError):
            pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _hermes(message: dict[str, Any]) -> dict[str, Any]:
    """A message as text for a template without tool support."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    blocks = []
    for call in _templated(message)["tool_calls"]:
        function = call["function"]
        blocks.append(f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': function['arguments']})}"
                      "\n</tool_call>")
    content = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {"role": "assistant", "content": content}


def plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without declared tools, earlier tool turns still render (as text where the template has no tool support)."""
    return [_hermes(m) for m in messages] if any(m.get("tool_calls") or m["role"] == "tool" for m in messages) else messages
