"""``GET /stopService`` (reference §3.7): refuse new inference on every gateway (``subjects.STOPPING``), let
running and waiting requests finish, answer 200, then tell every service to stop (the launcher then exits 0).

``?mode=Force`` answers at once and stops everything without waiting for the drain.

``?scope=instance`` (ours, not MindIE's) drains this gateway only, for one pod of many (Kubernetes'
preStop hook): it refuses new inference (503, so ``/v2/health/ready`` turns 503 and the pod leaves
its Service), waits until its own in-flight sessions are done — other gateways' requests and the
engines' queues are not its business — answers 200 and broadcasts nothing: every other service
goes on serving, and the pod's SIGTERM then stops this process. ``scope=deployment`` (the default)
is MindIE's whole-deployment stop.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from litestar import Request, Response, get
from litestar.params import FromQuery

from services.gateway.web.errors import mindie_error
from shared import subjects
from shared.errors import ErrorKind

if TYPE_CHECKING:
    from services.gateway.core import Gateway

POLL_S = 0.1
BROADCAST_DELAY_S = 0.3  # let the 200 reach the client before the listeners close
SCOPES = ("deployment", "instance")


def drained(gateway: Gateway) -> bool:
    """No session in flight here nor on any other live gateway (each says so in a heartbeat sent once it knew
    of the stop) and no request running or waiting on any live engine."""
    engine = gateway.engine_info()
    idle_engine = engine is None or (engine.running == 0 and engine.waiting == 0)
    others = _other_gateways(gateway)
    return not gateway.inflight and idle_engine and all(beat.stopping and not beat.in_flight for beat in others)


def unaware(gateway: Gateway) -> bool:
    """A live gateway whose heartbeat does not say it stops yet (the broadcast may have been lost: NATS may drop a
    message): it is told again."""
    return any(not beat.stopping for beat in _other_gateways(gateway))


def _other_gateways(gateway: Gateway) -> list:
    """The latest heartbeats of the other live gateways of the deployment."""
    return [beat for instance, beat in gateway.roles.gateways.live().items() if instance != gateway.instance]


def instance_drained(gateway: Gateway) -> bool:
    """This gateway has no session in flight (the engines may still serve other gateways)."""
    return not gateway.inflight


async def _broadcast_shutdown(gateway: Gateway) -> None:
    await asyncio.sleep(BROADCAST_DELAY_S)
    await gateway.nc.publish(subjects.SHUTDOWN, b"")
    await gateway.nc.flush()


@get("/stopService")
async def stop_service(request: Request, mode: FromQuery[str | None] = None) -> Response:
    gateway = request.app.state.gateway
    scope = request.query_params.get("scope")  # read by hand: Litestar reserves the kwarg `scope` (ASGI's)
    if scope is not None and scope not in SCOPES:
        return mindie_error(ErrorKind.VALIDATION, f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if gateway.stopping:
        return Response(b"", status_code=500)
    gateway.stopping, gateway.stop_scope = True, scope or "deployment"
    instance = scope == "instance"
    if not instance:  # every gateway stops taking requests now, not when the services stop
        await gateway.nc.publish(subjects.STOPPING, b"")
    if mode != "Force":
        done = instance_drained if instance else drained
        told = time.monotonic()
        while not done(gateway):
            await asyncio.sleep(POLL_S)
            if not instance and unaware(gateway) and time.monotonic() - told > gateway.cfg.switchboard.lease_seconds:
                await gateway.nc.publish(subjects.STOPPING, b"")
                told = time.monotonic()
    if not instance:
        gateway.spawn(_broadcast_shutdown(gateway))
    return Response(b"", status_code=200)


ROUTES = [stop_service]
