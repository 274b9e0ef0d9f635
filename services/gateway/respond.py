"""The request lifecycle every family shares: start a session, then collect it or stream it."""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable

from litestar import Request, Response
from litestar.response import Stream

from services.gateway.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.session import Session
from shared.messages import Started

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def start(request: Request, session: Session) -> Started:
    """Start the session (validation errors raise here, before any byte is sent); close it on failure."""
    try:
        return await unless_disconnected(request, session.start())
    except BaseException:
        await session.close()
        raise


async def collect(request: Request, session: Session, work: Awaitable[Any], media_type: str = "application/json") -> Response:
    """Run a non-streaming request to its end; a client that goes away cancels it (499, nobody reads it)."""
    try:
        body = await unless_disconnected(request, work)
    except ClientDisconnected:
        return Response(b"", status_code=499)
    finally:
        await session.close()
    return Response(body, media_type=media_type)


def event_stream(events: AsyncIterator[bytes], media_type: str = "text/event-stream") -> Stream:
    """A streaming response; the iterator closes its session in its own ``finally``."""
    return Stream(events, media_type=media_type, headers=SSE_HEADERS)

