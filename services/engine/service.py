"""The engine service: NATS I/O around the engine's pure ``step()``."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from dataclasses import dataclass

from nats.aio.msg import Msg as NatsMsg

from services.engine.adapters import AdapterControl
from services.engine.build import build_engine
from services.engine.engine import Engine
from services.engine.fleet import FleetCache
from services.engine.kv_transfer import KvLayout, block_fits
from services.engine.pd import KvLink, Moved
from shared import bus, subjects, telemetry
from shared.config import Config
from shared.leases import Leases
from shared.tombstones import Tombstones
from shared.messages import Cancel, CancelKind, EngineInfo, EngineRequest, Heartbeat, TokenBatch, TokenEvent, decoder
from shared.metrics_messages import Queued
from shared.pd_messages import EngineRole
from shared.aio import within

log = logging.getLogger("switchboard.engine")
ENGINE_ROLE = {"prefill": "prefill", "decode": "decode", "flex": "both"}  # a server's PD role -> its engines'
DRAIN_MAX_S = 30.0


@dataclass
class Route:
    """Where a request's token events go (its tokenizer's inbox), the tokenizer instance that owns it
    (None: not said), and its span on this engine."""

    inbox: str
    owner: str | None
    span: Any


class EngineService:
    def __init__(self, cfg: Config, nc, engine: Engine, device_label: str, stepper: ThreadPoolExecutor):
        self.cfg = cfg
        self.nc = nc
        self.engine = engine
        self.device_label = device_label
        self.model = cfg.model.model_name
        self.instance = uuid.uuid4().hex[:12]  # this engine's id: in its heartbeats, its own subject
        self.stopping = False
        self.routes: dict[str, Route] = {}  # request id -> where its events go; dropped only by ``drop``
        self.cancelled = Tombstones()  # cancels that came before their request
        self.tokenizers: Leases[Heartbeat] = Leases(cfg.switchboard.lease_seconds)
        self.beats = decoder(Heartbeat)
        self.wake = asyncio.Event()
        self.stepper = stepper
        self.requests = decoder(EngineRequest)
        self.cancels = decoder(Cancel)
        self.adapters = AdapterControl(nc, self.model, self.instance, engine.runner.lora, stepper, self.announce)
        self.role = cfg.switchboard.engine_role
        self.roles = decoder(EngineRole)
        sb = cfg.switchboard
        self.kv_link = KvLink(nc, self.model, self.instance, sb.lease_seconds, sb.kv_trans_timeout_seconds)
        self.transfers: set[asyncio.Task] = set()  # handoffs, pulls and a grammar warm-up under way (referenced until done)
        self.fleet = FleetCache(nc, self.model, self.instance, engine, stepper, sb.kv_trans_timeout_seconds)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.engine_generate(self.model), self.on_request,
                            queue=subjects.engine_queue(self.model))
        await bus.subscribe(self.nc, subjects.engine_instance(self.model, self.instance), self.on_request)
        await bus.subscribe(self.nc, subjects.CANCEL, self.on_cancel)
        await bus.subscribe(self.nc, subjects.engine_health(self.model), self.on_health)
        await bus.subscribe(self.nc, subjects.engine_role(self.model), self.on_role)
        await bus.subscribe(self.nc, subjects.heartbeat("tokenizer"), self.on_tokenizer_heartbeat)
        await self.adapters.start()
        await self.kv_link.start()
        await bus.subscribe(self.nc, subjects.engine_kv(self.model, self.instance), self.on_kv_part)
        await self.fleet.start()
        if why := block_fits(KvLayout.of(self.engine.runner).chunk_bytes, self.nc.max_payload):
            log.warning("K/V blocks do not fit in the bus's messages", extra={"why": why})

    async def announce(self) -> None:
        await bus.publish(self.nc, subjects.engine_heartbeat(self.model), self.info())

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Publish running/waiting requests and free/total blocks four times per lease."""
        while not stop.is_set():
            await self.announce()
            self.abort_orphans()
            try:
                await within(stop.wait(), self.cfg.switchboard.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    async def on_tokenizer_heartbeat(self, msg: NatsMsg) -> None:
        beat = self.beats.decode(msg.data)
        self.tokenizers.beat(beat.instance, beat)

    def abort_orphans(self) -> None:
        """End the requests whose tokenizer's lease ran out: nobody would read their tokens (the
        gateway that owns each resumes it through a live tokenizer)."""
        dead = set(self.tokenizers.expire())
        if not dead:
            return
        for request_id in [r for r, route in self.routes.items() if route.owner in dead]:
            self.engine.abort(request_id, CancelKind.TOKENIZER_GONE)
            self.wake.set()

    async def on_request(self, msg: NatsMsg) -> None:
        req = self.requests.decode(msg.data)
        if req.id in self.cancelled:
            return  # its client is gone already
        self.track(req)
        if self.fleet.wants_pull(req):
            self._background(self._after_pull(req))
            return
        self._admit(req)

    def _admit(self, req: EngineRequest) -> None:
        if req.sampling.grammar is not None:
            self._background(self._constrained(req))  # its matcher is built neither on the step nor here
            return
        self.engine.add_request(req)
        self.wake.set()

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.transfers.add(task)
        task.add_done_callback(self.transfers.discard)

    async def _after_pull(self, req: EngineRequest) -> None:
        """First the prefix the router says another engine holds (fleet.py), then the request as any other."""
        await self.fleet.pull(req)
        if req.id in self.cancelled:
            self.drop(req.id, **{"switchboard.finish_reason": "cancelled"})
            return
        self._admit(req)

    async def _constrained(self, req: EngineRequest) -> None:
        """A constrained request's grammar matcher is built on a worker thread: a large grammar takes seconds
        (llguidance drops the GIL), and the first one also reads the tokenizer into the grammar engine. The
        engine ends the request with the error, when it cannot be built."""
        try:
            built = await asyncio.to_thread(self.engine.constraints.matcher, req.sampling.grammar, req.generated_ids)
        except (ValueError, RuntimeError) as exc:
            built = exc
        if req.id in self.cancelled:
            self.drop(req.id, **{"switchboard.finish_reason": "cancelled"})
            return
        self.engine.add_request(req, built)
        self.wake.set()

    def track(self, req: EngineRequest) -> None:
        """Where the request's token events go, who owns it, and its span here."""
        span = telemetry.start_span("engine.generate", req.trace, **{
            "switchboard.request_id": req.id, "switchboard.prompt_tokens": len(req.prompt_ids),
            "switchboard.priority": req.priority, "switchboard.adapter": req.adapter,
            "switchboard.role": self.role, "switchboard.handed_over": bool(req.generated_ids and not req.handoff)})
        self.routes[req.id] = Route(req.reply_to, req.tokenizer or None, span)

    def drop(self, request_id: str, error: str | None = None, **attributes) -> Route | None:
        """The request is no longer this engine's (it ended, or went to another engine): its route goes and
        its span ends. The one place a request leaves ``routes``."""
        route = self.routes.pop(request_id, None)
        if route is not None:
            telemetry.end_span(route.span, error, **attributes)
        return route

    # ---- prefill/decode handoffs (pd.py) -----------------------------------------------------

    def start_handoffs(self) -> None:
        """Send on the requests the last step finished prefilling (prefill role)."""
        for handoff in self.engine.take_handoffs():
            self._background(self._hand_off(handoff))

    async def _hand_off(self, handoff) -> None:
        outcome = await self.kv_link.hand_off(handoff)
        if isinstance(outcome, Moved):
            await self.moved(outcome.request, outcome.target)
        else:
            self.keep(outcome.request)

    async def on_kv_part(self, msg: NatsMsg) -> None:
        """A part of a request handed to this (decode) engine; the last one brings the request."""
        ack, accepted = self.kv_link.receive(msg.data, self.engine.cached_blocks)
        if accepted is not None:
            self.accept(accepted.request, accepted.kv)
        await bus.respond(msg, ack)

    def keep(self, req: EngineRequest) -> None:
        """A handoff that did not happen: the request goes on here, its prompt recomputed."""
        if req.id in self.routes and req.id not in self.cancelled:
            self._admit(req)
        else:  # cancelled during the transfer: it ends here
            self.drop(req.id, **{"switchboard.finish_reason": "cancelled"})

    async def moved(self, req: EngineRequest, target: str) -> None:
        """A decode engine took the request: forget it here and tell its tokenizer who has it now."""
        route = self.drop(req.id, **{"switchboard.finish_reason": "handed off", "switchboard.decode_engine": target})
        if route is not None:
            await bus.publish(self.nc, route.inbox, TokenBatch([], engine=self.instance, moved={req.id: target}))

    def accept(self, req: EngineRequest, kv) -> None:
        """Decode role: a request handed over with its prompt's K/V."""
        if req.id in self.cancelled:
            return  # its client left during the transfer
        self.track(req)
        self.engine.add_handoff(req, kv)
        self.wake.set()

    async def on_cancel(self, msg: NatsMsg) -> None:
        cancel = self.cancels.decode(msg.data)
        self.cancelled.add(cancel.id)  # also stops a request whose handoff is under way from being kept here
        if cancel.id in self.routes:
            self.engine.abort(cancel.id, cancel.reason)
            self.wake.set()

    async def on_role(self, msg: NatsMsg) -> None:
        """A dmi role assignment naming this engine's device: new requests follow it (those under way finish
        where they are)."""
        command = self.roles.decode(msg.data)
        index = self.cfg.switchboard.device_index
        if index >= 0 and index in command.devices:
            self.role = ENGINE_ROLE[command.role]
            log.info("role assigned", extra={"role": self.role, "device_index": index})

    async def on_health(self, msg: NatsMsg) -> None:
        await bus.respond(msg, self.info())

    def info(self) -> EngineInfo:
        runner = self.engine.runner
        return EngineInfo(
            model=self.model, loaded=True, device=self.device_label, dtype=str(runner.dtype).removeprefix("torch."),
            quantization=runner.quantization, kv_dtype=runner.kv.dtype_name,
            max_batch_size=self.cfg.schedule.max_batch_size, total_blocks=runner.num_blocks,
            free_blocks=self.engine.blocks.num_free, running=self.engine.num_running, waiting=self.engine.num_waiting,
            free_slots=max(0, self.cfg.schedule.max_batch_size - self.engine.num_running),
            prompt_tokens_total=self.engine.stats.prompt_tokens,
            generation_tokens_total=self.engine.stats.generation_tokens,
            preemptions_total=self.engine.scheduler.num_preemptions,
            instance=self.instance, stopping=self.stopping,
            prefix_queried_tokens_total=self.engine.blocks.prefix_queried_tokens,
            prefix_hit_tokens_total=self.engine.blocks.prefix_hit_tokens,
            adapters=runner.lora.listed(), unloading=runner.lora.unloading(), adapters_version=runner.lora.version,
            modalities=runner.modalities, role=self.role, device_index=self.cfg.switchboard.device_index,
            block_size=runner.block_size, pid=os.getpid(), **self._cache_state(), **self._host_tier(),
        )

    def _host_tier(self) -> dict:
        tier = self.engine.blocks.tier
        return {"host_total_blocks": tier.capacity, "host_used_blocks": len(tier)} if tier is not None else {}

    def _cache_state(self) -> dict:
        seq, count, xor = self.fleet.state
        return {"cache_seq": seq, "cache_count": count, "cache_xor": xor} if self.fleet.enabled else {}

    async def run(self, stop: asyncio.Event) -> None:
        """Step while there is work; sleep on ``wake`` otherwise."""
        while not stop.is_set():
            if not self.engine.has_work:
                self.wake.clear()
                await self._wait(stop)
                continue
            await self.publish(await self._step())
            self.start_handoffs()
            if self.engine.held_until is not None:  # a small first batch waits for company
                self.wake.clear()
                await self._wait(stop, timeout=max(0.0, self.engine.held_until - time.time()))

    async def drain(self) -> None:
        """Stopping (SIGTERM, a rolling update): heartbeats say so, so no new request is routed here, and the
        running ones finish for up to DRAIN_MAX_S; what is left then resumes on another engine."""
        self.stopping = True
        await bus.publish(self.nc, subjects.engine_heartbeat(self.model), self.info())
        deadline = time.monotonic() + DRAIN_MAX_S
        while self.engine.has_work and time.monotonic() < deadline:
            await self.publish(await self._step())
            self.start_handoffs()
            if self.engine.held_until is not None:
                await asyncio.sleep(0.005)

    async def _step(self) -> list[TokenEvent]:
        try:
            events, cache = await asyncio.get_running_loop().run_in_executor(self.stepper, self._step_job)
        except Exception as exc:  # last resort: per-request failures are isolated inside the step
            log.exception("engine step failed")
            return self.engine.fail_all(f"engine failure: {exc}")
        await self.fleet.announce(cache)
        return events

    def _step_job(self):
        """One step on the engine's thread; its prefill rate measured and its cache changes taken (fleet.py)."""
        started, before = time.perf_counter(), self.engine.stats.prompt_tokens
        events = self.engine.step()
        self.fleet.measure_step(self.engine.stats.prompt_tokens - before, time.perf_counter() - started)
        return events, self.fleet.journal()

    async def _wait(self, stop: asyncio.Event, timeout: float | None = None) -> None:
        waiters = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stop.wait())]
        _, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    async def publish(self, events: list[TokenEvent]) -> None:
        by_inbox: dict[str, list[TokenEvent]] = defaultdict(list)
        for event in events:
            route = self.routes.get(event.id)
            if route is None:
                continue
            by_inbox[route.inbox].append(event)
            if event.finish_reason:
                self.drop(event.id, event.error and event.error.message,
                          **{"switchboard.finish_reason": str(event.finish_reason)})
        for inbox, batch in by_inbox.items():
            await bus.publish(self.nc, inbox, TokenBatch(batch, engine=self.instance))
        queued = self.engine.stats.take_queue_times()
        if queued:
            await bus.publish(self.nc, subjects.METRICS_EVENTS, Queued(model=self.model, seconds=queued))


async def serve(cfg: Config, nats_url: str, stop: asyncio.Event, ready=lambda: None) -> None:
    # Every torch call of this process runs on this one thread, the model's loading and packing
    # included. torch's OpenMP team belongs to the thread that calls it: a second team makes more
    # OpenMP threads than cores, libgomp then stops spinning between parallel regions, and every one
    # of a step's ~300 regions pays a futex wake-up (a decode step measured 1.5-2x slower).
    stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
    engine, device_label = await asyncio.get_running_loop().run_in_executor(stepper, build_engine, cfg)
    nc = await bus.connect(nats_url, "switchboard-engine", stop)
    service = EngineService(cfg, nc, engine, device_label, stepper)
    await service.start()
    ready()
    log.info("engine ready", extra={"model": service.model, "blocks": engine.runner.num_blocks})
    done = asyncio.Event()
    heartbeat = asyncio.create_task(service.heartbeat(done))
    try:
        await service.run(stop)
        await service.drain()
    finally:
        done.set()
        heartbeat.cancel()
        await bus.close(nc)


__all__ = ["EngineService", "build_engine", "serve"]
