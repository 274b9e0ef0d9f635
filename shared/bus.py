"""NATS helpers: connect with callbacks set, publish and request msgspec messages."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg as NatsMsg

from shared.messages import encode

log = logging.getLogger("switchboard.bus")

# Token streams are bursty: never let a slow consumer drop events (STYLE.md).
PENDING_MSGS = 1_000_000
PENDING_BYTES = 1024 * 1024 * 1024


class Stopped(Exception):
    """The service was told to stop before it reached NATS."""


async def connect(url: str, name: str, stop: asyncio.Event | None = None) -> Client:
    """Connect with error/disconnect/reconnect callbacks that log and never raise. The first connection is tried
    until it succeeds, or until ``stop`` is set (SIGTERM while NATS is down): then ``Stopped``."""
    attempt = asyncio.ensure_future(_connect(url, name))
    if stop is None:
        return await attempt
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([attempt, stopped], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        attempt.cancel()
        raise
    finally:
        stopped.cancel()
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    raise Stopped(f"{name} stopped before it reached NATS at {url}")


REPEAT_LOG_S = 30.0  # the same nats error again (a retry every 0.5 s while NATS is down) is logged this often


async def _connect(url: str, name: str) -> Client:
    last = {"error": "", "at": 0.0, "repeats": 0}

    async def on_error(exc: Exception) -> None:
        error, now = repr(exc), time.monotonic()
        if error == last["error"] and now - last["at"] < REPEAT_LOG_S:
            last["repeats"] += 1
            return
        repeats = last["repeats"] if error == last["error"] else 0
        log.warning("nats error", extra={"service": name, "error": error, "url": url,
                                         **({"repeated": repeats} if repeats else {})})
        last.update(error=error, at=now, repeats=0)

    async def on_disconnect() -> None:
        log.info("nats disconnected", extra={"service": name})

    async def on_reconnect() -> None:
        last.update(error="", repeats=0)
        log.info("nats reconnected", extra={"service": name})

    return await nats.connect(
        servers=[url],
        name=name,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        pending_size=64 * 1024 * 1024,
    )


async def close(nc: Client, timeout: float = 3.0) -> None:
    """Drain (finish in-flight handlers, flush publishes), but never hang when the server is gone."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)  # (the shutdown's: a cancel then ends the process anyway)
    except Exception:
        await nc.close()


async def subscribe(
    nc: Client, subject: str, handler: Callable[[NatsMsg], Awaitable[None]], queue: str = ""
) -> Any:
    """Subscribe with streaming-sized pending limits; a raising handler is logged, not fatal."""

    async def safe(msg: NatsMsg) -> None:
        try:
            await handler(msg)
        except Exception:
            log.exception("handler failed", extra={"subject": msg.subject})

    return await nc.subscribe(
        subject, queue=queue, cb=safe, pending_msgs_limit=PENDING_MSGS, pending_bytes_limit=PENDING_BYTES
    )


async def publish(nc: Client, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
    await nc.publish(subject, encode(msg), headers=headers or None)


async def request(nc: Client, subject: str, msg: msgspec.Struct, reply_type: Any, timeout: float = 2.0) -> Any:
    """Request/reply; raises nats.errors.TimeoutError or NoRespondersError when nobody answers."""
    reply = await nc.request(subject, encode(msg), timeout=timeout)
    return msgspec.msgpack.decode(reply.data, type=reply_type)


async def respond(msg: NatsMsg, reply: msgspec.Struct) -> None:
    await msg.respond(encode(reply))
