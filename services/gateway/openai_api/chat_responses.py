"""``chat.completion`` bodies and ``chat.completion.chunk`` streams (reference §3.25)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.common import finish
from services.gateway.openai_api.schemas import ChatRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, sse
from services.gateway.openai_api.tools import ToolStream, extract
from services.gateway.request.call import Call
from shared.messages import FinishReason, TokenOut, TopToken


def _bytes(token: TokenOut | TopToken) -> list[int]:
    return list(token.raw if token.raw is not None else token.text.encode("utf-8"))


def logprob_entry(token: TokenOut) -> dict[str, Any]:
    """``token`` is the token's own text (as OpenAI's and vLLM's: a stop string's hold-back, which releases text
    on a later token, does not move it), so the entries' tokens add up to the content (and the stop string);
    ``bytes`` are the token's own (part of a character has bytes before it releases any text), so the
    entries' bytes add up to the content's UTF-8."""
    top = [{"token": t.text, "logprob": t.logprob, "bytes": _bytes(t)} for t in token.top]
    return {"token": token.own_text, "logprob": token.logprob, "bytes": _bytes(token), "top_logprobs": top}


def logprobs_json(req: ChatRequest, tokens: list[TokenOut]) -> dict[str, Any] | None:
    return {"content": [logprob_entry(t) for t in tokens], "refusal": None} if req.logprobs else None


def _finish(end_reason: FinishReason | None, calls: bool) -> str | None:
    """``tool_calls`` when the answer is tool calls (and was not cut by max_tokens)."""
    if calls and end_reason is not None and end_reason is not FinishReason.LENGTH:
        return "tool_calls"
    return finish.openai(end_reason)


async def chat_body(req: ChatRequest, call: Call) -> dict[str, Any]:
    """Run every choice to its end and build the ``chat.completion`` object."""
    choices = []
    for index, end in enumerate(await call.results()):
        fmt = call.started[index].tool_format or "hermes"
        content, calls = extract(req.tools, end.text, fmt) if req.tools is not None else (end.text, [])
        if req.echoed:
            content = req.echoed + (content or "")
        message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
        choices.append({"index": index, "message": message, "logprobs": logprobs_json(req, end.tokens),
                        "finish_reason": _finish(end.finish_reason, bool(calls))})
    return Meta.new("chatcmpl", "chat.completion", req.common.model).body(choices, usage=call.usage())


async def chat_chunks(req: ChatRequest, call: Call) -> AsyncIterator[bytes]:
    """A role chunk per choice, content deltas, each choice's end reason, then the usage (if asked)."""
    meta = Meta.new("chatcmpl", "chat.completion.chunk", req.common.model)
    usage = UsagePlacement(call, req.common.include_usage)
    streams = [ToolStream(req.tools, started.tool_format or "hermes") if req.tools is not None else None
               for started in call.started]
    for index in range(len(call)):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield sse(meta.body([role], **usage.on_chunk(False)))
        if req.echoed:  # vLLM's echo: the last message's text, a chunk of its own before the answer's
            echo = {"index": index, "delta": {"content": req.echoed}, "logprobs": None, "finish_reason": None}
            yield sse(meta.body([echo], **usage.on_chunk(False)))
    async for step in call.steps():
        ends = step.end is not None
        delta = _delta(streams[step.index], step.text, ends)
        if not (delta.get("content") or delta.get("tool_calls") or ends or (req.logprobs and step.tokens)):
            continue  # held back by a stop string, an incomplete character or a tool-call marker
        calls = streams[step.index] is not None and streams[step.index].calls > 0
        choice = {"index": step.index, "delta": delta, "logprobs": logprobs_json(req, step.tokens),
                  "finish_reason": _finish(step.end and step.end.finish_reason, calls)}
        yield sse(meta.body([choice], **usage.on_chunk(ends)))
    for closing in usage.closing(meta):
        yield sse(closing)


def _delta(stream: ToolStream | None, text: str, final: bool) -> dict[str, Any]:
    """A chunk's delta: its content, and the tool-call deltas when the request declared tools."""
    if stream is None:
        return {"content": text}
    content, calls = stream.feed(text, final)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
