"""Anthropic's ``message`` body and its stream of events, from a call's one choice.

Stream: ``message_start`` (the message with no content, its input tokens) and a ``ping``, then each content
block (``content_block_start``, its deltas, ``content_block_stop``; none for an empty answer), then
``message_delta`` (``stop_reason``, ``stop_sequence``, output tokens) and ``message_stop``. Every event has its
``event:`` line (the SDK dispatches on it). Text streams as it comes, with tools declared too (the chat route's
``ToolStream`` holds back only what may begin a call): each call is a ``tool_use`` block whose input streams as
``input_json_delta`` (a forced call's arguments as they are made; a model's own call once its block is whole). A
forced call cut short by max_tokens ends the answer as Anthropic's does, with its incomplete ``tool_use`` block:
the stream's JSON as far as it came, the body's input the object it begins (``partial.partial_object``, as the
anthropic SDK's partial reading of the stream makes it).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from services.gateway.anthropic.errors import STATUS, error_body
from services.gateway.anthropic.partial import partial_object
from services.gateway.anthropic.schemas import MessagesRequest
from services.gateway.openai_api.tools import ToolStream, extract
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
    forced = req.tools is not None and req.tools.choice in ("required", "named")
    uses = [use for use in (_tool_use(c, forced) for c in calls) if use is not None]
    if len(uses) < len(calls) and not forced:
        text, uses = end.text, []  # the model's own call whose arguments are no JSON object: its answer is text
    # (an empty answer is no content at all, as Anthropic's: an empty text block is refused as input)
    return ([{"type": "text", "text": text}] if text else []) + uses


def _tool_use(call: dict[str, Any], forced: bool) -> dict[str, Any] | None:
    """A call as a tool_use block; a forced call cut short has the object its arguments begin (``{}`` before
    any complete member)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = partial_object(call["function"]["arguments"]) if forced else None
        if forced and arguments is None:
            arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": _tool_id(), "name": call["function"]["name"], "input": arguments}


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


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
    end, out = None, BlockEvents(hold_whitespace=req.tools is not None)
    stream = ToolStream(req.tools, call.started[0].tool_format or "hermes") if req.tools is not None else None
    async for step in call.steps():
        text, calls = stream.feed(step.text, step.end is not None) if stream is not None else (step.text, [])
        for chunk in out.text(text):
            yield chunk
        for delta in calls:
            for chunk in out.call(delta):
                yield chunk
        end = step.end or end
    for chunk in out.stop():
        yield chunk
    reason = stop_reason(end, out.kinds)
    yield event("message_delta", {"delta": {"stop_reason": reason,
                                            "stop_sequence": end.stop or None if reason == "stop_sequence" else None},
                                  "usage": {"output_tokens": call.completion_tokens}})
    yield event("message_stop", {})


class BlockEvents:
    """The stream's content blocks as they come: text into a text block, each tool call (the chat stream's
    deltas: its first with id and name) a tool_use block whose input streams as input_json_delta; a block of
    another kind closes the one before. With tools declared, whitespace before a block is held until text follows
    it (no block of whitespace alone before a call, as the body's text is stripped of it)."""

    def __init__(self, hold_whitespace: bool):
        self.hold_whitespace = hold_whitespace
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.kinds: list[dict[str, str]] = []  # each block's {"type"}: what stop_reason reads
        self.held = ""

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        if self.open != "text" and self.hold_whitespace:
            text, self.held = self.held + text, ""
            if not text.strip():
                self.held = text
                return []
        out = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return out + [self._delta({"type": "text_delta", "text": text})]

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out = []
        if "id" in delta:  # a new call
            self.held = ""
            out = self._start({"type": "tool_use", "id": _tool_id(), "name": delta["function"]["name"], "input": {}})
        arguments = delta["function"].get("arguments")
        if arguments and self.open == "tool_use":
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        self.kinds.append({"type": block["type"]})
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})
