"""Inference requests answered with an error before they were received as one (bad input, the slots full, no
engine serving, a body too large) are counted too (``request_refused_total{api, status}``), as TGI counts its
validation and overload failures: a fleet shedding load must not look healthy.

A request is *received* once a session of its call has said so (``Received``: a tokenizer took it, its input
valid; from then on its end is counted with the request counters). The middleware gives each HTTP request a
``Mark`` (``request/marks.py``); ``Session.start`` marks it received; an error status of an unmarked inference
route is a refusal (a stream's too, when its start failed after the stream began: the status its error has)."""

from __future__ import annotations

import re
from typing import Callable

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.request.marks import MARK, Mark
from services.gateway.web.slowloris import ANSWERED
from shared.metrics_messages import MetricsEvent, Refused


# The inference routes (POST) and their ``api`` label, as their calls name it.
ROUTES = [(re.compile(r"^/v1/chat/completions/?$"), "openai-chat"), (re.compile(r"^/v1/completions/?$"), "openai-completions"),
          (re.compile(r"^/v1/responses/?$"), "openai-responses"), (re.compile(r"^/v1/messages/?$"), "anthropic"),
          (re.compile(r"^/(generate|generate_stream|invocations)?/?$"), "tgi"), (re.compile(r"^/infer(_token)?/?$"), "mindie"),
          (re.compile(r"^/v2/models/.+/(infer|generate|generate_stream)/?$"), "triton")]


def api_of(path: str) -> str | None:
    return next((api for pattern, api in ROUTES if pattern.match(path)), None)


def refusal_middleware(model: Callable[[], str], emit: Callable[[MetricsEvent], None]):
    """The ASGI middleware counting refusals; ``model`` names the deployment's model, ``emit`` sends the event."""
    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope.get("method") != "POST" or api_of(scope["path"]) is None:
                await app(scope, receive, send)
                return
            mark, status = Mark(), [0]
            MARK.set(mark)

            async def capture(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await app(scope, receive, capture)
            finally:
                refused = scope.get(ANSWERED) or (status[0] if status[0] >= 400 else mark.late_status)
                if refused >= 400 and refused != 499 and not mark.received:  # (499: the client left first)
                    emit(Refused(model=model(), api=mark.api or api_of(scope["path"]), status=refused))
        return middleware
    return wrap
