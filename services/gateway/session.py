"""One choice's round trip: publish to the tokenizer, read its events as steps, cancel, report metrics.

A session is always owned by a :class:`~services.gateway.call.Call`, which admits it, starts it and
closes it. Its events reach the family builders as :class:`Step` items; the last one carries an
:class:`End` (text, finish reason, counts), so no builder re-derives the end of a stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from shared import bus, subjects, telemetry
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Cancel, Failed, Finished, FirstToken, GenerateRequest, Output, Received, Sampling, Started, TokenOut

START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class End:
    """How a choice ended: its whole text and tokens, the engine's finish reason and the counts."""

    finish_reason: str  # length | eos_token | stop_sequence | cancelled
    text: str
    tokens: list[TokenOut]
    generated_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class Step:
    """New tokens of choice ``index``; ``end`` is set on the last step of that choice (its tokens may be empty)."""

    index: int
    tokens: list[TokenOut] = field(default_factory=list)
    end: End | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


class Session:
    """``user_id`` is the id a client gave the request (Triton ``id``), by which stopInfer finds it."""

    def __init__(self, gateway, prompt: str, sampling: Sampling, user_id: str | None = None, **fields):
        self.gw = gateway
        self.id = uuid.uuid4().hex
        self.user_id = user_id or self.id
        self.arrival = time.time()
        self.reply_to, self.queue = gateway.mailboxes.open(self.id)
        self.span = telemetry.start_span("gateway.request", None, **{"switchboard.request_id": self.id})
        self.request = GenerateRequest(
            id=self.id, trace=telemetry.inject(self.span), model=gateway.model, reply_to=self.reply_to,
            prompt=prompt, sampling=sampling, arrival=self.arrival, **fields,
        )
        self.index = 0  # the choice number within its call
        self.started: Started | None = None
        self.published = False
        self.closed = False
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.generated = 0
        self.tokens: list[TokenOut] = []

    async def start(self) -> Started:
        """Publish the request and wait for the tokenizer's answer (raises on a validation error)."""
        self.gw.register(self)
        self.gw.emit(Received(id=self.id, model=self.gw.model))
        self.published = True
        await bus.publish(self.gw.nc, subjects.TOKENIZER_GENERATE, self.request)
        event = await self._next(START_TIMEOUT_S, "the tokenizer service did not answer")
        if isinstance(event, Started):
            self.started = event
            return event
        raise self._error(event)

    async def steps(self) -> AsyncIterator[Step]:
        """Steps until the one carrying the end; raises SwitchboardError on a failure event."""
        timeout = float(self.gw.cfg.server.token_timeout) + 5.0
        while self.finish_reason is None:
            event = await self._next(timeout, "no token arrived within tokenTimeout")
            if not isinstance(event, Output):
                raise self._error(event)
            yield self._observe(event)

    async def result(self) -> End:
        """Run to the end and return it."""
        async for step in self.steps():
            if step.end is not None:
                return step.end
        raise SwitchboardError(ErrorKind.INTERNAL, "the request ended without an end event")

    async def _next(self, timeout: float, what: str):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise SwitchboardError(ErrorKind.UNAVAILABLE if self.started is None else ErrorKind.TIMEOUT, what) from None

    def _error(self, event) -> SwitchboardError:
        self.finish_reason = "error"
        if isinstance(event, Failed):
            return SwitchboardError(event.error.kind, event.error.message, event.error.param)
        return SwitchboardError(ErrorKind.INTERNAL, f"unexpected event {type(event).__name__}")

    def _observe(self, event: Output) -> Step:
        if event.tokens and self.first_token_at is None:
            self.first_token_at = time.time()
            self.gw.emit(FirstToken(id=self.id, model=self.gw.model, ttft_s=self.first_token_at - self.arrival))
        self.tokens.extend(event.tokens)
        self.generated = event.generated_tokens
        self.finish_reason = event.finish_reason
        end = None
        if event.finish_reason is not None:
            end = End(event.finish_reason, "".join(t.text for t in self.tokens), self.tokens, self.generated,
                      self.started.prompt_tokens if self.started else 0)
        return Step(self.index, event.tokens, end)

    def close(self) -> None:
        """Idempotent and never suspends (so a cancelled caller still completes it): free the mailbox,
        cancel an unfinished request, report the end. Publishing runs as a background task."""
        if self.closed:
            return
        self.closed = True
        self.gw.mailboxes.close(self.id)
        self.gw.unregister(self)
        if not self.published:
            telemetry.end_span(self.span, None, **{"switchboard.finish_reason": "not_started"})
            return
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self.gw.spawn(bus.publish(self.gw.nc, subjects.CANCEL, Cancel(id=self.id, reason="client_disconnected")))
        self._report()

    def _report(self) -> None:
        now = time.time()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        prompt_tokens = self.started.prompt_tokens if self.started else 0
        telemetry.end_span(self.span, "failed" if self.finish_reason == "error" else None, **{
            "switchboard.finish_reason": self.finish_reason, "switchboard.generated_tokens": self.generated})
        self.gw.emit(Finished(id=self.id, model=self.gw.model, arrival=self.arrival, e2e_s=now - self.arrival,
                              ttft_s=ttft, prompt_tokens=prompt_tokens, generated_tokens=self.generated,
                              finish_reason=self.finish_reason))
