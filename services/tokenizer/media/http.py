"""A minimal HTTP/1.1 GET for media, pinned to an address that was checked.

General-purpose clients resolve the host name themselves when they connect, so an address checked a
moment earlier may not be the one connected to (DNS rebinding), and they follow redirects on their
own. This one connects to the checked IP, sends the original name in ``Host`` and TLS SNI (the
certificate is verified against that name), never follows a redirect (the caller re-checks each
one) and reads the body as a stream with a byte limit, so an over-large answer stops at the limit.
One request per connection (``Connection: close``); no compression is asked for or accepted.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Callable

from shared.errors import validation
from shared.media import size_text
from shared.media_urls import RemoteTarget

CHUNK = 64 * 1024
MAX_HEAD = 64 * 1024  # status line and headers together
MAX_HEADERS = 100
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")
_TLS: ssl.SSLContext | None = None


class Response:
    """The status and headers of an answer, and the open stream its body comes from."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader, writer):
        self.status, self.headers, self.reader, self.writer = status, headers, reader, writer

    def close(self) -> None:
        self.writer.close()


def _tls() -> ssl.SSLContext:
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


async def get(remote: RemoteTarget, ip: str, where: str) -> Response:
    """GET ``remote`` from ``ip``; the caller closes the response."""
    tls = _tls() if remote.scheme == "https" else None
    try:
        reader, writer = await asyncio.open_connection(
            ip, remote.port, ssl=tls, server_hostname=remote.host if tls else None, limit=MAX_HEAD)
    except OSError as exc:
        raise validation(f"could not fetch {where}: cannot connect to {remote.host_header} ({_reason(exc)})") from None
    try:
        writer.write(_request_head(remote))
        await writer.drain()
        status, headers = await _read_head(reader, where)
    except BaseException:
        writer.close()
        raise
    return Response(status, headers, reader, writer)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _request_head(remote: RemoteTarget) -> bytes:
    return (f"GET {remote.target} HTTP/1.1\r\nHost: {remote.host_header}\r\nUser-Agent: switchboard-media\r\n"
            "Accept: */*\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n").encode("ascii")


async def _read_head(reader: asyncio.StreamReader, where: str) -> tuple[int, dict[str, str]]:
    """The final status line and headers (1xx answers skipped); header names lower-case."""
    budget = [MAX_HEAD]
    while True:
        status = _status(await _line(reader, where, budget), where)
        headers = await _headers(reader, where, budget)
        if not 100 <= status < 200:
            return status, headers


def _status(line: bytes, where: str) -> int:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise validation(f"could not fetch {where}: the server's answer is not HTTP/1.x")
    return int(parts[1])


async def _headers(reader: asyncio.StreamReader, where: str, budget: list[int]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        line = await _line(reader, where, budget)
        if not line:
            return headers
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon or not name or name != name.strip():
            raise validation(f"could not fetch {where}: the server sent a malformed header")
        name, value = name.lower(), value.strip()
        if name in headers and name in ("content-length", "transfer-encoding", "location") and headers[name] != value:
            raise validation(f"could not fetch {where}: the server sent conflicting {name} headers")
        headers[name] = value
    raise validation(f"could not fetch {where}: the server sent more than {MAX_HEADERS} headers")


async def _line(reader: asyncio.StreamReader, where: str, budget: list[int]) -> bytes:
    """One CRLF-ended line without its end; the answer's head may not pass MAX_HEAD bytes."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError:
        raise validation(f"could not fetch {where}: the server closed the connection before answering") from None
    except (asyncio.LimitOverrunError, ValueError):
        raise validation(f"could not fetch {where}: the server's headers are larger than {MAX_HEAD // 1024} KB") from None
    budget[0] -= len(line)
    if budget[0] < 0:
        raise validation(f"could not fetch {where}: the server's headers are larger than {MAX_HEAD // 1024} KB")
    return line.rstrip(b"\r\n")


async def read_body(resp: Response, limit: int, where: str, too_big: str, take: Callable[[int], None]) -> bytes:
    """The whole body, at most ``limit`` bytes (else a 422 ``too_big``); ``take`` is told of each
    piece as it arrives (the request's total)."""
    h = resp.headers
    if h.get("content-encoding", "identity").lower() != "identity":
        raise validation(f"could not fetch {where}: the server sent a {h['content-encoding']}-encoded body")
    coding = h.get("transfer-encoding", "").lower()
    if coding and coding != "chunked":
        raise validation(f"could not fetch {where}: transfer encoding {coding!r} is not supported")
    if coding:
        return await _chunked(resp.reader, limit, where, too_big, take)
    length = _content_length(h.get("content-length"), where)
    if length is not None and length > limit:
        raise validation(f"{where}: the server announces {size_text(length)}, {too_big}")
    return await _stream(resp.reader, limit if length is None else length, length is not None, where, too_big, take)


def _content_length(value: str | None, where: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit():
        raise validation(f"could not fetch {where}: the server sent a malformed Content-Length")
    return int(value)


async def _stream(reader, limit: int, exact: bool, where: str, too_big: str, take) -> bytes:
    """``limit`` bytes when ``exact`` (Content-Length), else up to the end of the stream."""
    parts, got = [], 0
    while got < limit or not exact:
        piece = await reader.read(min(CHUNK, limit - got) if exact else CHUNK)
        if not piece:
            if exact:
                raise validation(f"could not fetch {where}: the connection closed before the whole body arrived")
            break
        got += len(piece)
        if got > limit:
            raise validation(f"{where}: the body is {too_big}")
        take(len(piece))
        parts.append(piece)
    return b"".join(parts)


async def _chunked(reader, limit: int, where: str, too_big: str, take) -> bytes:
    parts, got = [], 0
    while True:
        size = _chunk_size(await _line(reader, where, [MAX_HEAD]), where)
        if size == 0:
            return b"".join(parts)  # trailers, if any, are left unread: the connection is closed
        got += size
        if got > limit:
            raise validation(f"{where}: the body is {too_big}")
        parts.append(await _stream(reader, size, True, where, too_big, take))
        if await _line(reader, where, [MAX_HEAD]):
            raise validation(f"could not fetch {where}: a chunk of the body is malformed")


def _chunk_size(line: bytes, where: str) -> int:
    text = line.split(b";", 1)[0].strip()
    if not _HEX.fullmatch(text):
        raise validation(f"could not fetch {where}: a chunk of the body is malformed")
    return int(text, 16)
