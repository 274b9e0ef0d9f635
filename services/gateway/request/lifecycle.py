"""The request lifecycle every family shares: admit and start a call, then collect it or stream it.

1. ``start``: admission and every choice's start, raced against the client going away; errors here
   (validation, 429, 503) are ordinary responses, since no byte has been sent yet.
2. ``collect``: the whole body, raced against the client going away (then 499, nobody reads it).
3. ``stream``: the family's chunks; a failure after the start becomes the family's error event.
4. Close, exactly once, whatever happened: ``respond`` holds the call in ``async with``; a stream
   takes it over (``detach``) and closes it in its ``finally`` and in the response's background task,
   which runs after any end. The call's ``close()`` never suspends, so it completes even inside a
   cancelled scope (Litestar cancels a stream's task group when the client leaves).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from services.gateway.pd import dmi
from services.gateway.request.call import Call
from services.gateway.request.disconnect import ClientDisconnected, unless_disconnected
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Started

log = logging.getLogger("switchboard.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ErrorChunk = Callable[[SwitchboardError], bytes]


async def start(request: Request, call: Call) -> list[Started]:
    """Admit and start the call; a client gone meanwhile raises ClientDisconnected (a quiet 499)."""
    return await unless_disconnected(request, call.start())


async def collect(request: Request, call: Call, work: Awaitable[Any], media_type: str = "application/json") -> Response:
    """Run a non-streaming call to its end; a client that goes away cancels it (499, nobody reads it)."""
    try:
        body = await unless_disconnected(request, work)
    except ClientDisconnected:
        return Response(b"", status_code=499)
    if isinstance(body, Response):
        return body
    return Response(body, media_type=media_type)


def stream(call: Call, chunks: AsyncIterator[bytes], error_chunk: ErrorChunk, media_type: str = "text/event-stream",
           trailer: bytes = b"") -> Stream:
    """A streaming response of ``chunks``; a failure becomes ``error_chunk(exc)``; ``trailer`` ends it. The
    stream owns the call from here: it closes it at its end, or in the background task if it never ran."""
    call.detach()
    return Stream(_framed(call, chunks, error_chunk, trailer), media_type=media_type, headers=SSE_HEADERS,
                  background=BackgroundTask(call.aclose))


async def _framed(call: Call, chunks: AsyncIterator[bytes], error_chunk: ErrorChunk, trailer: bytes) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except SwitchboardError as exc:
        yield error_chunk(exc)
    except Exception as exc:  # noqa: BLE001 - the stream must still end in the family's framing
        log.exception("stream failed", exc_info=exc)
        yield error_chunk(SwitchboardError(ErrorKind.INTERNAL, "Server internal error"))
    finally:
        call.close()
    if trailer:
        yield trailer


async def respond(request: Request, call: Call, streaming: bool, body: Callable[[], Awaitable[Any]],
                  chunks: Callable[[], AsyncIterator[bytes]], error_chunk: ErrorChunk,
                  media_type: str = "text/event-stream", trailer: bytes = b"", stop_ok: bool = False) -> Response:
    """The whole lifecycle: start, then a JSON body or a stream. In ``inferMode`` "dmi" the request came from
    a coordinator: it is admitted by its headers, and answered with the first-token JSON (``pd/dmi.py``);
    ``stop_ok`` says the family takes stop words there (the OpenAI routes)."""
    async with call:
        if call.ctx.roles.dmi:
            return await _respond_dmi(request, call, streaming, body, chunks, trailer, stop_ok)
        await start(request, call)
        if streaming:
            return stream(call, chunks(), error_chunk, media_type, trailer)
        return await collect(request, call, body())


async def _respond_dmi(request: Request, call: Call, streaming: bool, body: Callable[[], Awaitable[Any]],
                       chunks: Callable[[], AsyncIterator[bytes]], trailer: bytes, stop_ok: bool) -> Response:
    try:
        ticket = dmi.admit(request, call, stop_ok)
    except dmi.Refused as refused:
        return refused.response()
    await start(request, call)
    return await dmi.respond(request, call, ticket, streaming, body, chunks, trailer)
