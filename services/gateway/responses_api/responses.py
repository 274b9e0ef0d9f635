"""The ``response`` object and its event stream, from a call's one choice.

Output items: a ``message`` with one ``output_text`` part (when there is text) and a ``function_call`` per
tool call. ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
"max_output_tokens" when the answer was cut. Stream: ``response.created``, ``response.in_progress``, each
item's ``output_item.added`` / parts and deltas / ``output_item.done``, then ``response.completed`` (or
``response.incomplete``), every event with its ``sequence_number``. Text and each call's arguments stream as
they are made, tools declared or not (``ItemEvents``). ``finish`` stores the response and the conversation it
ends, for ``previous_response_id``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from services.gateway.openai_api.errors import switchboard_body
from services.gateway.openai_api.tools import ToolStream, extract
from services.gateway.request.call import Call
from services.gateway.request.session import End
from services.gateway.responses_api.schemas import ResponsesRequest
from shared.errors import SwitchboardError
from shared.messages import FinishReason

Store = Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[None]]  # (response, conversation)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Builder:
    """One response's object as it goes from in progress to its end."""

    def __init__(self, req: ResponsesRequest, stored: bool):
        data = req.data
        self.req = req
        self.obj: dict[str, Any] = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": data.get("instructions"),
            "max_output_tokens": data.get("max_output_tokens"), "model": req.chat.common.model, "output": [],
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "previous_response_id": data.get("previous_response_id"), "store": stored,
            "temperature": data.get("temperature", 1.0), "text": data.get("text") or {"format": {"type": "text"}},
            "tool_choice": data.get("tool_choice", "auto"), "tools": data.get("tools") or [],
            "top_p": data.get("top_p", 1.0), "truncation": "disabled", "user": data.get("user"),
            "metadata": data.get("metadata") or {}, "usage": None}

    def items(self, call: Call, end: End) -> list[dict[str, Any]]:
        tools = self.req.chat.tools
        cut = end.finish_reason is FinishReason.LENGTH
        text, calls = end.text, []
        if tools is not None:
            content, calls = extract(tools, end.text, call.started[0].tool_format or "hermes")
            text = content or ""
        status = "incomplete" if cut else "completed"
        out = [message_item(text, status)] if text or not calls else []
        return out + [{"id": new_id("fc"), "type": "function_call", "status": _call_status(c, cut), "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]

    def end(self, call: Call, end: End, output: list[dict[str, Any]]) -> dict[str, Any]:
        cut = end.finish_reason is FinishReason.LENGTH
        usage = call.usage()
        self.obj.update(status="incomplete" if cut else "completed", output=output,
                        incomplete_details={"reason": "max_output_tokens"} if cut else None, usage={
                            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                            "total_tokens": usage["total_tokens"],
                            "input_tokens_details": {"cached_tokens": call.cached_tokens},
                            "output_tokens_details": {"reasoning_tokens": 0}})
        return self.obj

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages a next response continues: this one's history and its answer."""
        turn: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.obj["output"]:
            if item["type"] == "message":
                turn["content"] = (turn["content"] or "") + item["content"][0]["text"]
            else:
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return [*self.req.history, turn]


def message_item(text: str, status: str) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


async def response_body(builder: Builder, call: Call, store: Store | None) -> dict[str, Any]:
    (end,) = await call.results()
    obj = builder.end(call, end, builder.items(call, end))
    if store is not None:
        await store(obj, builder.conversation())
    return obj


class Events:
    """SSE events with consecutive sequence numbers."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def error_event(exc: SwitchboardError) -> bytes:
    error = switchboard_body(exc)["error"]
    return Events()("error", code=error["code"], message=error["message"], param=error["param"])


async def response_events(builder: Builder, call: Call, store: Store | None) -> AsyncIterator[bytes]:
    event = Events()
    yield event("response.created", response=dict(builder.obj))
    yield event("response.in_progress", response=dict(builder.obj))
    end, tools = None, builder.req.chat.tools
    items = ItemEvents(event, hold_whitespace=tools is not None)
    stream = ToolStream(tools, call.started[0].tool_format or "hermes") if tools is not None else None
    async for step in call.steps():
        text, calls = stream.feed(step.text, step.end is not None) if stream is not None else (step.text, [])
        for chunk in [*items.text(text), *(c for delta in calls for c in items.call(delta))]:
            yield chunk
        end = step.end or end
    for chunk in items.close(end.finish_reason is FinishReason.LENGTH):
        yield chunk
    obj = builder.end(call, end, items.output)
    if store is not None:
        await store(obj, builder.conversation())
    yield event("response.incomplete" if obj["status"] == "incomplete" else "response.completed", response=obj)


class ItemEvents:
    """The stream's output items as they come (tools declared or not: the chat route's ``ToolStream`` holds back
    only what may begin a call): text into a ``message`` item, each tool call a ``function_call`` item whose
    arguments stream as they are made; an item of another kind closes the one before. With tools declared,
    whitespace before an item is held until text follows it (the body's text is stripped of it). An answer with
    neither is one empty message, as the body's."""

    def __init__(self, event: Events, hold_whitespace: bool):
        self.event, self.hold_whitespace = event, hold_whitespace
        self.output: list[dict[str, Any]] = []  # the items, closed ones as they ended
        self.open: dict[str, Any] | None = None
        self.held = ""

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out: list[bytes] = []
        if self.open is None or self.open["type"] != "message":
            if self.hold_whitespace:
                text, self.held = self.held + text, ""
                if not text.strip():
                    self.held = text
                    return []
            out = self._open(message_item("", "in_progress"))
        self.open["content"][0]["text"] += text
        return out + [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[])]

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if "id" in delta:  # a new call
            self.held = ""
            out = self._open({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                              "call_id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
        arguments = delta["function"].get("arguments")
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", delta=arguments))
        return out

    def close(self, cut: bool) -> list[bytes]:
        """Close the open item (``cut``: the answer ended by max_output_tokens); an empty answer's message."""
        out = self._open(message_item("", "in_progress")) if not self.output and self.open is None else []
        return out + self._close(cut)

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close(False)
        self.open = item
        self.output.append(item)
        shown = {**item, "content": []} if item["type"] == "message" else item
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(shown)))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", content_index=0,
                                   part={**item["content"][0], "text": ""}))
        return out

    def _close(self, cut: bool) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item["type"] == "message":
            item["status"] = "incomplete" if cut else "completed"
            part = item["content"][0]
            events = [self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], item=item),
                      self._event("response.content_part.done", content_index=0, part=part, item=item)]
        else:
            item["status"] = _call_status({"function": {"arguments": item["arguments"]}}, cut)
            events = [self._event("response.function_call_arguments.done", arguments=item["arguments"],
                                  name=item["name"], item=item)]
        return events + [self.event("response.output_item.done", output_index=self.output.index(item), item=item)]

    def _event(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> bytes:
        item = item or self.open
        return self.event(kind, item_id=item["id"], output_index=self.output.index(item), **fields)


def _call_status(call: dict[str, Any], cut: bool) -> str:
    """A call cut short by max_output_tokens (its arguments no whole JSON yet) is "incomplete", so an agent loop
    does not run it; every other call is "completed"."""
    if not cut:
        return "completed"
    try:
        json.loads(call["function"]["arguments"])
    except ValueError:
        return "incomplete"
    return "completed"
