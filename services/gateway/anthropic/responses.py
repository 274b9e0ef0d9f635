"""Anthropic's ``message`` body and its stream of events, from a call's one choice.

Stream: ``message_start`` (the message with no content, its input tokens) and a ``ping``, then each content
block (``content_block_start``, its deltas, ``content_block_stop``; none for an empty answer), then
``message_delta`` (``stop_reason``, ``stop_sequence``, output tokens) and ``message_stop``. Every event has its
``event:`` line (the SDK dispatches on it). Text streams as it comes; with tools declared the answer is read
whole first (a tool call is known only at its end), then sent as text and ``tool_use`` blocks.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from services.gateway.anthropic.errors import STATUS, error_body
from services.gateway.anthropic.schemas import MessagesRequest
from services.gateway.openai_api.tools import extract
from services.gateway.request.call import Call
from services.gateway.request.session import End
from shared.errors import SwitchboardError
from shared.messages import FinishReason

PING = b'event: ping\ndata: {"type": "ping"}\n\n'
STOP_REASON = {FinishReason.EOS_TOKEN: "end_turn", FinishReason.STOP_SEQUENCE: "stop_sequence",
               FinishReason.LENGTH: "max_tokens"}


def event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload}, ensure_ascii=False)}\n\n".encode()


def error_event(exc: SwitchboardError) -> bytes:
    return event("error", {"error": error_body(STATUS[exc.kind], exc.message)["error"]})


def blocks(req: MessagesRequest, call: Call, end: End) -> list[dict[str, Any]]:
    """The answer's content blocks: its text, then its tool calls as tool_use blocks."""
    text, calls = end.text, []
    if req.tools is not None:
        fmt = call.started[0].tool_format or "hermes"
        content, calls = extract(req.tools, end.text, fmt)
        text = content or ""
    uses = [use for use in map(_tool_use, calls) if use is not None]
    if len(uses) < len(calls) and req.tools.choice not in ("required", "named"):
        text, uses = end.text, []  # the model's own call whose arguments are no JSON object: its answer is text
    # (a forced call cut short, by max_tokens or a stop sequence, is left out: its input is no object yet;
    # an empty answer is no content at all, as Anthropic's: an empty text block is refused as input)
    return ([{"type": "text", "text": text}] if text else []) + uses


def _tool_use(call: dict[str, Any]) -> dict[str, Any] | None:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["function"]["name"],
            "input": arguments}


def stop_reason(end: End, content: list[dict[str, Any]]) -> str:
    if end.finish_reason is not FinishReason.LENGTH and any(b["type"] == "tool_use" for b in content):
        return "tool_use"
    return STOP_REASON.get(end.finish_reason, "end_turn")


def head(req: MessagesRequest) -> dict[str, Any]:
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": req.common.model}


def usage(call: Call) -> dict[str, int]:
    return {"input_tokens": call.prompt_tokens, "output_tokens": call.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


async def message_body(req: MessagesRequest, call: Call) -> dict[str, Any]:
    (end,) = await call.results()
    content = blocks(req, call, end)
    reason = stop_reason(end, content)
    return {**head(req), "content": content, "stop_reason": reason,
            "stop_sequence": end.stop or None if reason == "stop_sequence" else None, "usage": usage(call)}


async def message_events(req: MessagesRequest, call: Call) -> AsyncIterator[bytes]:
    start = {**head(req), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage(call), "output_tokens": 0}}
    yield event("message_start", {"message": start})
    yield PING  # (at the start: a ping later, right after a block, would look like a keep-alive owed no silence)
    end, content = None, []
    if req.tools is None:
        async for step in call.steps():
            if step.text and not content:  # the text block opens with its first text: no empty block
                content = [{"type": "text"}]
                yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            if step.text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": step.text}})
            end = step.end or end
        if content:
            yield event("content_block_stop", {"index": 0})
    else:
        async for step in call.steps():
            end = step.end or end
        content = blocks(req, call, end)
        for index, block in enumerate(content):
            for chunk in _whole_block(index, block):
                yield chunk
    reason = stop_reason(end, content)
    yield event("message_delta", {"delta": {"stop_reason": reason,
                                            "stop_sequence": end.stop or None if reason == "stop_sequence" else None},
                                  "usage": {"output_tokens": call.completion_tokens}})
    yield event("message_stop", {})


def _whole_block(index: int, block: dict[str, Any]) -> list[bytes]:
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    return [event("content_block_start", {"index": index, "content_block": start}),
            event("content_block_delta", {"index": index, "delta": delta}),
            event("content_block_stop", {"index": index})]
