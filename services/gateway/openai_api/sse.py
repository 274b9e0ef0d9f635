"""What chat and completions bodies share: ids, usage placement and SSE framing."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

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

    @classmethod
    def new(cls, prefix: str, obj: str, model: str, request_id: str = "") -> "Meta":
        """The id is ``<prefix>-<request_id>`` (vLLM's request_id field), else ``<prefix>-<random hex>``."""
        return cls(obj, model, f"{prefix}-{request_id or uuid.uuid4().hex}")

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """No ``system_fingerprint``: OpenAI's schema wants a string or nothing, and there is no backend
        configuration fingerprint to report."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


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
