"""The request lifecycle every family shares: admit and start a call, then collect it or stream it.

1. ``start``: admission and every choice's start, raced against the client going away; errors here
   (validation, 429, 503) are ordinary responses, since no byte has been sent yet.
2. ``collect``: the whole body, raced against the client going away (then 499, nobody reads it).
3. ``stream``: the family's chunks; a failure after the start becomes the family's error event. A
   stream silent for ``Switchboard.streamKeepAliveSeconds`` sends the family's keep-alive (an SSE
   comment, Anthropic's ping event, vLLM's empty chunk) so that proxies keep the connection; a start
   that takes that long (the request queued for a slot) begins the stream first, so the keep-alives
   cover the queue too, and a failure of that start becomes the error event.
4. Close, exactly once, whatever happened: ``respond`` holds the call in ``async with``; a stream
   takes it over (``detach``) and closes it in its ``finally`` and in the response's background task,
   which runs after any end. The call's ``close()`` never suspends, so it completes even inside a
   cancelled scope (Litestar cancels a stream's task group when the client leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from services.gateway.pd import dmi
from services.gateway.request.call import Call
from services.gateway.request.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.request.marks import mark_failed_in_stream
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Started
from shared.aio import within

log = logging.getLogger("switchboard.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_KEEP_ALIVE = b": keep-alive\n\n"  # a comment line: every SSE client skips it

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
           trailer: bytes = b"", keep_alive: bytes = b"") -> Stream:
    """A streaming response of ``chunks``; a failure becomes ``error_chunk(exc)``; ``trailer`` ends it;
    ``keep_alive`` goes out after each ``keep_alive_s`` of silence (none when empty or 0). The stream owns the
    call from here: it closes it at its end, or in the background task if it never ran."""
    call.detach()
    every = call.ctx.keep_alive_s
    if keep_alive and every > 0:
        chunks = with_keep_alives(chunks, every, keep_alive)
    return Stream(_framed(call, chunks, error_chunk, trailer), media_type=media_type, headers=SSE_HEADERS,
                  background=BackgroundTask(call.aclose))


async def with_keep_alives(chunks: AsyncIterator[bytes], every: float, keep_alive: bytes) -> AsyncIterator[bytes]:
    """``chunks`` as they come, and ``keep_alive`` after each ``every`` seconds without one."""
    source = chunks.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield keep_alive
                continue
            finished, pending = pending, None
            try:
                chunk = finished.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:  # the client left (or the stream failed) while a chunk was awaited
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def _after_start(starting: asyncio.Future, chunks: Callable[[], AsyncIterator[bytes]],
                       keep_alive: bytes) -> AsyncIterator[bytes]:
    """A keep-alive at once (the start has already taken one interval), then the chunks once the call has
    started."""
    try:
        yield keep_alive
        await starting
    except ClientDisconnected:  # seen by the start's own watch: nobody reads this stream
        return
    finally:
        if not starting.done():  # the stream closed first: the client left
            starting.cancel()
    async for chunk in chunks():
        yield chunk


async def _framed(call: Call, chunks: AsyncIterator[bytes], error_chunk: ErrorChunk, trailer: bytes) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except SwitchboardError as exc:
        mark_failed_in_stream(exc.info.status)  # (a refusal unless a choice was received)
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
                  media_type: str = "text/event-stream", trailer: bytes = b"", stop_ok: bool = False,
                  keep_alive: bytes | None = None) -> Response:
    """The whole lifecycle: start, then a JSON body or a stream. In ``inferMode`` "dmi" the request came from
    a coordinator: it is admitted by its headers, and answered with the first-token JSON (``pd/dmi.py``);
    ``stop_ok`` says the family takes stop words there (the OpenAI routes); ``keep_alive``: the family's
    keep-alive chunk (default: an SSE comment for an event stream, none otherwise)."""
    if keep_alive is None:
        keep_alive = SSE_KEEP_ALIVE if media_type == "text/event-stream" else b""
    async with call:
        if call.ctx.roles.dmi:
            return await _respond_dmi(request, call, streaming, body, chunks, trailer, stop_ok)
        if not streaming:
            await start(request, call)
            return await collect(request, call, body())
        if not keep_alive or call.ctx.keep_alive_s <= 0:
            await start(request, call)
            return stream(call, chunks(), error_chunk, media_type, trailer, keep_alive)
        starting = asyncio.ensure_future(start(request, call))
        try:
            await within(asyncio.shield(starting), call.ctx.keep_alive_s)
        except asyncio.TimeoutError:  # still queued: the stream begins, with keep-alives while it waits
            return stream(call, _after_start(starting, chunks, keep_alive), error_chunk, media_type, trailer,
                          keep_alive)
        except BaseException:
            starting.cancel()
            raise
        return stream(call, chunks(), error_chunk, media_type, trailer, keep_alive)


async def _respond_dmi(request: Request, call: Call, streaming: bool, body: Callable[[], Awaitable[Any]],
                       chunks: Callable[[], AsyncIterator[bytes]], trailer: bytes, stop_ok: bool) -> Response:
    try:
        ticket = dmi.admit(request, call, stop_ok)
    except dmi.Refused as refused:
        return refused.response()
    await start(request, call)
    return await dmi.respond(request, call, ticket, streaming, body, chunks, trailer)
