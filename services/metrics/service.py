"""The metrics service: lifecycle events and every engine's heartbeats in; snapshots and Prometheus text out."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg as NatsMsg

from services.metrics.aggregator import Aggregator
from services.metrics.orphans import Orphans
from services.metrics.prometheus import PrometheusMetrics
from shared import bus, subjects
from shared.config import Config
from shared.messages import EngineInfo, Heartbeat, PrometheusText, decoder
from shared.metrics_messages import Finished, MetricsEvent, Received

log = logging.getLogger("switchboard.metrics")


class MetricsService:
    def __init__(self, nc, model: str, lease_s: float = 2.0):
        self.nc = nc
        self.model = model
        self.aggregator = Aggregator()
        self.prometheus = PrometheusMetrics(model, lease_s)  # engines by instance, each under a lease
        self.orphans = Orphans(lease_s)  # each gateway's open requests, ended as errors if it dies
        self.events = decoder(MetricsEvent)
        self.heartbeats = decoder(EngineInfo)
        self.gateway_beats = decoder(Heartbeat)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.METRICS_EVENTS, self.on_event)
        await bus.subscribe(self.nc, subjects.engine_heartbeat(self.model), self.on_heartbeat)
        await bus.subscribe(self.nc, subjects.heartbeat("gateway"), self.on_gateway_heartbeat)
        await bus.subscribe(self.nc, subjects.METRICS_SNAPSHOT, self.on_snapshot)
        await bus.subscribe(self.nc, subjects.METRICS_PROMETHEUS, self.on_prometheus)

    async def on_event(self, msg: NatsMsg) -> None:
        event = self.events.decode(msg.data)
        if isinstance(event, Received):
            self.orphans.received(event)
        elif isinstance(event, Finished) and not self.orphans.finished(event):
            return  # its gateway's lease ran out and it was counted then
        self.observe(event)

    def observe(self, event: MetricsEvent) -> None:
        self.aggregator.add(event)
        self.prometheus.observe(event)

    async def on_heartbeat(self, msg: NatsMsg) -> None:
        self.prometheus.heartbeat(self.heartbeats.decode(msg.data))
        self.end_orphans()

    async def on_gateway_heartbeat(self, msg: NatsMsg) -> None:
        beat = self.gateway_beats.decode(msg.data)
        if beat.model in ("", self.model):
            self.orphans.beat(beat.instance)
        self.end_orphans()

    def end_orphans(self) -> None:
        """Count as errors the open requests of each gateway whose lease ran out (checked at every heartbeat and
        scrape)."""
        for end in self.orphans.expire():
            self.observe(end)

    async def on_snapshot(self, msg: NatsMsg) -> None:
        self.end_orphans()
        await bus.respond(msg, self.aggregator.snapshot())

    async def on_prometheus(self, msg: NatsMsg) -> None:
        self.end_orphans()
        await bus.respond(msg, PrometheusText(self.prometheus.render()))


async def serve(cfg: Config, nats_url: str, stop: asyncio.Event, ready=lambda: None) -> None:
    nc = await bus.connect(nats_url, "switchboard-metrics", stop)
    await MetricsService(nc, cfg.model.model_name, cfg.switchboard.lease_seconds).start()
    ready()
    log.info("metrics ready")
    try:
        await stop.wait()
    finally:
        await bus.close(nc)
