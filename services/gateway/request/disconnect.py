"""Race a coroutine against the client going away, for non-streaming requests."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from litestar import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of ``work``; if the client disconnects first, ``work`` is cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientDisconnected()
    return task.result()
