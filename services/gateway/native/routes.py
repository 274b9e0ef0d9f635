"""MindIE-native routes: /infer, /infer_token, /v1/tokenizer (reference §3.27, §3.28, §3.32).

Errors use MindIE's ``{"error", "error_type"}`` body (the app's default handlers).
"""

from __future__ import annotations

from litestar import Request, Response, post

from services.gateway.common.content import admit, prompt_parts
from services.gateway.native.responses import collect, error_event, stream_events
from services.gateway.native.schemas import parse_infer, parse_tokenize
from services.gateway.request import lifecycle
from services.gateway.request.call import Call
from services.gateway.request.session import Session
from shared.messages import Tokenize


@post(["/infer", "/infer_token"], status_code=200)
async def infer(request: Request) -> Response:
    req = parse_infer(await request.body())
    gateway = request.app.state.gateway
    admit([req.listed], gateway.media_policy, modalities=gateway.modalities())
    session = Session(gateway.context, req.text or "", req.sampling, prompt_ids=req.ids, priority=req.priority,
                      parts=prompt_parts(req.listed), timeout_s=req.timeout_s, api="mindie")
    call = Call(gateway.context, [session])
    full_text_mode = gateway.cfg.server.full_text_enabled
    return await lifecycle.respond(request, call, req.stream, lambda: collect(call, req),
                                   lambda: stream_events(call, req, full_text_mode), error_event)


@post("/v1/tokenizer", status_code=200)
async def tokenizer(request: Request) -> Response:
    gateway = request.app.state.gateway
    req = parse_tokenize(await request.body(), gateway.cfg.server.max_request_length)
    result = await gateway.tokenize(Tokenize(text=req.text))
    return Response({"token_number": len(result.ids), "tokens": result.pieces if req.do_decode else []},
                    media_type="application/json")


ROUTES = [infer, tokenizer]
