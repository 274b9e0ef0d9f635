"""TGI response shapes: one object, an array of one object, or SSE token events (seed 003)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import msgspec

from services.gateway.common import finish
from services.gateway.request.call import Call
from services.gateway.request.session import End
from services.gateway.tgi.schemas import TgiRequest
from services.gateway.web.errors import tgi_body
from shared.errors import SwitchboardError
from shared.messages import Started, TokenOut


def token_json(token: TokenOut) -> dict[str, Any]:
    """``text`` is the token's own (with stop strings too, as TGI's; ``generated_text`` leaves the stop string out,
    reference §3.22); ``logprob`` is the sampled token's (TGI reports it on every token)."""
    return {"id": token.id, "text": token.own_text, "logprob": token.logprob, "special": token.special}


def top_json(token: TokenOut) -> list[dict[str, Any]]:
    """TGI's ``top_tokens`` of one step: the most likely ids with their log-probabilities."""
    return [{"id": t.id, "text": t.text, "logprob": t.logprob, "special": False} for t in token.top]


def prefill_json(started: Started, prompt: list[TokenOut]) -> list[dict[str, Any]]:
    """``decoder_input_details``: each prompt token with its logprob under the model (the first's is null)."""
    if prompt:
        return [{"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special} for t in prompt]
    return [{"id": i, "text": t, "logprob": None, "special": False}
            for i, t in zip(started.prompt_ids, started.prompt_texts)]


def full_text(req: TgiRequest, generated: str) -> str:
    """return_full_text prepends the inputs and a space, as MindIE does (reference §3.22)."""
    return f"{req.inputs} {generated}" if req.return_full_text else generated


def body(call: Call, req: TgiRequest, end: End, as_array: bool = False) -> Any:
    """TGI's object for a finished request (in an array for ``POST /``)."""
    started = call.started[0]
    result: dict[str, Any] = {"generated_text": full_text(req, end.text)}
    if req.wants_details:
        result = {
            "details": {
                "prompt_tokens": started.prompt_tokens,
                "finish_reason": finish.tgi(end.finish_reason),
                "generated_tokens": end.generated_tokens,
                "prefill": prefill_json(started, call.sessions[0].prompt) if req.decoder_input_details else [],
                "seed": started.seed,
                "tokens": [token_json(t) for t in end.tokens],
                **({"top_tokens": [top_json(t) for t in end.tokens]} if req.top_n_tokens else {}),
            },
            **result,
        }
    return [result] if as_array else result


async def collect(call: Call, req: TgiRequest, as_array: bool = False) -> Any:
    return body(call, req, (await call.results())[0], as_array)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(exc: SwitchboardError) -> bytes:
    return sse(tgi_body(exc.kind, exc.message))


async def stream_events(call: Call, req: TgiRequest, full_text_mode: bool) -> AsyncIterator[bytes]:
    """SSE token events; the last carries generated_text (and details when asked)."""
    text = ""
    last: TokenOut | None = None
    sent = 0  # TGI's ``index``: the event's number, from 1
    async for step in call.steps():
        for index, token in enumerate(step.tokens):
            text += token.text
            last = token
            shown = TokenOut(token.id, text, token.special, token.logprob, token.top) if full_text_mode else token
            end = step.end if index == len(step.tokens) - 1 else None
            sent += 1
            yield sse(_event(sent, shown, call, req, end))
        if step.end is not None and not step.tokens:
            yield sse(_event(sent + 1, last or TokenOut(0, "", True), call, req, step.end))


def _event(index: int, token: TokenOut, call: Call, req: TgiRequest, end: End | None) -> dict[str, Any]:
    """One SSE event; the last one's details carry MindIE's ``prompt_tokens`` and TGI's ``input_length``."""
    details = None
    if end is not None and req.wants_details:
        details = {"prompt_tokens": end.prompt_tokens, "input_length": end.prompt_tokens,
                   "finish_reason": finish.tgi(end.finish_reason), "generated_tokens": end.generated_tokens,
                   "seed": call.started[0].seed}
    event = {"index": index, "token": token_json(token),
             "generated_text": None if end is None else full_text(req, end.text), "details": details}
    if req.top_n_tokens:
        event["top_tokens"] = top_json(token)
    return event
