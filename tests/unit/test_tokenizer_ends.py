"""Every way a request can end in the tokenizer releases it exactly once and says so once.

A real TokenizerService on a real nats-server; the test speaks for its peers over the bus, as the gateway
(requests, cancels, heartbeats) and as the engine (heartbeats, token batches). The ends: a finish from the
engine, a stop string found here (the engine is told to stop), a cancel by the client, a superseded
attempt, an engine failure, token events lost, the owning gateway's lease running out, the decode engine
that took a request over dying, and a refusal before the request was ever pending. Each must leave
``pending`` empty, end the request's span exactly once, tell the gateway at most one end (exactly one where
the client still listens) and tell the engine to stop exactly when it still runs the request."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from services.tokenizer.service import TokenizerService, load_tokenizer
from shared import bus, subjects
from shared.config import load_config
from shared.errors import ErrorInfo, ErrorKind
from shared.messages import (
    Cancel,
    CancelKind,
    EngineInfo,
    EngineRequest,
    Failed,
    FinishReason,
    GatewayEvent,
    GenerateRequest,
    Heartbeat,
    Output,
    Sampling,
    Started,
    TokenBatch,
    TokenEvent,
    decoder,
)
from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config

LEASE_S = 1.0
GATEWAY, ENGINE, DECODE = "gw-1", "engine-1", "engine-2"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    nats = EmbeddedNats()
    url = nats.start()
    folder = tmp_path_factory.mktemp("tokenizer-ends")
    cfg = load_config(write_config(folder, tiny_model_dir, Switchboard={"leaseSeconds": LEASE_S}))
    try:
        yield url, cfg, load_tokenizer(str(tiny_model_dir))
    finally:
        nats.stop()


@dataclass
class Peers:
    """The gateway's and the engines' side of the bus: what the tokenizer sent each."""

    nc: object
    model: str
    to_gateway: list = field(default_factory=list)
    to_engine: list[EngineRequest] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)

    async def start(self) -> None:
        events, requests, cancels = decoder(GatewayEvent), decoder(EngineRequest), decoder(Cancel)

        async def gateway(msg):
            self.to_gateway.append(events.decode(msg.data))

        async def engine(msg):
            self.to_engine.append(requests.decode(msg.data))

        async def cancel(msg):
            self.cancels.append(cancels.decode(msg.data))

        await self.nc.subscribe("test.gw.>", cb=gateway)
        await self.nc.subscribe(subjects.engine_instance(self.model, "*"), cb=engine)
        await self.nc.subscribe(subjects.CANCEL, cb=cancel)

    async def beat(self, *engines: tuple[str, str], gateway: bool = True) -> None:
        for instance, role in engines:
            await bus.publish(self.nc, subjects.engine_heartbeat(self.model), EngineInfo(
                model=self.model, loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=64,
                free_blocks=64, running=0, waiting=0, instance=instance, role=role))
        if gateway:
            await bus.publish(self.nc, subjects.heartbeat("gateway"), Heartbeat(service="gateway", instance=GATEWAY))
        await self.nc.flush()

    def ends_heard(self, request_id: str) -> list:
        """What the gateway heard that ends the request: a failure, or an output with a finish reason."""
        return [e for e in self.to_gateway if e.id == request_id
                and (isinstance(e, Failed) or (isinstance(e, Output) and e.finish_reason is not None))]


async def until(check, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def request(request_id: str, **fields) -> GenerateRequest:
    fields.setdefault("sampling", Sampling(max_new_tokens=8))
    return GenerateRequest(id=request_id, model="", reply_to=f"test.gw.{request_id}", prompt="Hello there",
                           gateway=GATEWAY, arrival=time.time(), **fields)


async def run(world, spans, scenario, **request_fields) -> tuple[TokenizerService, Peers, str]:
    """Start a tokenizer and the peers, submit one request, run ``scenario(service, peers, req)``; then check
    the release: not pending, its span ended once."""
    url, cfg, tok = world
    nc_service, nc_peers = await bus.connect(url, "tokenizer"), await bus.connect(url, "peers")
    service = TokenizerService(cfg, nc_service, tok)
    peers = Peers(nc_peers, cfg.model.model_name)
    try:
        await service.start()
        await peers.start()
        await nc_service.flush()
        for _ in range(100):  # a loaded machine may let a lease run out before the check: beat until heard
            await peers.beat((ENGINE, "both"))
            if service.router.serving() and service.gateways.live():
                break
            await asyncio.sleep(0.05)
        assert service.router.serving() and service.gateways.live(), "the tokenizer heard no peer"
        req = request(f"req-{time.monotonic_ns()}", **request_fields)
        req.model = cfg.model.model_name
        spans.clear()
        await bus.publish(nc_peers, subjects.tokenizer_instance(service.instance), req)
        await scenario(service, peers, req)
        await nc_peers.flush()
        await asyncio.sleep(0.1)  # anything sent twice would have come by now
        assert req.id not in service.pending
        ended = Counter(s.attributes.get("switchboard.request_id") for s in spans.get_finished_spans()
                        if s.name == "tokenizer.request")
        assert ended[req.id] == 1, ended
        return service, peers, req.id
    finally:
        await nc_service.close()
        await nc_peers.close()


async def started(service: TokenizerService, peers: Peers, req: GenerateRequest) -> EngineRequest:
    await until(lambda: peers.to_engine, "the engine got no request")
    assert any(isinstance(e, Started) for e in peers.to_gateway)
    return peers.to_engine[-1]


async def tokens(peers: Peers, service: TokenizerService, *events: TokenEvent, moved: dict | None = None) -> None:
    await bus.publish(peers.nc, service.inbox, TokenBatch(events=list(events), engine=ENGINE, moved=moved or {}))
    await peers.nc.flush()


def cancels_of(peers: Peers, request_id: str) -> list[CancelKind]:
    return [c.reason for c in peers.cancels if c.id == request_id]


def test_a_finish_from_the_engine(world, spans):
    async def scenario(service, peers, req):
        await started(service, peers, req)
        await tokens(peers, service, TokenEvent(req.id, [42, 43], finish_reason=FinishReason.LENGTH))
        await until(lambda: peers.ends_heard(req.id), "no end reached the gateway")

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    [end] = peers.ends_heard(rid)
    assert end.finish_reason is FinishReason.LENGTH and len(end.tokens) == 2
    assert cancels_of(peers, rid) == []  # the engine ended it itself


def test_a_stop_string_found_here_stops_the_engine(world, spans, tiny_model_dir):
    stop_ids = load_tokenizer(str(tiny_model_dir))(" world").input_ids

    async def scenario(service, peers, req):
        await started(service, peers, req)
        await tokens(peers, service, TokenEvent(req.id, stop_ids))
        await until(lambda: peers.ends_heard(req.id), "no end reached the gateway")
        await tokens(peers, service, TokenEvent(req.id, [7], position=len(stop_ids)))  # in flight: dropped

    _, peers, rid = asyncio.run(run(world, spans, scenario, sampling=Sampling(max_new_tokens=8, stop=["world"])))
    [end] = peers.ends_heard(rid)
    assert end.finish_reason is FinishReason.STOP_SEQUENCE
    assert cancels_of(peers, rid) == [CancelKind.STOP_SEQUENCE]


@pytest.mark.parametrize("kind", [CancelKind.CLIENT_DISCONNECTED, CancelKind.SUPERSEDED])
def test_a_cancel_by_its_client(world, spans, kind):
    async def scenario(service, peers, req):
        await started(service, peers, req)
        await bus.publish(peers.nc, subjects.CANCEL, Cancel(id=req.id, reason=kind))
        await until(lambda: req.id not in service.pending, "still pending after the cancel")
        await tokens(peers, service, TokenEvent(req.id, [5]))  # the engine's last step, in flight: dropped

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    assert peers.ends_heard(rid) == []  # nobody listens any more
    assert [e for e in peers.to_gateway if isinstance(e, Output)] == []


def test_an_engine_failure(world, spans):
    error = ErrorInfo(ErrorKind.TIMEOUT, "the request ran past its deadline")

    async def scenario(service, peers, req):
        await started(service, peers, req)
        await tokens(peers, service, TokenEvent(req.id, [], error=error))
        await until(lambda: peers.ends_heard(req.id), "no end reached the gateway")

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    [end] = peers.ends_heard(rid)
    assert isinstance(end, Failed) and end.error.kind is ErrorKind.TIMEOUT and not end.retryable
    assert cancels_of(peers, rid) == []  # the engine ended it itself


def test_lost_token_events(world, spans):
    async def scenario(service, peers, req):
        await started(service, peers, req)
        await tokens(peers, service, TokenEvent(req.id, [5], position=3))  # events 0..2 never came
        await until(lambda: peers.ends_heard(req.id), "no end reached the gateway")

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    [end] = peers.ends_heard(rid)
    assert isinstance(end, Failed) and end.retryable  # the gateway resumes it
    assert cancels_of(peers, rid) == [CancelKind.EVENTS_LOST]


async def until_dropped(service: TokenizerService, peers: Peers, req: GenerateRequest, gateway: bool) -> None:
    """Run the tokenizer's heartbeat loop (its lease checks) while only ENGINE (and the gateway, if ``gateway``)
    beats, until the request is dropped or three leases have passed."""
    stop = asyncio.Event()
    beating = asyncio.ensure_future(service.heartbeat(stop))
    try:
        for _ in range(int(3 * LEASE_S / 0.2)):
            await peers.beat((ENGINE, "both"), gateway=gateway)
            if req.id not in service.pending:
                break
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await beating


def test_the_gateways_lease_running_out(world, spans):
    async def scenario(service, peers, req):
        await started(service, peers, req)
        await until_dropped(service, peers, req, gateway=False)  # the engine beats on, the gateway does not

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    assert peers.ends_heard(rid) == []  # no client to tell
    assert cancels_of(peers, rid) == [CancelKind.GATEWAY_GONE]


def test_the_decode_engine_that_took_it_over_dying(world, spans):
    async def scenario(service, peers, req):
        await started(service, peers, req)
        await peers.beat((DECODE, "decode"))
        await tokens(peers, service, TokenEvent(req.id, [5]), moved={req.id: DECODE})
        await until(lambda: service.pending[req.id].moved, "the handoff was not noted")
        await until_dropped(service, peers, req, gateway=True)  # the decode engine is silent from now on

    _, peers, rid = asyncio.run(run(world, spans, scenario))
    [end] = peers.ends_heard(rid)
    assert isinstance(end, Failed) and end.retryable  # the gateway resumes it elsewhere
    assert cancels_of(peers, rid) == [CancelKind.ENGINE_GONE]


def test_a_refusal_before_it_was_pending(world, spans):
    async def scenario(service, peers, req):
        await until(lambda: peers.ends_heard(req.id), "no refusal reached the gateway")

    _, peers, rid = asyncio.run(run(world, spans, scenario, prompt_ids=[10 ** 9]))
    [end] = peers.ends_heard(rid)
    assert isinstance(end, Failed) and end.error.kind is ErrorKind.VALIDATION
    assert peers.to_engine == [] and cancels_of(peers, rid) == []
