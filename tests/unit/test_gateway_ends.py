"""Every way a request can end in the gateway releases everything it held exactly once and says so once.

A real Gateway (its mailboxes, slots, failover watch and metrics emission) on a real nats-server; the test
speaks for the tokenizer and the engine over the bus (heartbeats, Started, Output, Failed). The ends: the
last output, Triton's stopInfer, the client leaving, tokenTimeout, a failure, a retryable failure (the
attempt superseded by a resumed one), the engine's lease running out, a refusal before the request was
published, and a call taken over by an owner that outlives its ``async with`` (a stream, MindIE's relay).
Each must leave no slot held, no mailbox open and nothing in the in-flight registry, end the request's
span once, report one ``Finished`` (none for a request never published), and cancel upstream exactly
when its attempt still runs there."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import msgspec
import pytest

from services.gateway.core import Gateway
from services.gateway.request.call import Call
from services.gateway.request.session import End, Session
from shared import bus, subjects
from shared.config import load_config
from shared.errors import ErrorInfo, ErrorKind, SwitchboardError
from shared.messages import (
    Cancel,
    CancelKind,
    EngineInfo,
    Failed,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    Output,
    Sampling,
    Started,
    TokenOut,
    decoder,
)
from shared.metrics_messages import Finished, MetricsEvent
from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config

LEASE_S = 1.0
TOKENIZER, ENGINE = "tok-1", "engine-1"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    nats = EmbeddedNats()
    url = nats.start()
    cfg = load_config(write_config(tmp_path_factory.mktemp("gateway-ends"), tiny_model_dir,
                                   Switchboard={"leaseSeconds": LEASE_S}))
    try:
        yield url, cfg
    finally:
        nats.stop()


class Upstream:
    """The tokenizer's and the engine's side: heartbeats while ``engine_alive``, the requests and cancels
    the gateway sent, the metrics events it emitted; ``answer`` sends a request's events to its gateway."""

    def __init__(self, nc, model: str):
        self.nc, self.model = nc, model
        self.requests: list[GenerateRequest] = []
        self.cancels: list[Cancel] = []
        self.finished: list[Finished] = []
        self.engine_alive = True
        self._beating: asyncio.Task | None = None

    async def start(self) -> None:
        requests, cancels, events = decoder(GenerateRequest), decoder(Cancel), decoder(MetricsEvent)

        async def on_request(msg):
            self.requests.append(requests.decode(msg.data))

        async def on_cancel(msg):
            self.cancels.append(cancels.decode(msg.data))

        async def on_event(msg):
            event = events.decode(msg.data)
            if isinstance(event, Finished):
                self.finished.append(event)

        await self.nc.subscribe(subjects.TOKENIZER_GENERATE, cb=on_request)
        await self.nc.subscribe(subjects.tokenizer_instance(TOKENIZER), cb=on_request)
        await self.nc.subscribe(subjects.CANCEL, cb=on_cancel)
        await self.nc.subscribe(subjects.METRICS_EVENTS, cb=on_event)
        self._beating = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        while True:
            await bus.publish(self.nc, subjects.heartbeat("tokenizer"),
                              Heartbeat(service="tokenizer", instance=TOKENIZER, model=self.model))
            if self.engine_alive:
                await bus.publish(self.nc, subjects.engine_heartbeat(self.model), EngineInfo(
                    model=self.model, loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=64,
                    free_blocks=64, running=0, waiting=0, instance=ENGINE))
            await asyncio.sleep(LEASE_S / 4)

    async def stop(self) -> None:
        self._beating.cancel()

    async def request(self, attempt: int = 0) -> GenerateRequest:
        await until(lambda: len(self.requests) > attempt, f"attempt {attempt} never reached the tokenizer")
        return self.requests[attempt]

    async def answer(self, req: GenerateRequest, *events) -> None:
        for event in events:
            await bus.publish(self.nc, req.reply_to, event)
        await self.nc.flush()

    def cancels_of(self, session: Session) -> list[tuple[str, CancelKind]]:
        return [(c.id, c.reason) for c in self.cancels if c.id.startswith(session.id)]


