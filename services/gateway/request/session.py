"""One choice's round trip: publish to the tokenizer, read its events as steps, cancel, report metrics.

A session is always owned by a :class:`~services.gateway.request.call.Call`, which admits it, starts it and
closes it. Its events reach the family builders as :class:`Step` items; the last one carries an
:class:`End` (text, finish reason, counts), so no builder re-derives the end of a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import msgspec

from shared import bus, subjects, telemetry
from shared.errors import ErrorInfo, ErrorKind, SwitchboardError
from shared.messages import (
    Cancel,
    CancelKind,
    Failed,
    FinishReason,
    GenerateRequest,
    Output,
    Sampling,
    Started,
    TokenOut,
)
from shared.metrics_messages import PROBE_API, Finished, FirstToken, Intervals, Received

from services.gateway.request.marks import mark_received
from shared.aio import within

if TYPE_CHECKING:
    from services.gateway.request.context import SessionContext

log = logging.getLogger("switchboard.gateway")
START_TIMEOUT_S = 30.0
MAX_RESUMES = 8  # attempts after the first; beyond them the request ends with an error


class Resume:
    """Put into a session's queue by the failover watch: an owner of the request died or messages may
    have been lost (a NATS reconnect); the session's reader resumes it."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass(frozen=True)
class End:
    """How a choice ended: its whole text and tokens, the engine's finish reason and the counts."""

    finish_reason: FinishReason
    text: str
    tokens: list[TokenOut]
    generated_tokens: int
    prompt_tokens: int
    stop: str = ""  # the stop string that ended it (finish_reason stop_sequence)


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
    """``user_id`` is the id a client gave the request (Triton ``id``), by which stopInfer finds it; ``api`` the
    family and route it came by (``tgi``, ``openai-chat``, ``anthropic``, …): a label on the request counters."""

    def __init__(self, ctx: SessionContext, prompt: str, sampling: Sampling, user_id: str | None = None,
                 api: str = "", **fields):
        self.ctx = ctx
        self.api = api
        self.id = uuid.uuid4().hex
        self.user_id = user_id or self.id
        self.arrival = time.time()
        self.reply_to, self.queue = ctx.mailboxes.open(self.id)
        self.span = telemetry.start_span("gateway.request", None, **{"switchboard.request_id": self.id})
        self.request = GenerateRequest(
            id=self.id, trace=telemetry.inject(self.span), model=ctx.model, reply_to=self.reply_to,
            prompt=prompt, sampling=sampling, arrival=self.arrival, gateway=ctx.instance, probe=api == PROBE_API,
            **fields,
        )
        self.span.set_attribute("switchboard.adapter", self.request.adapter)  # "" = the base model
        self.span.set_attribute("switchboard.api", api)
        self.attempt = 0  # resumes so far; the request's id on the bus is ``current_id``
        self.resume_asked = False
        self.index = 0  # the choice number within its call
        self.started: Started | None = None
        self.owned_since = 0.0  # monotonic time the current attempt's owners (``started``) answered
        self.published = False
        self.closed = False
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.intervals = Intervals()  # the time between each token and the one before it
        self.first_token = asyncio.Event()  # set with the first token, or at the end (PD split answers then)
        self.finish_reason: FinishReason | None = None
        self.error = ""  # the failure's message, when it ends with one
        self.upstream_ended = False  # the current attempt ended upstream (its failure or last output came)
        self.generated = 0
        self.tokens: list[TokenOut] = []
        self.prompt: list[TokenOut] = []  # the prompt's tokens with their logprobs, when they were asked
        self.cached_tokens = 0  # prompt tokens the engine found in its prefix cache (the first attempt's)

    async def start(self) -> Started:
        """Publish the request and wait for the tokenizer's answer (raises on a validation error)."""
        self.ctx.inflight.add(self)
        self.published = True
        deadline = time.monotonic() + START_TIMEOUT_S + self.media_allowance
        failover = self.ctx.failover
        deaths, patience = failover.tokenizer_deaths, 0.0
        while True:
            subject = subjects.TOKENIZER_GENERATE if self.attempt == 0 else failover.tokenizer_subject()
            epoch = failover.bus_epoch()
            await bus.publish(self.ctx.nc, subject, msgspec.structs.replace(self.request, id=self.current_id))
            asked = time.monotonic()
            event = await self._answer(deadline, lambda: not failover.heard() or failover.lost_in_outage(epoch) or (
                failover.tokenizer_deaths != deaths and time.monotonic() - asked >= patience))
            if isinstance(event, Started):
                self.started, self.owned_since = event, time.monotonic()
                self._received()
                return event
            if event is not None:
                raise self._error(event)
            if time.monotonic() >= deadline:
                raise self._fail(ErrorKind.UNAVAILABLE, "the tokenizer service did not answer")
            if not failover.heard():  # the fleet went silent (the bus is down?): 503 unless it is back in a lease
                try:
                    await failover.wait_serving("the request could not start:")
                except SwitchboardError as exc:
                    raise self._fail(exc.kind, exc.message) from None
            # The bus came back, or a tokenizer died, since the first try: the request may be lost with either.
            self._supersede("the message bus reconnected before a tokenizer answered"
                            if failover.lost_in_outage(epoch) else "a tokenizer died before it answered")
            patience = self.ctx.resume_timeout_s  # the next try goes to a live tokenizer: give it time

    @property
    def media_allowance(self) -> float:
        """What a tokenizer may take, beyond encoding, to answer a request with media: their fetching (and
        processing), up to mediaRequestTimeoutSeconds, after which it answers with the media's error."""
        return self.ctx.media_timeout_s if any(part.media is not None for part in self.request.parts) else 0.0

    def _received(self) -> None:
        """The tokenizer took the request (its input is valid): from here its end is counted with the request
        counters. Before, a failure is its HTTP request's refusal (``web/refusals.py``), counted once there."""
        self.ctx.emit(Received(id=self.id, model=self.ctx.model, adapter=self.request.adapter, api=self.api,
                               gateway=self.ctx.instance))
        mark_received()

    async def _answer(self, deadline: float, ask_again=lambda: False):
        """The current attempt's Started or Failed; None at the deadline, or once ``ask_again()`` (checked
        every heartbeat interval) says to give up on this attempt. Resume markers that come meanwhile are
        dropped: the attempt being awaited supersedes them."""
        tick = self.ctx.heartbeat_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = await within(self.queue.get(), min(left, tick))
            except asyncio.TimeoutError:
                if ask_again():
                    return None
                continue
            if not isinstance(event, Resume) and event.id == self.current_id:
                return event
        return None

    def _supersede(self, reason: str) -> None:
        """Cancel the current attempt and move on to the next id (at most MAX_RESUMES times)."""
        if self.attempt >= MAX_RESUMES:
            raise self._fail(ErrorKind.UNAVAILABLE, f"the request was lost {self.attempt + 1} times ({reason})")
        self.ctx.spawn(bus.publish(self.ctx.nc, subjects.CANCEL, Cancel(id=self.current_id, reason=CancelKind.SUPERSEDED)))
        self.attempt += 1
        log.info("resuming request", extra={"request_id": self.id, "attempt": self.attempt, "reason": reason,
                                            "position": len(self.tokens)})

    @property
    def current_id(self) -> str:
        """The id of the current attempt: events of superseded attempts are ignored."""
        return self.id if self.attempt == 0 else f"{self.id}-r{self.attempt}"

    @property
    def owners(self) -> tuple[str, str]:
        """(tokenizer, engine) instances serving the current attempt ("" before it started)."""
        return (self.started.tokenizer, self.started.engine) if self.started else ("", "")

    def ask_resume(self, reason: str) -> None:
        """From the failover watch: resume this request at the reader's next event (once per ask)."""
        if not self.resume_asked and self.started is not None and self.finish_reason is None:
            self.resume_asked = True
            self.queue.put_nowait(Resume(reason))

    def cut(self, why: str) -> None:
        """End this request at its reader's next event with a 503 saying ``why`` (the shutdown grace is over): in
        its family's shape, a stream's last event, rather than the plain-text 500 of a cancelled handler."""
        if self.finish_reason is None:
            self.queue.put_nowait(Failed(id=self.current_id, error=ErrorInfo(ErrorKind.UNAVAILABLE, why)))

    async def steps(self) -> AsyncIterator[Step]:
        """Steps until the one carrying the end; raises SwitchboardError on a failure event.

        Exactly once: each output carries its position; a gap (a lost event), a retryable failure or
        a dead owner resumes the request from the tokens already delivered, and anything delivered
        twice is dropped."""
        timeout = self.ctx.token_timeout_s
        while self.finish_reason is None:
            event = await self._next(timeout, "no token arrived within tokenTimeout")
            if isinstance(event, Resume):
                await self._resume(event.reason)
            elif event.id != self.current_id:
                continue  # from a superseded attempt
            elif isinstance(event, Failed) and event.retryable:
                await self._resume(event.error.message)
            elif not isinstance(event, Output):
                raise self._error(event)
            elif event.position > len(self.tokens):
                await self._resume(f"token events {len(self.tokens)}..{event.position - 1} were lost")
            elif step := self._observe(self._unseen(event)):
                yield step

    def _unseen(self, event: Output) -> Output:
        """The part of ``event`` not delivered yet (all of it, unless it overlaps what was)."""
        seen = len(self.tokens) - event.position
        return event if seen <= 0 else msgspec.structs.replace(event, tokens=event.tokens[seen:], position=len(self.tokens))

    async def _resume(self, reason: str) -> None:
        """Supersede the current attempt with one that starts from the tokens delivered so far, through any
        live tokenizer and engine (greedy and seeded requests give exactly the tokens of an unbroken run)."""
        while True:
            try:
                await self.ctx.failover.wait_serving(f"the request was interrupted ({reason}) and")
            except SwitchboardError as exc:
                raise self._failed(exc) from None
            self._supersede(reason)
            event = await self._publish_attempt()
            if isinstance(event, Started):
                self.started = msgspec.structs.replace(self.started, tokenizer=event.tokenizer, engine=event.engine)
                self.owned_since = time.monotonic()
                self.resume_asked = False  # asks about the old owners were dropped while waiting; new ones count
                return
            if not (isinstance(event, Failed) and event.retryable):
                raise self._error(event)
            reason = event.error.message

    async def _publish_attempt(self):
        """Publish the current attempt; its Started or Failed (a timeout reads as a retryable failure)."""
        sampling = msgspec.structs.replace(self.request.sampling, seed=self.started.seed)
        request = msgspec.structs.replace(self.request, id=self.current_id, sampling=sampling,
                                          resume_ids=[t.id for t in self.tokens])
        await bus.publish(self.ctx.nc, self.ctx.failover.tokenizer_subject(), request)
        event = await self._answer(time.monotonic() + self.ctx.resume_timeout_s + self.media_allowance)
        return event or Failed(id=self.current_id, error=ErrorInfo(ErrorKind.UNAVAILABLE, "no tokenizer answered"),
                      retryable=True)

    def _fail(self, kind: ErrorKind, message: str) -> SwitchboardError:
        return self._failed(SwitchboardError(kind, message))

    def _failed(self, exc: SwitchboardError) -> SwitchboardError:
        """The request ends with ``exc`` here (``close`` cancels its attempt unless that ended upstream)."""
        self.finish_reason = FinishReason.ERROR
        self.error = exc.message
        return exc

    async def result(self) -> End:
        """Run to the end and return it."""
        async for step in self.steps():
            if step.end is not None:
                return step.end
        raise SwitchboardError(ErrorKind.INTERNAL, "the request ended without an end event")

    async def _next(self, timeout: float, what: str):
        try:
            return await within(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise self._fail(ErrorKind.UNAVAILABLE if self.started is None else ErrorKind.TIMEOUT, what) from None

    def _error(self, event) -> SwitchboardError:
        if isinstance(event, Failed):
            self.upstream_ended = True
            return self._failed(SwitchboardError(event.error.kind, event.error.message, event.error.param))
        return self._fail(ErrorKind.INTERNAL, f"unexpected event {type(event).__name__}")

    def _observe(self, event: Output) -> Step | None:
        """The step an output makes (None when it brings nothing new)."""
        if not event.tokens and event.finish_reason is None:
            return None
        if event.prompt and not self.prompt:  # with the first token (a resumed attempt's are ignored)
            self.prompt = event.prompt
        now = time.time()
        if event.tokens and self.first_token_at is None:
            if event.position == 0:
                self.cached_tokens = event.cached_tokens
            self.first_token_at = self.last_token_at = now
            if self.api != PROBE_API:  # (a health probe's token is not a client's: latencies leave it out)
                self.ctx.emit(FirstToken(id=self.id, model=self.ctx.model, ttft_s=self.first_token_at - self.arrival))
        elif (new := event.generated_tokens - self.generated) > 0 and self.first_token_at is not None:
            self.intervals.add(now - self.last_token_at, new)
            self.last_token_at = now
        self.tokens.extend(event.tokens)
        self.generated = event.generated_tokens
        self.finish_reason = event.finish_reason
        self.upstream_ended = event.finish_reason is not None
        if self.tokens or self.finish_reason is not None:
            self.first_token.set()
        end = None
        if event.finish_reason is not None:
            end = End(event.finish_reason, "".join(t.text for t in self.tokens), self.tokens, self.generated,
                      self.started.prompt_tokens if self.started else 0, event.stop)
        return Step(self.index, event.tokens, end)

    def close(self) -> None:
        """Idempotent and never suspends (so a cancelled caller still completes it): free the mailbox,
        cancel an unfinished request, report the end. Publishing runs as a background task."""
        if self.closed:
            return
        self.closed = True
        self.ctx.mailboxes.close(self.id)
        self.ctx.inflight.remove(self)
        if not self.published:
            telemetry.end_span(self.span, None, **{"switchboard.finish_reason": "not_started"})
            return
        if not self.upstream_ended:  # nobody listens for the rest: its tokenizer and engine stop it
            self.ctx.spawn(bus.publish(self.ctx.nc, subjects.CANCEL, Cancel(id=self.current_id,
                                                                            reason=CancelKind.CLIENT_DISCONNECTED)))
        if self.finish_reason is None:
            self.finish_reason = FinishReason.CANCELLED
        self._report()

    def _report(self) -> None:
        telemetry.end_span(self.span, (self.error or "failed") if self.finish_reason is FinishReason.ERROR else None, **{
            "switchboard.finish_reason": str(self.finish_reason), "switchboard.generated_tokens": self.generated})
        if self.started is not None:  # (received: see ``_received``)
            self._finished()

    def _finished(self) -> None:
        now = time.time()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        self.ctx.emit(Finished(id=self.id, model=self.ctx.model, arrival=self.arrival, e2e_s=now - self.arrival,
                               ttft_s=ttft, prompt_tokens=self.started.prompt_tokens, generated_tokens=self.generated,
                               finish_reason=self.finish_reason, adapter=self.request.adapter, api=self.api,
                               intervals=self.intervals if any(self.intervals.counts) else None))
