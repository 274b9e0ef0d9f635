"""One request's round trip: publish to the tokenizer, read its events, cancel, report metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from shared import bus, subjects, telemetry
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Cancel, Failed, Finished, FirstToken, GenerateRequest, Output, Received, Sampling, Started

START_TIMEOUT_S = 30.0


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
        self.started: Started | None = None
        self.admitted = False  # holds one of the gateway's maxLinkNum slots
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.generated = 0

    async def start(self) -> Started:
        """Publish the request and wait for the tokenizer's answer (raises on a validation error)."""
        self.gw.require_engine()
        await self.gw.admit()
        self.admitted = True
        self.gw.register(self)
        self.gw.emit(Received(id=self.id, model=self.gw.model))
        await bus.publish(self.gw.nc, subjects.TOKENIZER_GENERATE, self.request)
        event = await self._next(START_TIMEOUT_S, "the tokenizer service did not answer")
        if isinstance(event, Started):
            self.started = event
            return event
        raise self._error(event)

    async def outputs(self) -> AsyncIterator[Output]:
        """Output events until the final one; raises SwitchboardError on a failure event."""
        timeout = float(self.gw.cfg.server.token_timeout) + 5.0
        while self.finish_reason is None:
            event = await self._next(timeout, "no token arrived within tokenTimeout")
            if not isinstance(event, Output):
                raise self._error(event)
            self._observe(event)
            yield event

    async def _next(self, timeout: float, what: str):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise SwitchboardError(ErrorKind.UNAVAILABLE if self.started is None else ErrorKind.TIMEOUT, what) from None

    def _error(self, event) -> SwitchboardError:
        self.finish_reason = "error"
        if isinstance(event, Failed):
            return SwitchboardError(event.error.kind, event.error.message)
        return SwitchboardError(ErrorKind.INTERNAL, f"unexpected event {type(event).__name__}")

    def _observe(self, event: Output) -> None:
        if event.tokens and self.first_token_at is None:
            self.first_token_at = time.time()
            self.gw.emit(FirstToken(id=self.id, model=self.gw.model, ttft_s=self.first_token_at - self.arrival))
        self.generated = event.generated_tokens
        self.finish_reason = event.finish_reason

    async def close(self) -> None:
        """Always called: cancel an unfinished request, free the mailbox, report the lifecycle."""
        self.gw.mailboxes.close(self.id)
        self.gw.unregister(self)
        if self.admitted:
            self.admitted = False
            self.gw.release()
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            await bus.publish(self.gw.nc, subjects.CANCEL, Cancel(id=self.id, reason="client_disconnected"))
        now = time.time()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        prompt_tokens = self.started.prompt_tokens if self.started else 0
        telemetry.end_span(self.span, "failed" if self.finish_reason == "error" else None, **{
            "switchboard.finish_reason": self.finish_reason, "switchboard.generated_tokens": self.generated})
        self.gw.emit(Finished(id=self.id, model=self.gw.model, arrival=self.arrival, e2e_s=now - self.arrival,
                              ttft_s=ttft, prompt_tokens=prompt_tokens, generated_tokens=self.generated,
                              finish_reason=self.finish_reason))

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
