"""What chat and completions bodies share: ids, usage placement and SSE framing."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec

from services.gateway.common.version import version
from services.gateway.openai_api.errors import switchboard_body
from services.gateway.request.call import Call
from services.gateway.request.session import Step
from shared.errors import SwitchboardError

DONE = b"data: [DONE]\n\n"


@dataclass
class Meta:
    """The head every body and chunk of one response repeats."""

    object: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = ""

    @classmethod
    def new(cls, prefix: str, obj: str, model: str, request_id: str = "", call: Call | None = None) -> "Meta":
        """The id is ``<prefix>-<request_id>`` (vLLM's request_id field), else ``<prefix>-<random hex>``."""
        return cls(obj, model, f"{prefix}-{request_id or uuid.uuid4().hex}",
                   fingerprint=system_fingerprint(call) if call is not None else "")

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.fingerprint:
            head["system_fingerprint"] = self.fingerprint
        return {**head, "choices": choices, **extra}


def system_fingerprint(call: Call) -> str:
    """OpenAI's ``system_fingerprint``: the backend configuration the answer ran with, hashed (``fp_`` and 10 hex
    digits): Switchboard's version and the serving engine's device, dtype, weight format, KV-cache dtype and
    block size, so it changes when something that may change a seeded answer does (TGI's own client requires
    the field on chat answers)."""
    engine = call.started[0].engine if call.started else ""
    info = call.ctx.failover.engines.get(engine) if engine else None
    info = info or call.ctx.engine_info()
    if info is None:
        return _fingerprint(call.ctx.model, "", "", "", "", 0)
    return _fingerprint(call.ctx.model, info.device, info.dtype, info.quantization, info.kv_dtype or info.dtype,
                        info.block_size)


@lru_cache(maxsize=64)
def _fingerprint(*config: Any) -> str:
    text = "\0".join(map(str, (version(), *config)))
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:10]


class UsagePlacement:
    """include_usage: ``usage: null`` on every chunk and a last ``choices: []`` chunk with the usage; with
    vLLM's ``continuous_usage_stats`` too, every chunk carries its choice's usage so far instead of null.
    Without include_usage, the chunk that ends the last choice carries the usage (MindIE), the others none."""

    def __init__(self, call: Call, include_usage: bool, continuous: bool = False):
        self.call = call
        self.include = include_usage
        self.continuous = include_usage and continuous
        self.unfinished = len(call)
        self.generated = [0] * len(call)

    def count(self, step: Step) -> None:
        """Every step of the stream, sent or held back: its choice's tokens so far."""
        self.generated[step.index] += len(step.tokens)
        if step.end is not None:
            self.generated[step.index] = step.end.generated_tokens

    def on_chunk(self, ends_a_choice: bool, index: int = 0) -> dict[str, Any]:
        self.unfinished -= ends_a_choice
        if self.continuous:
            prompt = self.call.started[index].prompt_tokens
            return {"usage": {"prompt_tokens": prompt, "completion_tokens": self.generated[index],
                              "total_tokens": prompt + self.generated[index]}}
        if self.include:
            return {"usage": None}
        return {"usage": self.call.usage()} if ends_a_choice and not self.unfinished else {}

    def closing(self, meta: Meta) -> list[dict[str, Any]]:
        return [meta.body([], usage=self.call.usage())] if self.include else []


def token_id_text(token_id: int) -> str:
    """A logprobs token as vLLM's return_tokens_as_token_ids shows it."""
    return f"token_id:{token_id}"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(exc: SwitchboardError) -> bytes:
    """A failure after the stream started: an error event (then [DONE], the lifecycle's trailer)."""
    return sse(switchboard_body(exc))
