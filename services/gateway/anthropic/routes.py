"""Anthropic's Messages API on the business plane: ``POST /v1/messages`` (over the one request lifecycle, as a
chat completion of the same conversation) and ``POST /v1/messages/count_tokens`` (what that request's
``usage.input_tokens`` will be). The ``anthropic-version`` and ``x-api-key`` headers are accepted; this server
holds no keys, so none is checked. Errors in Anthropic's shape (``errors.py``)."""

from __future__ import annotations

from litestar import Request, Response, Router, post, route
from litestar.exceptions import MethodNotAllowedException

from services.gateway.anthropic.errors import ANTHROPIC_EXCEPTION_HANDLERS
from services.gateway.anthropic.responses import PING, error_event, message_body, message_events
from services.gateway.anthropic.schemas import parse_messages
from services.gateway.common.content import admit, chat_media
from services.gateway.openai_api.errors import content_error
from services.gateway.openai_api.runner import build_call
from services.gateway.request import lifecycle
from services.gateway.web import off_loop
from shared.messages import Tokenize


@post("/v1/messages", status_code=200)
async def messages(request: Request) -> Response:
    gateway = request.app.state.gateway
    req = await off_loop.read(request, parse_messages, await request.body(), gateway.cfg, gateway.served())
    admit(req.listed, gateway.media_policy, content_error, gateway.modalities())
    prompt = {"messages": req.messages, "truncate": req.common.truncate, "parts": chat_media(req.listed), **req.turn}
    if req.tools is not None:
        prompt.update(tools=req.tools.declared, tool_choice=req.tools.choice)
    call = build_call(gateway.context, [prompt], req.common.sampling, 1, req.common.adapter, "anthropic")
    return await lifecycle.respond(request, call, req.common.stream, lambda: message_body(req, call),
                                   lambda: message_events(req, call), error_event, keep_alive=PING)


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request) -> Response:
    gateway = request.app.state.gateway
    req = await off_loop.read(request, parse_messages, await request.body(), gateway.cfg, gateway.served(),
                              counting=True)
    admit(req.listed, gateway.media_policy, content_error, gateway.modalities())
    tools = req.tools
    counted = await gateway.tokenize(Tokenize(messages=req.messages, tools=tools.declared if tools else [],
                                              tool_choice=tools.choice if tools else "", parts=chat_media(req.listed),
                                              **req.turn))
    return Response({"input_tokens": len(counted.ids)}, media_type="application/json")


@route(["/v1/messages", "/v1/messages/count_tokens"], http_method=["GET", "PUT", "PATCH", "DELETE"])
async def wrong_method(request: Request) -> None:
    raise MethodNotAllowedException(headers={"Allow": "OPTIONS, POST"})  # as OPTIONS answers


ROUTES = [Router("/", route_handlers=[messages, count_tokens, wrong_method],
                 exception_handlers=ANTHROPIC_EXCEPTION_HANDLERS)]
