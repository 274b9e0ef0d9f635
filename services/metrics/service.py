"""The metrics service: lifecycle events in, snapshots out."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg as NatsMsg

from services.metrics.aggregator import Aggregator
from shared import bus, subjects
from shared.config import Config
from shared.messages import MetricsEvent, decoder

log = logging.getLogger("switchboard.metrics")


class MetricsService:
    def __init__(self, nc):
        self.nc = nc
        self.aggregator = Aggregator()
        self.events = decoder(MetricsEvent)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.METRICS_EVENTS, self.on_event)
        await bus.subscribe(self.nc, subjects.METRICS_SNAPSHOT, self.on_snapshot)

    async def on_event(self, msg: NatsMsg) -> None:
        self.aggregator.add(self.events.decode(msg.data))

    async def on_snapshot(self, msg: NatsMsg) -> None:
        await bus.respond(msg, self.aggregator.snapshot())


async def serve(cfg: Config, nats_url: str, stop: asyncio.Event, ready=lambda: None) -> None:
    nc = await bus.connect(nats_url, "switchboard-metrics")
    await MetricsService(nc).start()
    ready()
    log.info("metrics ready")
    try:
        await stop.wait()
    finally:
        await bus.close(nc)
