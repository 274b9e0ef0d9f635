"""What chat and completions bodies share: ids, end reasons, usage placement and SSE framing."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec

from services.gateway.openai_api.errors import error_body, switchboard_body
from services.gateway.openai_api.runner import Batch
from shared.errors import SwitchboardError

log = logging.getLogger("switchboard.gateway")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def finish_reason(engine_reason: str | None) -> str | None:
    """eos_token, stop_sequence (and a stopInfer abort) are "stop"; length stays "length"."""
    if engine_reason is None:
        return None
    return "length" if engine_reason == "length" else "stop"


@dataclass
class Meta:
    """The head every body and chunk of one response repeats."""

    object: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, obj: str, model: str) -> "Meta":
        return cls(obj, model, f"{prefix}-{uuid.uuid4().hex}")

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}


class UsagePlacement:
    """include_usage: ``usage: null`` on every chunk and a last ``choices: []`` chunk with the usage.
    Without it, the chunk that ends the last choice carries the usage (MindIE), the others none."""

    def __init__(self, batch: Batch, include_usage: bool):
        self.batch = batch
        self.include = include_usage
        self.unfinished = len(batch)

    def on_chunk(self, ends_a_choice: bool) -> dict[str, Any]:
        self.unfinished -= ends_a_choice
        if self.include:
            return {"usage": None}
        return {"usage": self.batch.usage()} if ends_a_choice and not self.unfinished else {}

    def closing(self, meta: Meta) -> list[dict[str, Any]]:
        return [meta.body([], usage=self.batch.usage())] if self.include else []


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def sse_stream(batch: Batch, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Frame chunks as SSE, end with [DONE]; a failure after the start is an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except SwitchboardError as exc:
        yield sse(switchboard_body(exc))
    except Exception as exc:  # noqa: BLE001 - the stream must still end cleanly
        log.exception("stream failed", exc_info=exc)
        yield sse(error_body(500, "Server internal error"))
    finally:
        await batch.close()
    yield DONE
