"""``chat.completion`` bodies and ``chat.completion.chunk`` streams (reference §3.25)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.openai_api.runner import Batch
from services.gateway.openai_api.schemas import ChatRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, finish_reason
from shared.messages import TokenOut


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def logprob_entry(token: TokenOut) -> dict[str, Any]:
    """``token`` is the text this token released into the content, so the entries add up to it."""
    top = [{"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text)} for t in token.top]
    return {"token": token.text, "logprob": token.logprob, "bytes": _bytes(token.text), "top_logprobs": top}


def logprobs_json(req: ChatRequest, tokens: list[TokenOut]) -> dict[str, Any] | None:
    return {"content": [logprob_entry(t) for t in tokens]} if req.logprobs else None


async def chat_body(req: ChatRequest, batch: Batch) -> dict[str, Any]:
    """Run every choice to its end and build the ``chat.completion`` object."""
    all_tokens = await batch.collect()
    choices = []
    for index, (session, tokens) in enumerate(zip(batch.sessions, all_tokens)):
        message = {"role": "assistant", "content": "".join(t.text for t in tokens), "tool_calls": []}
        choices.append({"index": index, "message": message, "logprobs": logprobs_json(req, tokens),
                        "finish_reason": finish_reason(session.finish_reason)})
    return Meta.new("chatcmpl", "chat.completion", req.common.model).body(choices, usage=batch.usage())


async def chat_chunks(req: ChatRequest, batch: Batch) -> AsyncIterator[dict[str, Any]]:
    """A role chunk per choice, content deltas, each choice's end reason, then the usage (if asked)."""
    meta = Meta.new("chatcmpl", "chat.completion.chunk", req.common.model)
    usage = UsagePlacement(batch, req.common.include_usage)
    for index in range(len(batch)):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield meta.body([role], **usage.on_chunk(False))
    async for index, out in batch.events():
        text = "".join(t.text for t in out.tokens)
        ends = out.finish_reason is not None
        if not (text or ends or (req.logprobs and out.tokens)):
            continue  # held back by a stop string or an incomplete character: nothing to send yet
        choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs_json(req, out.tokens),
                  "finish_reason": finish_reason(out.finish_reason)}
        yield meta.body([choice], **usage.on_chunk(ends))
    for closing in usage.closing(meta):
        yield closing
