"""App factory: one Litestar app per listener, with the routes of the planes it serves."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from litestar import Litestar
from litestar.datastructures import State
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway import health
from services.gateway.core import Gateway
from services.gateway.errors import EXCEPTION_HANDLERS
from services.gateway.native import routes as native
from services.gateway.openai_api import routes as openai_api
from services.gateway.tgi import routes as tgi
from services.gateway.triton import routes as triton

BUSINESS_ROUTES = [*tgi.ROUTES, *openai_api.ROUTES, *triton.ROUTES, *native.ROUTES]
MANAGEMENT_ROUTES = [*health.ROUTES, *triton.MANAGEMENT_ROUTES]


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    app: Litestar


def create_app(gateway: Gateway, route_handlers: list) -> Litestar:
    return Litestar(
        route_handlers=route_handlers,
        state=State({"gateway": gateway}),
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=gateway.cfg.server.max_request_length * 1024 * 1024,
        middleware=[request_uuid_middleware],
        openapi_config=None,
        logging_config=None,
    )


def listeners(gateway: Gateway) -> list[Listener]:
    """Business and management listeners; merged into one when their address and port coincide."""
    server = gateway.cfg.server
    business = (server.ip_address, server.port)
    management = (server.management_ip, server.management_listen_port)
    if business == management:
        return [Listener(*business, create_app(gateway, BUSINESS_ROUTES + MANAGEMENT_ROUTES))]
    return [Listener(*business, create_app(gateway, BUSINESS_ROUTES)),
            Listener(*management, create_app(gateway, MANAGEMENT_ROUTES))]


def request_uuid_middleware(app: ASGIApp) -> ASGIApp:
    """Every response carries a ``RequestUUID`` header (reference §2.2)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        header = (b"requestuuid", uuid.uuid4().hex.encode())

        async def send_with_uuid(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await app(scope, receive, send_with_uuid)

    return middleware
