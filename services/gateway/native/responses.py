"""MindIE-native response shapes: one object, or SSE events with per-token timings (reference §3.27)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import msgspec

from services.gateway.errors import mindie_body
from services.gateway.native.schemas import NativeRequest
from services.gateway.session import Session
from services.gateway.tgi.responses import FINISH
from shared.errors import SwitchboardError
from shared.messages import Started, TokenOut


def details(session: Session, started: Started, token_ids: list[int]) -> dict[str, Any]:
    return {"finish_reason": FINISH.get(session.finish_reason, "stop_sequence"),
            "generated_tokens": session.generated, "seed": started.seed, "generated_token_ids": token_ids}


async def collect(session: Session, req: NativeRequest, started: Started) -> dict[str, Any]:
    tokens: list[TokenOut] = []
    async for out in session.outputs():
        tokens.extend(out.tokens)
    body: dict[str, Any] = {"generated_text": "".join(t.text for t in tokens)}
    if req.details:
        body["details"] = details(session, started, [t.id for t in tokens])
    return body


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class _Clock:
    """prefill_time on the first event (ms since arrival), decode_time on later ones (ms since the last)."""

    def __init__(self, arrival: float):
        self.last = arrival
        self.first = True

    def times(self) -> dict[str, int | None]:
        now = time.time()
        elapsed, self.last = round((now - self.last) * 1000), now
        if self.first:
            self.first = False
            return {"prefill_time": elapsed, "decode_time": None}
        return {"prefill_time": None, "decode_time": elapsed}


async def stream_events(session: Session, req: NativeRequest, started: Started, full_text_mode: bool) -> AsyncIterator[bytes]:
    clock, text, ids = _Clock(session.arrival), "", []
    try:
        async for out in session.outputs():
            for index, token in enumerate(out.tokens):
                text += token.text
                ids.append(token.id)
                if out.finish_reason is None or index < len(out.tokens) - 1:
                    shown = text if full_text_mode else token.text
                    yield sse({**clock.times(), "token": {"id": [token.id], "text": shown}})
            if out.finish_reason is not None:
                last = [out.tokens[-1].id] if out.tokens else []
                yield sse({**clock.times(), "generated_text": text,
                           "details": details(session, started, ids) if req.details else None,
                           "token": {"id": last, "text": None}})
    except SwitchboardError as exc:
        yield sse(mindie_body(exc.kind, exc.message))
    finally:
        await session.close()
