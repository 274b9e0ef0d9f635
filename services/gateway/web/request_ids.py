"""Each response's ids: ``RequestUUID`` (reference §2.2: every response, the router's own 404s and 405s too) and
``x-request-id`` (the client's ``X-Request-Id`` when it sent one, as vLLM answers it; else the RequestUUID), which
the ``openai`` SDK reads as a response's ``_request_id``. The OpenAI routes name an answer by the client's id when
its body gives no ``request_id`` (``chatcmpl-<id>``, as vLLM does). Around the Litestar app: its middleware runs
only once a route has matched."""

from __future__ import annotations

import re
import uuid

from litestar import Request
from litestar.types import ASGIApp, Message, Receive, Scope, Send

CLIENT_ID = "switchboard.client_request_id"  # a scope's key: the client's X-Request-Id, when it is one
USABLE = re.compile(rb"[!-~]{1,128}\Z")  # visible ASCII, as an id that goes into bodies and headers must be
RETRY_AFTER = (b"retry-after", b"1")


def client_request_id(request: Request) -> str:
    """The client's X-Request-Id ("" when it sent none, or one of no visible ASCII or over 128 characters)."""
    return request.scope.get(CLIENT_ID, "")


def request_ids_middleware(app: ASGIApp) -> ASGIApp:
    """RequestUUID and x-request-id on every response; 429 and 503 a ``Retry-After``."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        generated = uuid.uuid4().hex.encode()
        sent = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), b"")
        if USABLE.match(sent):
            scope[CLIENT_ID] = sent.decode()
        ids = [(b"requestuuid", generated), (b"x-request-id", sent if CLIENT_ID in scope else generated)]

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), *ids]
                if message["status"] in (429, 503) and not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append(RETRY_AFTER)
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_with_ids)

    return middleware
