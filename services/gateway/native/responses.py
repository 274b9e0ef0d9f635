"""MindIE-native response shapes: one object, or SSE events with per-token timings (reference §3.27)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import msgspec

from services.gateway.common import finish
from services.gateway.native.schemas import NativeRequest
from services.gateway.request.call import Call
from services.gateway.request.session import End
from services.gateway.web.errors import mindie_body
from shared.errors import SwitchboardError


def details(call: Call, end: End) -> dict[str, Any]:
    return {"finish_reason": finish.tgi(end.finish_reason),
            "generated_tokens": end.generated_tokens, "seed": call.started[0].seed,
            "generated_token_ids": [t.id for t in end.tokens]}


async def collect(call: Call, req: NativeRequest) -> dict[str, Any]:
    end = (await call.results())[0]
    body: dict[str, Any] = {"generated_text": end.text}
    if req.details:
        body["details"] = details(call, end)
    return body


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(exc: SwitchboardError) -> bytes:
    return sse(mindie_body(exc.kind, exc.message))


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


async def stream_events(call: Call, req: NativeRequest, full_text_mode: bool) -> AsyncIterator[bytes]:
    """A token event per token; the last token comes in the final event with generated_text and details."""
    clock, text = _Clock(call.sessions[0].arrival), ""
    async for step in call.steps():
        for index, token in enumerate(step.tokens):
            text += token.text
            if step.end is None or index < len(step.tokens) - 1:
                shown = text if full_text_mode else token.own_text  # (seed 003: the token's own text)
                yield sse({**clock.times(), "token": {"id": [token.id], "text": shown}})
        if step.end is not None:
            last = [step.tokens[-1].id] if step.tokens else []
            yield sse({**clock.times(), "generated_text": step.end.text,
                       "details": details(call, step.end) if req.details else None,
                       "token": {"id": last, "text": None}})
