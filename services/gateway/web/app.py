"""App factory: one Litestar app per listener, with the routes of the planes it serves."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.admin import health, lora, metrics, status, stop
from services.gateway.anthropic import routes as anthropic
from services.gateway.core import Gateway
from services.gateway.native import routes as native
from services.gateway.openai_api import routes as openai_api
from services.gateway.openai_api import tokenize as openai_tokenize
from services.gateway.pd import dresult
from services.gateway.responses_api import routes as responses_api
from services.gateway.tgi import routes as tgi
from services.gateway.triton import routes as triton
from services.gateway.web import generate
from services.gateway.web.errors import EXCEPTION_HANDLERS
from services.gateway.web.refusals import refusal_middleware
from services.gateway.web.request_ids import request_ids_middleware
from services.gateway.web.tracing import tracing_middleware

BUSINESS_ROUTES = [*tgi.ROUTES, *generate.ROUTES, *openai_api.ROUTES, *openai_tokenize.ROUTES, *responses_api.ROUTES,
                   *anthropic.ROUTES, *triton.ROUTES, *native.ROUTES, *dresult.ROUTES, *health.BUSINESS_ROUTES]
MANAGEMENT_ROUTES = [*health.ROUTES, *status.ROUTES, *stop.ROUTES, *lora.ROUTES, *triton.MANAGEMENT_ROUTES,
                     *metrics.MANAGEMENT_ROUTES]
METRICS_ROUTES = [*metrics.METRICS_ROUTES]


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    app: ASGIApp  # the Litestar app, HEAD answered around it
    planes: tuple[str, ...] = ("business",)  # which planes' routes it serves: business, management, metrics


def create_app(gateway: Gateway, route_handlers: list, business: bool = True) -> Litestar:
    """``business``: the listener serves the inference routes (traced, and their refusals counted)."""
    counting = [tracing_middleware, refusal_middleware(lambda: gateway.cfg.model.model_name, gateway.emit)] \
        if business else []
    return Litestar(
        route_handlers=route_handlers,
        state=State({"gateway": gateway}),
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=gateway.cfg.server.max_request_length * 1024 * 1024,
        cors_config=cors(gateway.cfg.switchboard.cors_allow_origins),
        middleware=counting,
        openapi_config=None,
        logging_config=None,
    )


def cors(origins: list[str]) -> CORSConfig | None:
    """Switchboard.corsAllowOrigins: preflights answered and responses marked for those origins (any method and
    header, as vLLM's defaults); none, no CORS."""
    return CORSConfig(allow_origins=origins, allow_methods=["*"], allow_headers=["*"]) if origins else None


def listeners(gateway: Gateway) -> list[Listener]:
    """One listener per distinct address: planes that share an address and port share a listener (§2.1)."""
    server = gateway.cfg.server
    planes = {
        "business": ((server.ip_address, server.port), BUSINESS_ROUTES),
        "management": ((server.management_ip, server.management_listen_port), MANAGEMENT_ROUTES),
        "metrics": ((server.management_ip, server.metrics_port), METRICS_ROUTES),
    }
    by_address: dict[tuple[str, int], list[str]] = {}
    for name, (address, _) in planes.items():
        by_address.setdefault(address, []).append(name)
    return [Listener(host, port, around(create_app(gateway, [r for name in names for r in planes[name][1]],
                                                  "business" in names)), tuple(names))
            for (host, port), names in by_address.items()]


def around(app: ASGIApp) -> ASGIApp:
    """What runs around the Litestar app, for every request a listener takes (a route matched or not)."""
    return origin_form_middleware(head_middleware(request_ids_middleware(app)))


def origin_form_middleware(app: ASGIApp) -> ASGIApp:
    """A request target in absolute form (``POST http://host/v1/chat/completions``, as a client configured for a
    proxy sends it; RFC 9112 §3.2.2: a server must accept it) routes by its path; uvicorn took the whole URL as
    the path (a 404)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(("http://", "https://")):
            origin = urlsplit(path).path or "/"
            raw = urlsplit(scope.get("raw_path", b"").decode("latin-1")).path or "/"
            scope = {**scope, "path": origin, "raw_path": raw.encode("latin-1")}
        await app(scope, receive, send)

    return middleware


NOT_HEAD = frozenset({"/stopService"})  # a GET that acts: HEAD, which must not, stays 405 there


def head_middleware(app: ASGIApp) -> ASGIApp:
    """HEAD answers as GET does, without the body (as Starlette's and axum's GET routes do, so ``curl -I`` and
    probes that send HEAD see the same status and headers as vLLM's and TGI's give them). Around the app: Litestar
    matches a route's methods before its own middleware runs."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD" or scope["path"] in NOT_HEAD:
            await app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body"):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await app({**scope, "method": "GET"}, receive, send_without_body)

    return middleware
