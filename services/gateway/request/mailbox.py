"""One wildcard subscription per gateway process, dispatching events to per-request queues."""

from __future__ import annotations

import asyncio
import uuid

from nats.aio.msg import Msg as NatsMsg

from shared import bus, subjects
from shared.messages import GatewayEvent, decoder


class Mailboxes:
    def __init__(self, nc):
        self.nc = nc
        self.prefix = subjects.gateway_inbox(uuid.uuid4().hex[:12])
        self.queues: dict[str, asyncio.Queue] = {}
        self.decoder = decoder(GatewayEvent)

    async def start(self) -> None:
        await bus.subscribe(self.nc, f"{self.prefix}.>", self.on_event)

    def open(self, request_id: str) -> tuple[str, asyncio.Queue]:
        """The reply subject and queue for one request."""
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        return f"{self.prefix}.{request_id}", queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def on_event(self, msg: NatsMsg) -> None:
        queue = self.queues.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:
            queue.put_nowait(self.decoder.decode(msg.data))
