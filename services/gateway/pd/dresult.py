"""The decode server's side of MindIE's PD split (reference §3.33): ``GET /dresult``, the one long-lived
connection over which a coordinator reads the results of every request it sent to a prefill server with
this server as ``d-target``.

Frames (binary, on a ``text/event-stream`` that never ends normally): ``reqId:<id>\\0<prefix><body>\\0``
with prefix ``data:`` (a chunk, itself in its family's framing), ``lastData:`` (the last chunk, or a
whole non-streaming body), ``error:`` (the request failed after its first token) or ``retry:`` (its
prefill server died: the body is the request to send again, with ``is-recompute: true``); ``ka:heartbeat\\0``
when nothing was sent for over 5 s. A new connection ends the previous one with a ``close:`` frame for
reqId ``0xffffffffffffffff``.

Prefill gateways publish the frames to this gateway's subject (``DResultFrame``). Frames wait here, up
to ``LIMIT``, while no coordinator is connected, so a reconnecting coordinator loses nothing. Each request
is open from its ``open`` frame to its last frame; one whose prefill gateway's lease ran out (and that was
not heard from within a lease) ends in ``retry:``, one with a frame missing (lost on the bus) in ``error:``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from litestar import Request, Response, get
from litestar.response import Stream

from shared import bus, subjects
from shared.messages import decoder
from shared.pd_messages import DResultFrame
from shared.aio import within

if TYPE_CHECKING:
    from nats.aio.client import Client

    from services.gateway.pd.roles import Roles

log = logging.getLogger("switchboard.gateway")
LIMIT = 10_000  # frames kept while no coordinator reads (MindIE's dispatcher queue holds as many)
KEEPALIVE = b"ka:heartbeat\0"
KEEPALIVE_AFTER_S = 5.0
TICK_S = 1.0
CLOSE_ID = "0xffffffffffffffff"
PREFIX = {"data": b"data:", "lastData": b"lastData:", "error": b"error:", "retry": b"retry:", "close": b"close:"}
BAD_REQUEST = 400


def frame(req_id: str, kind: str, body: bytes) -> bytes:
    return b"reqId:" + req_id.encode() + b"\0" + PREFIX[kind] + body + b"\0"


@dataclass
class Open:
    """A request whose results come through here: who sends them, what to retry with, what comes next."""

    origin: str
    retry: bytes
    seq: int
    heard: float  # monotonic time of its latest frame


class DResults:
    """``roles`` tells which prefill gateways are live; ``lease_s`` is how long one may stay silent."""

    def __init__(self, nc: Client, instance: str, roles: Roles, heartbeat_s: float, lease_s: float,
                 limit: int = LIMIT):
        self.nc, self.instance, self.roles = nc, instance, roles
        self.heartbeat_s, self.lease_s = heartbeat_s, lease_s
        self.limit = limit
        self._watch: asyncio.Task | None = None
        self.frames: deque[bytes] = deque()
        self.wake = asyncio.Event()
        self.generation = 0  # the newest /dresult connection; older ones close
        self.open: dict[str, Open] = {}
        self.decoder = decoder(DResultFrame)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.gateway_dresult(self.instance), self.on_frame)
        self._watch = asyncio.ensure_future(self.watch())

    # ---- frames in ----------------------------------------------------------------------------------

    async def on_frame(self, msg) -> None:
        f = self.decoder.decode(msg.data)
        if f.kind == "open":
            self.open[f.req_id] = Open(f.origin, f.body, 1, time.monotonic())
            return
        entry = self.open.get(f.req_id)
        if entry is None or entry.origin != f.origin:
            log.warning("dresult frame for no open request", extra={"req_id": f.req_id, "kind": f.kind})
            return
        if f.seq != entry.seq:
            del self.open[f.req_id]
            self.push(frame(f.req_id, "error", f"results {entry.seq}..{f.seq - 1} of this request were lost".encode()))
            return
        entry.seq, entry.heard = entry.seq + 1, time.monotonic()
        if f.kind in ("lastData", "error"):
            del self.open[f.req_id]
        self.push(frame(f.req_id, f.kind, f.body))

    def push(self, data: bytes) -> None:
        if len(self.frames) >= self.limit:
            self.frames.popleft()
            log.warning("dresult buffer full: the oldest frame was dropped (is a coordinator reading /dresult?)")
        self.frames.append(data)
        self.wake.set()

    async def watch(self) -> None:
        """End in ``retry:`` each open request whose prefill gateway died."""
        while not self.nc.is_closed:
            await asyncio.sleep(self.heartbeat_s)
            self.check_origins()

    def check_origins(self) -> None:
        now = time.monotonic()
        for req_id, entry in list(self.open.items()):
            if not self.roles.is_live(entry.origin) and now - entry.heard > self.lease_s:
                del self.open[req_id]
                log.info("prefill server died: asking the coordinator to recompute", extra={"req_id": req_id})
                self.push(frame(req_id, "retry", entry.retry))

    # ---- frames out ---------------------------------------------------------------------------------

    def connect(self) -> int:
        """A new /dresult connection: it takes over, and the one before ends with ``close:``."""
        self.generation += 1
        self.wake.set()
        return self.generation

    async def stream(self, generation: int) -> AsyncIterator[bytes]:
        last = time.monotonic()
        while True:
            if generation != self.generation:
                yield frame(CLOSE_ID, "close", b"new connection is to established, close the old one.")
                return
            if self.frames:
                last = time.monotonic()
                yield self.frames.popleft()
                continue
            self.wake.clear()
            try:
                await within(self.wake.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass
            if not self.frames and time.monotonic() - last > KEEPALIVE_AFTER_S:
                last = time.monotonic()
                yield KEEPALIVE


@get("/dresult")
async def dresult(request: Request) -> Response:
    gateway = request.app.state.gateway
    if not gateway.roles.dmi:
        return _bad_request("Non DMI does not support dresult request")
    if gateway.roles.role not in ("decode", "flex"):
        return _bad_request(f"Only the Decode node supports dresult but you send to {gateway.roles.role}")
    results = gateway.dresults
    return Stream(results.stream(results.connect()), media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _bad_request(message: str) -> Response:
    return Response({"error": message, "error_type": "Bad Request"}, status_code=BAD_REQUEST,
                    media_type="application/json")


ROUTES = [dresult]
