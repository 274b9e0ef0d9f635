"""TGI response shapes: one object, an array of one object, or SSE token events (seed 003)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import msgspec

from services.gateway.errors import tgi_body
from services.gateway.session import Session
from services.gateway.tgi.schemas import TgiRequest
from shared.errors import SwitchboardError
from shared.messages import Started, TokenOut

# The engine's own end reasons mapped to TGI's three (MindIE maps aborts to stop_sequence).
FINISH = {"length": "length", "eos_token": "eos_token", "stop_sequence": "stop_sequence", "cancelled": "stop_sequence"}


def token_json(token: TokenOut) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": None, "special": token.special}


def prefill_json(started: Started) -> list[dict[str, Any]]:
    return [{"id": i, "text": t, "logprob": None, "special": False}
            for i, t in zip(started.prompt_ids, started.prompt_texts)]


def full_text(req: TgiRequest, generated: str) -> str:
    """return_full_text prepends the inputs and a space, as MindIE does (reference §3.22)."""
    return f"{req.inputs} {generated}" if req.return_full_text else generated


async def collect(session: Session, req: TgiRequest, started: Started, as_array: bool = False) -> Any:
    """Run a non-streaming request to its end and build TGI's object (in an array for ``POST /``)."""
    tokens: list[TokenOut] = []
    async for out in session.outputs():
        tokens.extend(out.tokens)
    generated = "".join(t.text for t in tokens)
    body: dict[str, Any] = {"generated_text": full_text(req, generated)}
    if req.wants_details:
        body = {
            "details": {
                "prompt_tokens": started.prompt_tokens,
                "finish_reason": FINISH.get(session.finish_reason, "stop_sequence"),
                "generated_tokens": session.generated,
                "prefill": prefill_json(started) if req.decoder_input_details else [],
                "seed": started.seed,
                "tokens": [token_json(t) for t in tokens],
            },
            **body,
        }
    return [body] if as_array else body


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def stream_events(session: Session, req: TgiRequest, started: Started, full_text_mode: bool) -> AsyncIterator[bytes]:
    """SSE token events; the last carries generated_text (and details when asked)."""
    text = ""
    last: TokenOut | None = None
    try:
        async for out in session.outputs():
            for index, token in enumerate(out.tokens):
                text += token.text
                last = token
                shown = TokenOut(token.id, text, token.special) if full_text_mode else token
                is_final = out.finish_reason is not None and index == len(out.tokens) - 1
                yield sse(_event(shown, session, req, started, text if is_final else None))
            if out.finish_reason is not None and not out.tokens:
                yield sse(_event(last or TokenOut(0, "", True), session, req, started, text))
    except SwitchboardError as exc:
        yield sse(tgi_body(exc.kind, exc.message))
    finally:
        await session.close()


def _event(token: TokenOut, session: Session, req: TgiRequest, started: Started, final: str | None) -> dict[str, Any]:
    details = None
    if final is not None and req.wants_details:
        details = {"prompt_tokens": started.prompt_tokens,
                   "finish_reason": FINISH.get(session.finish_reason, "stop_sequence"),
                   "generated_tokens": session.generated, "seed": started.seed}
    return {"token": token_json(token), "generated_text": None if final is None else full_text(req, final),
            "details": details}