async def until(check, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def started(req: GenerateRequest) -> Started:
    return Started(id=req.id, prompt_tokens=3, seed=7, tokenizer=TOKENIZER, engine=ENGINE)


def output(req: GenerateRequest, finish: FinishReason | None, position: int = 0) -> Output:
    return Output(id=req.id, position=position, tokens=[TokenOut(42, "hi", False)], finish_reason=finish,
                  generated_tokens=position + 1)


async def whole(call: Call) -> list[End]:
    async with call:
        await call.start()
        return await call.results()


async def launch(call: Call, upstream: Upstream) -> tuple[asyncio.Future, GenerateRequest]:
    """The call run whole in the background, and its request as the tokenizer received it."""
    return asyncio.ensure_future(whole(call)), await upstream.request()


def run(world, spans, scenario, context=lambda ctx: ctx, published: bool = True, **session_fields):
    """A gateway and its upstream; ``scenario(gateway, upstream, call)`` drives one single-choice call to its
    end. Then the checks every end shares; the upstream and the session, for the scenario's own checks."""
    url, cfg = world

    async def main():
        nc_gateway, nc_upstream = await bus.connect(url, "gateway"), await bus.connect(url, "upstream")
        gateway = Gateway(cfg, nc_gateway)
        upstream = Upstream(nc_upstream, cfg.model.model_name)
        try:
            await gateway.start()
            await nc_gateway.flush()
            await upstream.start()
            await until(lambda: gateway.serving_engines() and gateway.failover.tokenizer_live(), "not serving")
            ctx = context(gateway.context)
            session = Session(ctx, "Hello", Sampling(max_new_tokens=4), **session_fields)
            spans.clear()
            result = await scenario(gateway, upstream, Call(ctx, [session]))
            await asyncio.sleep(0.2)  # anything reported or cancelled twice would have come by now
            assert gateway.slots.used == 0 and not gateway.slots.waiters
            assert len(gateway.inflight) == 0 and gateway.mailboxes.queues == {}
            ended = Counter(s.attributes.get("switchboard.request_id") for s in spans.get_finished_spans()
                            if s.name == "gateway.request")
            assert ended[session.id] == 1, ended
            assert len([f for f in upstream.finished if f.id == session.id]) == (1 if published else 0)
            return upstream, session, result
        finally:
            await upstream.stop()
            await nc_gateway.close()
            await nc_upstream.close()

    return asyncio.run(main())


def finished(upstream: Upstream, session: Session) -> FinishReason:
    [event] = [f for f in upstream.finished if f.id == session.id]
    return event.finish_reason


def test_the_last_output(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, started(req), output(req, FinishReason.LENGTH))
        return await task

    upstream, session, [end] = run(world, spans, scenario)
    assert end.finish_reason is FinishReason.LENGTH and end.text == "hi"
    assert finished(upstream, session) is FinishReason.LENGTH
    assert upstream.cancels_of(session) == []


def test_stop_infer(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, started(req), output(req, None))
        assert await gateway.stop_infer("client-7")
        await until(lambda: upstream.cancels, "stopInfer sent no cancel")
        await upstream.answer(req, Output(id=req.id, position=1, finish_reason=FinishReason.CANCELLED,
                                          generated_tokens=1))  # the engine's answer to the cancel
        return await task

    upstream, session, [end] = run(world, spans, scenario, user_id="client-7")
    assert end.finish_reason is FinishReason.CANCELLED and finished(upstream, session) is FinishReason.CANCELLED
    assert upstream.cancels_of(session) == [(session.id, CancelKind.STOP_INFER)]


def test_the_client_leaving(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, started(req), output(req, None))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    upstream, session, _ = run(world, spans, scenario)
    assert finished(upstream, session) is FinishReason.CANCELLED
    assert upstream.cancels_of(session) == [(session.id, CancelKind.CLIENT_DISCONNECTED)]


def test_token_timeout(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, started(req))  # and then nothing
        with pytest.raises(SwitchboardError) as raised:
            await task
        assert raised.value.kind is ErrorKind.TIMEOUT

    upstream, session, _ = run(world, spans, scenario, context=lambda ctx: dataclasses.replace(ctx, token_timeout_s=0.3))
    assert finished(upstream, session) is FinishReason.ERROR
    assert upstream.cancels_of(session) == [(session.id, CancelKind.CLIENT_DISCONNECTED)]  # it may still run


def test_a_failure(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        error = ErrorInfo(ErrorKind.TIMEOUT, "the request ran past its deadline")
        await upstream.answer(req, started(req), Failed(id=req.id, error=error))
        with pytest.raises(SwitchboardError) as raised:
            await task
        assert raised.value.kind is ErrorKind.TIMEOUT

    upstream, session, _ = run(world, spans, scenario)
    assert finished(upstream, session) is FinishReason.ERROR
    assert upstream.cancels_of(session) == []  # it ended upstream


def test_a_superseded_attempt(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        lost = ErrorInfo(ErrorKind.INTERNAL, "token events 1..2 were lost")
        await upstream.answer(req, started(req), output(req, None), Failed(id=req.id, error=lost, retryable=True))
        resumed = await upstream.request(1)
        assert resumed.id == f"{req.id}-r1" and resumed.resume_ids == [42]
        await upstream.answer(resumed, started(resumed), output(resumed, FinishReason.EOS_TOKEN, position=1))
        return await task

    upstream, session, [end] = run(world, spans, scenario)
    assert end.finish_reason is FinishReason.EOS_TOKEN and end.text == "hihi"
    assert finished(upstream, session) is FinishReason.EOS_TOKEN
    assert upstream.cancels_of(session) == [(session.id, CancelKind.SUPERSEDED)]


def test_the_engines_lease_running_out(world, spans):
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, started(req), output(req, None))
        upstream.engine_alive = False  # its engine dies: the failover watch sees its lease run out
        died = time.monotonic()
        with pytest.raises(SwitchboardError) as raised:
            await task
        # its lease runs out (≤ a lease), the watch sees it (≤ a heartbeat), and the resume waits a lease for an
        # engine to come back (Failover.wait_serving) before the 503: two leases and a heartbeat, with slack
        assert raised.value.kind is ErrorKind.UNAVAILABLE and time.monotonic() - died < 2 * LEASE_S + 1.0

    upstream, session, _ = run(world, spans, scenario)
    assert finished(upstream, session) is FinishReason.ERROR
    assert upstream.cancels_of(session) == [(session.id, CancelKind.CLIENT_DISCONNECTED)]


def test_an_engine_not_heard_yet_is_not_taken_for_dead(world, spans):
    """The tokenizer routed to an engine whose first heartbeat has not reached this gateway yet (it just
    started): within a lease of the answer naming it, the attempt is not resumed."""
    async def scenario(gateway, upstream, call):
        task, req = await launch(call, upstream)
        await upstream.answer(req, msgspec.structs.replace(started(req), engine="engine-new"))
        await asyncio.sleep(LEASE_S * 0.75)  # three failover checks
        await upstream.answer(req, output(req, FinishReason.LENGTH))
        return await task

    upstream, session, [end] = run(world, spans, scenario)
    assert end.finish_reason is FinishReason.LENGTH and len(upstream.requests) == 1
    assert upstream.cancels_of(session) == []


def test_a_refusal_before_it_was_published(world, spans):
    async def scenario(gateway, upstream, call):
        gateway.stopping = True  # /stopService: new inference is refused
        with pytest.raises(SwitchboardError) as raised:
            await whole(call)
        assert raised.value.kind is ErrorKind.UNAVAILABLE

    upstream, session, _ = run(world, spans, scenario, published=False)
    assert upstream.requests == [] and upstream.cancels_of(session) == []


def test_a_call_taken_over_is_closed_by_its_new_owner_only(world, spans):
    async def scenario(gateway, upstream, call):
        async with call:
            start = asyncio.ensure_future(call.start())
            req = await upstream.request()
            await upstream.answer(req, started(req))
            await start
            call.detach()  # e.g. the streaming response: its own finally closes it
        assert gateway.slots.used == 1 and len(gateway.inflight) == 1  # the async with left it open
        await upstream.answer(req, output(req, FinishReason.LENGTH))
        [end] = await call.results()
        call.close()
        return end

    upstream, session, end = run(world, spans, scenario)
    assert end.finish_reason is FinishReason.LENGTH and upstream.cancels_of(session) == []
