"""Keeping this tokenizer's views of the engines' prefix caches (``cache_views.py``) current over the bus: the
engines' ``CacheEvents`` as they come, and a digest (``CacheSync``, one request at a time per engine) whenever
a view says it may be wrong (an event lost, a heartbeat that disagrees, an engine heard late)."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg as NatsMsg

from services.tokenizer.cache_views import CacheViews
from shared import bus, subjects
from shared.fleet_messages import CacheEvents, CacheSync
from shared.messages import decoder, encode

log = logging.getLogger("switchboard.tokenizer")


class CacheFollower:
    def __init__(self, nc, model: str, instance: str, views: CacheViews, timeout_s: float):
        self.nc, self.model, self.instance, self.views, self.timeout_s = nc, model, instance, views, timeout_s
        self.events = decoder(CacheEvents)
        self.syncing: dict[str, asyncio.Task] = {}  # engine -> its digest being fetched

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.engine_cache(self.model), self.on_events)

    async def on_events(self, msg: NatsMsg) -> None:
        events = self.events.decode(msg.data)
        if self.views.apply(events):
            self.sync(events.instance)

    def sync(self, instance: str) -> None:
        """Ask the engine for its digest, unless that is under way."""
        if instance not in self.syncing:
            self.syncing[instance] = asyncio.ensure_future(self._sync(instance))

    async def _sync(self, instance: str) -> None:
        try:
            reply = await self.nc.request(subjects.engine_cache_sync(self.model, instance),
                                          encode(CacheSync(router=self.instance)), timeout=self.timeout_s)
            self.views.apply(self.events.decode(reply.data))
        except Exception as exc:  # noqa: BLE001 - a dead or busy engine: its next heartbeat asks again
            log.debug("cache digest not received", extra={"engine": instance, "error": repr(exc)})
        finally:
            self.syncing.pop(instance, None)
