"""``chat.completion`` bodies and ``chat.completion.chunk`` streams (reference §3.25)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from services.gateway.common import finish
from services.gateway.openai_api.schemas import ChatRequest
from services.gateway.openai_api.sse import Meta, UsagePlacement, sse, token_id_text
from services.gateway.openai_api.token_fields import prompt_logprobs_json, token_ids
from services.gateway.openai_api.tools import ToolStream, extract
from services.gateway.request.call import Call
from shared.messages import FinishReason, TokenOut, TopToken


def _bytes(token: TokenOut | TopToken) -> list[int]:
    return list(token.raw if token.raw is not None else token.text.encode("utf-8"))


def logprob_entry(token: TokenOut, as_ids: bool = False) -> dict[str, Any]:
    """``token`` is the token's own text (as OpenAI's and vLLM's: a stop string's hold-back, which releases text
    on a later token, does not move it), so the entries' tokens add up to the content (and the stop string);
    ``bytes`` are the token's own (part of a character has bytes before it releases any text), so the
    entries' bytes add up to the content's UTF-8. ``as_ids`` (vLLM's return_tokens_as_token_ids): each token
    is ``token_id:<id>``, its bytes that string's."""
    own = token.own_text  # the token among its alternatives is labelled as it is (part of a character: "")
    top = [_entry(t.id, own if t.id == token.id else t.text, t.logprob, _bytes(t), as_ids) for t in token.top]
    return {**_entry(token.id, token.own_text, token.logprob, _bytes(token), as_ids), "top_logprobs": top}


def _entry(token_id: int, text: str, logprob: float | None, raw: list[int], as_ids: bool) -> dict[str, Any]:
    if as_ids:
        text = token_id_text(token_id)
        raw = list(text.encode())
    return {"token": text, "logprob": logprob, "bytes": raw}


def logprobs_json(req: ChatRequest, tokens: list[TokenOut]) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    return {"content": [logprob_entry(t, req.common.tokens_as_ids) for t in tokens], "refusal": None}


def _finish(end_reason: FinishReason | None, calls: bool) -> str | None:
    """``tool_calls`` when the answer is tool calls (and was not cut by max_tokens)."""
    if calls and end_reason is not None and end_reason is not FinishReason.LENGTH:
        return "tool_calls"
    return finish.openai(end_reason)


def _stop_reason(req: ChatRequest, end) -> str | int | None:
    """vLLM's ``stop_reason`` on chat choices too (as on completions)."""
    return finish.vllm_stop_reason(end, req.common.sampling.stop_token_ids)


async def chat_body(req: ChatRequest, call: Call) -> dict[str, Any]:
    """Run every choice to its end and build the ``chat.completion`` object."""
    choices = []
    for index, end in enumerate(await call.results()):
        fmt = call.started[index].tool_format or "hermes"
        content, calls = extract(req.tools, end.text, fmt) if req.tools is not None else (end.text, [])
        if req.echoed:
            content = req.echoed + (content or "")
        message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
        choice = {"index": index, "message": message, "logprobs": logprobs_json(req, end.tokens),
                  "finish_reason": _finish(end.finish_reason, bool(calls)), "stop_reason": _stop_reason(req, end)}
        if req.common.return_token_ids:
            choice["token_ids"] = token_ids(end.tokens)
        choices.append(choice)
    meta = Meta.new("chatcmpl", "chat.completion", req.common.model, req.common.request_id, call)
    return meta.body(choices, usage=call.usage(), **_prompt_extras(req, call))


def _prompt_extras(req: ChatRequest, call: Call) -> dict[str, Any]:
    """vLLM's top-level ``prompt_logprobs`` and ``prompt_token_ids`` (one prompt, whatever n is)."""
    extras: dict[str, Any] = {}
    if req.common.prompt_logprobs is not None:
        extras["prompt_logprobs"] = prompt_logprobs_json(call.sessions[0].prompt, req.common.prompt_logprobs)
    if req.common.return_token_ids:
        extras["prompt_token_ids"] = call.started[0].prompt_ids
    return extras


async def chat_chunks(req: ChatRequest, call: Call) -> AsyncIterator[bytes]:
    """A role chunk per choice, content deltas, each choice's end reason, then the usage (if asked)."""
    meta = Meta.new("chatcmpl", "chat.completion.chunk", req.common.model, req.common.request_id, call)
    usage = UsagePlacement(call, req.common.include_usage, req.common.continuous_usage)
    streams = [ToolStream(req.tools, started.tool_format or "hermes") if req.tools is not None else None
               for started in call.started]
    for index in range(len(call)):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                "stop_reason": None}
        first = _prompt_extras(req, call) if index == 0 else {}  # vLLM's prompt_token_ids: on the first chunk
        yield sse(meta.body([role], **usage.on_chunk(False, index), **first))
        if req.echoed:  # vLLM's echo: the last message's text, a chunk of its own before the answer's
            echo = {"index": index, "delta": {"content": req.echoed}, "logprobs": None, "finish_reason": None,
                    "stop_reason": None}
            yield sse(meta.body([echo], **usage.on_chunk(False, index)))
    async for step in call.steps():
        usage.count(step)
        ends = step.end is not None
        delta = _delta(streams[step.index], step.text, ends)
        if not (delta.get("content") or delta.get("tool_calls") or ends
                or ((req.logprobs or req.common.return_token_ids) and step.tokens)):
            continue  # held back by a stop string, an incomplete character or a tool-call marker
        calls = streams[step.index] is not None and streams[step.index].calls > 0
        choice = {"index": step.index, "delta": delta, "logprobs": logprobs_json(req, step.tokens),
                  "finish_reason": _finish(step.end and step.end.finish_reason, calls),
                  "stop_reason": _stop_reason(req, step.end)}
        if req.common.return_token_ids:
            choice["token_ids"] = token_ids(step.tokens)
        yield sse(meta.body([choice], **usage.on_chunk(ends, step.index)))
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
