"""Requests a gateway received and never finished because the gateway died.

A gateway counts each of its requests received (``Received``) and, at its end, finished (``Finished``): a
gateway killed mid-request never sends the second, and its requests are lost with it (its client's connection
went with the process; the tokenizers stop them once its lease runs out). This table keeps the requests each
gateway has in flight, by the gateway's instance (``Received.gateway``), under the gateway's own heartbeat
lease (``Switchboard.leaseSeconds``): when a gateway's lease runs out, each of its requests still open is
ended as an error, once, so ``request_received_total`` minus ``request_finished_total`` is what is in flight
and ``request_failed_total`` counts them. A gateway heard again after that (it was only stalled) may still
send its own ends for them: those are dropped, the request was counted already.
"""

from __future__ import annotations

import time
from typing import Callable

from shared.ends import FinishReason
from shared.leases import Leases
from shared.metrics_messages import Finished, Received
from shared.tombstones import Tombstones

MAX_OPEN = 100_000  # per gateway: an end lost on the bus must not grow the table for ever


class Orphans:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.gateways: Leases[None] = Leases(lease_s, clock)
        self.open: dict[str, dict[str, tuple[Received, float]]] = {}  # gateway -> id -> (its Received, wall time)
        self.owner: dict[str, str] = {}  # request id -> its gateway
        self.ended = Tombstones(clock=clock)  # ids ended here: their gateway's late ends are not counted again

    def beat(self, gateway: str) -> None:
        """A gateway's heartbeat."""
        self.gateways.beat(gateway, None)

    def received(self, event: Received) -> None:
        if not event.gateway:
            return  # (a sender that names no gateway: nothing to watch it by)
        self.gateways.beat(event.gateway, None)  # a gateway sending events is alive (its heartbeat may be behind)
        requests = self.open.setdefault(event.gateway, {})
        requests[event.id] = (event, time.time())
        self.owner[event.id] = event.gateway
        while len(requests) > MAX_OPEN:
            self.owner.pop(requests.pop(next(iter(requests)))[0].id, None)

    def finished(self, event: Finished) -> bool:
        """Forget an ended request; False when it was ended here already (its gateway came back late)."""
        if event.id in self.ended:
            return False
        gateway = self.owner.pop(event.id, None)
        if gateway is not None:
            self.open[gateway].pop(event.id, None)
        return True

    def expire(self) -> list[Finished]:
        """The ends of the requests of every gateway whose lease ran out, each returned once."""
        ends = []
        now = time.time()
        for gateway in self.gateways.expire():
            for request, arrival in self.open.pop(gateway, {}).values():
                del self.owner[request.id]
                self.ended.add(request.id)
                ends.append(Finished(id=request.id, model=request.model, arrival=arrival, e2e_s=now - arrival,
                                     ttft_s=None, prompt_tokens=0, generated_tokens=0,
                                     finish_reason=FinishReason.ERROR, adapter=request.adapter, api=request.api))
        return ends
