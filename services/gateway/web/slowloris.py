"""Slow clients bounded: deadlines on reading a request, and a cap on open connections per listener.

uvicorn bounds neither: ``timeout_keep_alive`` only closes keep-alive connections idle *between*
requests, so a client that sends half a request head, or a head and half a body, holds its socket
(and a file descriptor) forever; ``limit_concurrency`` counts only once a head has arrived, counts
the asking connection itself, and refuses later requests on connections it already admitted.

``protocol_class`` gives each listener an h11 protocol that:

* gives a connection ``headerTimeoutSeconds`` to send a whole request head, from the moment it opens
  (or from the first byte of a keep-alive request), and a request ``bodyTimeoutSeconds`` from its head
  to the end of its body; past either, it answers 408 when no answer has started, then closes;
* runs no deadline once a request is read, so answers and streams are never cut;
* on a TLS listener, gives the handshake headerTimeoutSeconds too (asyncio's default is 60 s, which uvicorn
  does not set), then the head its own;
* admits ``maxConnections`` connections; one opened beyond them is answered 503 (``Retry-After``,
  ``Connection: close``) on its request, as nginx's ``limit_conn`` does, and is held no longer than
  the head deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from asyncio import sslproto
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.web.errors import shaped_body
from shared.config import Config

log = logging.getLogger("switchboard.gateway")
HEAD, BODY = "head", "body"
HEAD_LIMIT = 16 * 1024  # the longest request head (uvicorn's and h11's default)
ANSWERED = "switchboard.answered"  # a scope's key: the status this protocol answered the request with itself


@dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @classmethod
    def from_config(cls, cfg: Config) -> "ClientLimits":
        s = cfg.switchboard
        return cls(s.header_timeout_seconds, s.body_timeout_seconds, s.max_connections)


def protocol_class(limits: ClientLimits) -> type["SlowClientProtocol"]:
    """An h11 protocol class for one listener: its own limits and its own set of admitted connections."""
    return type("ListenerProtocol", (SlowClientProtocol,), {"limits": limits, "admitted": set()})


def tls_protocols(protocol: type["SlowClientProtocol"], context: ssl.SSLContext):
    """A protocol factory for uvicorn's ``http`` on a TLS listener (uvicorn then given no context of its own):
    each connection's ``protocol`` behind TLS with the handshake bounded by headerTimeoutSeconds, as the
    event loop builds it for a server given ``ssl`` and ``ssl_handshake_timeout``."""

    def create(*, _loop: asyncio.AbstractEventLoop | None = None, **kwargs) -> asyncio.Protocol:
        loop = _loop or asyncio.get_running_loop()
        return sslproto.SSLProtocol(loop, protocol(_loop=_loop, **kwargs), context, None, server_side=True,
                                    ssl_handshake_timeout=protocol.limits.header_timeout_s)

    return create


def _plain_response(status: int, reason: str, body: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written straight to the transport."""
    payload = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n").encode() + payload


async def _over_capacity(scope, receive, send) -> None:
    """The ASGI app of a connection opened beyond maxConnections: 503, then the connection closes."""
    message = "Too many open connections: the listener's maxConnections is reached; retry later"
    payload = json.dumps(shaped_body(scope.get("path", ""), 503, message, "Service Unavailable")).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class SlowClientProtocol(H11Protocol):
    """uvicorn's h11 protocol with request-reading deadlines and admission under a connection cap."""

    limits: ClientLimits  # set per listener by protocol_class()
    admitted: set  # the listener's connections within maxConnections

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # HEAD or BODY while a deadline runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._remember_protocol_errors()
        if len(self.admitted) < self.limits.max_connections:
            self.admitted.add(self)
        else:
            self.app = _over_capacity
        self._arm(HEAD)

    def connection_lost(self, exc: Exception | None) -> None:
        self.admitted.discard(self)
        self._disarm()
        super().connection_lost(exc)

    def _remember_protocol_errors(self) -> None:
        """h11's error for a head it cannot take (its size, its syntax), which uvicorn drops before answering."""
        self.protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def remembering():
            try:
                event = next_event()
                if isinstance(event, h11.Request):
                    self._check_head(event)
                return event
            except h11.RemoteProtocolError as exc:
                self.protocol_error = exc
                raise

        self.conn.next_event = remembering

    def _check_head(self, request: h11.Request) -> None:
        """What h11 takes and a server must not: a head over the size limit that came whole (h11 limits only
        a head still arriving), and a request with both Content-Length and Transfer-Encoding, which RFC 9112
        §6.3 calls a smuggling attempt (a server that serves it must close the connection after: refused here,
        and closed)."""
        limit = self.config.h11_max_incomplete_event_size or HEAD_LIMIT
        size = len(request.method) + len(request.target) + 13 + sum(len(n) + len(v) + 4 for n, v in request.headers)
        if size > limit:
            raise h11.RemoteProtocolError(f"the request head is {size} bytes, over the {limit}-byte limit",
                                          error_status_hint=431)
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise h11.RemoteProtocolError("a request may not have both Content-Length and Transfer-Encoding")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's plain-text 400 for a request h11 cannot parse, as JSON and with h11's status (431 for a head
        over its size limit); then the connection closes."""
        exc = self.protocol_error
        status = getattr(exc, "error_status_hint", 400) if exc is not None else 400
        reason = {431: "Request Header Fields Too Large"}.get(status, "Bad Request")
        detail = f"{msg[:-1]}: {exc}" if exc is not None and str(exc) else msg
        self.transport.write(_plain_response(status, reason, {"error": detail, "error_type": reason}))
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        """An ``Upgrade`` (h2c, websocket) is answered as plain HTTP/1.1, as RFC 9110 lets a server; uvicorn
        logged two warnings for each such request, which any client could fill the log with."""

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_request()

    def _follow_request(self) -> None:
        """Run the deadline for what the client still owes: a head, a body, or nothing."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm(BODY)
        elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            self._arm(HEAD)  # a new connection, or a keep-alive request that has begun
        else:
            self._disarm()

    def _arm(self, phase: str) -> None:
        if self.reading == phase:
            return
        self._disarm()
        timeout = self.limits.header_timeout_s if phase == HEAD else self.limits.body_timeout_s
        self.reading = phase
        self.deadline = self.loop.call_later(timeout, self._expired, phase)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.reading = None, None

    def _expired(self, phase: str) -> None:
        self.deadline, self.reading = None, None
        if self.transport.is_closing():
            return
        if phase == BODY and self.flow.read_paused:
            self._arm(BODY)  # the app has not read the body yet: the server is the slow one
            return
        self._time_out(phase)

    def _time_out(self, phase: str) -> None:
        """408 when no answer has started, then close; the app (if any) sees a disconnect."""
        timeout = self.limits.header_timeout_s if phase == HEAD else self.limits.body_timeout_s
        log.info("closing a connection from %s: request %s not received within %s s", self.client, phase, timeout)
        if phase == HEAD or not self.cycle.response_started:
            message = f"The request {phase} was not received within {timeout:g} s."
            path = self.cycle.scope.get("path", "") if phase == BODY and self.cycle is not None else ""
            self.transport.write(_plain_response(408, "Request Timeout",
                                                 shaped_body(path, 408, message, "Request Timeout")))
            if phase == BODY and self.cycle is not None:
                self.cycle.scope[ANSWERED] = 408  # what the client got, for the refusal count (web/refusals.py)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()
