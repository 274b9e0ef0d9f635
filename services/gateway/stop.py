"""``GET /stopService`` (reference §3.7): refuse new inference, let running and waiting requests
finish, answer 200, then tell every service to stop (the launcher then exits 0).

``?mode=Force`` answers at once and stops everything without waiting for the drain.
"""

from __future__ import annotations

import asyncio

from litestar import Request, Response, get
from litestar.params import FromQuery

from shared import subjects

POLL_S = 0.1
BROADCAST_DELAY_S = 0.3  # let the 200 reach the client before the listeners close


def drained(gateway) -> bool:
    engine = gateway.engine_info()
    idle_engine = engine is None or (engine.running == 0 and engine.waiting == 0)
    return not gateway.live and idle_engine


async def _broadcast_shutdown(gateway) -> None:
    await asyncio.sleep(BROADCAST_DELAY_S)
    await gateway.nc.publish(subjects.SHUTDOWN, b"")
    await gateway.nc.flush()


@get("/stopService")
async def stop_service(request: Request, mode: FromQuery[str | None] = None) -> Response:
    gateway = request.app.state.gateway
    if gateway.stopping:
        return Response(b"", status_code=500)
    gateway.stopping = True
    if mode != "Force":
        while not drained(gateway):
            await asyncio.sleep(POLL_S)
    gateway.spawn(_broadcast_shutdown(gateway))
    return Response(b"", status_code=200)


ROUTES = [stop_service]
