"""Each inference request is one trace, continuing the client's (a W3C ``traceparent`` header, as vLLM and TGI
take it): a SERVER span named for its route, as OpenTelemetry's HTTP conventions have it, with the method,
route, path and status, whose child ``gateway.request`` spans (one per choice) lead to the tokenizer and engine.
Requests refused before they were received (bad input, the slots full) are traced too: their span alone."""

from __future__ import annotations

import asyncio

from opentelemetry import context, trace

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.web.refusals import api_of
from shared import telemetry


def tracing_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or api_of(scope["path"]) is None:
            await app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        route = scope.get("path_template") or scope["path"]
        span = telemetry.start_server_span(f"POST {route}", headers, **{
            "http.request.method": "POST", "http.route": route, "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http")})
        status = [0]

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                span.set_attribute("http.response.status_code", status[0])
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await app(scope, receive, capture)
        except asyncio.CancelledError:  # the client left: not the server's failure
            status[0] = status[0] or 499
            raise
        except BaseException as exc:
            span.record_exception(exc)
            status[0] = status[0] or 500
            raise
        finally:
            context.detach(token)
            # a server span is an error only for a 5xx: a 4xx is the client's (OpenTelemetry's HTTP conventions)
            telemetry.end_span(span, f"HTTP {status[0]}" if status[0] >= 500 else None)
    return middleware
