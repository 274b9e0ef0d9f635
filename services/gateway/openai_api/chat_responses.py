"""``chat.completion`` bodies and ``chat.completion.chunk`` streams (reference §3.25)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.call import Call
from services.gateway.openai_api.schemas import ChatRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, finish_reason, sse
from shared.messages import TokenOut


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def logprob_entry(token: TokenOut) -> dict[str, Any]:
    """``token`` is the text this token released into the content, so the entries add up to it."""
    top = [{"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text)} for t in token.top]
    return {"token": token.text, "logprob": token.logprob, "bytes": _bytes(token.text), "top_logprobs": top}


def logprobs_json(req: ChatRequest, tokens: list[TokenOut]) -> dict[str, Any] | None:
    return {"content": [logprob_entry(t) for t in tokens], "refusal": None} if req.logprobs else None


async def chat_body(req: ChatRequest, call: Call) -> dict[str, Any]:
    """Run every choice to its end and build the ``chat.completion`` object."""
    choices = []
    for index, end in enumerate(await call.results()):
        message = {"role": "assistant", "content": end.text, "refusal": None, "tool_calls": []}
        choices.append({"index": index, "message": message, "logprobs": logprobs_json(req, end.tokens),
                        "finish_reason": finish_reason(end.finish_reason)})
    return Meta.new("chatcmpl", "chat.completion", req.common.model).body(choices, usage=call.usage())


async def chat_chunks(req: ChatRequest, call: Call) -> AsyncIterator[bytes]:
    """A role chunk per choice, content deltas, each choice's end reason, then the usage (if asked)."""
    meta = Meta.new("chatcmpl", "chat.completion.chunk", req.common.model)
    usage = UsagePlacement(call, req.common.include_usage)
    for index in range(len(call)):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield sse(meta.body([role], **usage.on_chunk(False)))
    async for step in call.steps():
        text = step.text
        ends = step.end is not None
        if not (text or ends or (req.logprobs and step.tokens)):
            continue  # held back by a stop string or an incomplete character: nothing to send yet
        choice = {"index": step.index, "delta": {"content": text}, "logprobs": logprobs_json(req, step.tokens),
                  "finish_reason": finish_reason(step.end and step.end.finish_reason)}
        yield sse(meta.body([choice], **usage.on_chunk(ends)))
    for closing in usage.closing(meta):
        yield sse(closing)
