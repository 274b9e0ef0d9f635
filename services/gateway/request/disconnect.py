"""Race a coroutine against the client going away, for non-streaming requests."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from litestar import Request, Response
from litestar.exceptions import InternalServerException

T = TypeVar("T")
BODY_CUT = "client disconnected prematurely"  # Litestar's words, as it raises InternalServerException (a 500)


class ClientDisconnected(Exception):
    pass


def gone() -> Response:
    """The answer to a client that left (499, nginx's "client closed request"): nobody reads it, nothing went
    wrong here, and it is neither a refusal nor a failure."""
    return Response(b"", status_code=499)


def gone_mid_body(exc: Exception) -> Response | None:
    """``gone()`` when ``exc`` is Litestar's error for a body the client stopped sending (it left, or the body
    timeout closed its connection, the client answered 408 there), else None: it is not a server error."""
    if isinstance(exc, InternalServerException) and exc.detail == BODY_CUT:
        return gone()
    return None


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
