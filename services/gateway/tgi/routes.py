"""TGI routes: ``POST /``, ``POST /generate`` (TGI body), ``POST /generate_stream``."""

from __future__ import annotations

from litestar import Request, Response, Router, post
from litestar.response import Stream

from services.gateway.errors import TGI_EXCEPTION_HANDLERS
from services.gateway.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.session import Session
from services.gateway.tgi.responses import collect, stream_events
from services.gateway.tgi.schemas import TgiRequest, parse_tgi
from services.gateway.validation import parse_json_object
from shared.errors import validation

GENERATE_PARSE_ERROR = (
    '{"Error": "`inputs` or `prompt` must be necessary and data type must be string. '
    'Additionally, the request body must be valid json", "error_type": "validation"}'
)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@post("/", status_code=200)
async def tgi_root(request: Request) -> Response:
    return await respond(request, parse_tgi(await request.body()), as_array=True)


@post("/generate", status_code=200)
async def generate(request: Request) -> Response:
    """TGI or vLLM, told apart by the body (reference §3.23)."""
    data = parse_json_object(await request.body(), GENERATE_PARSE_ERROR)
    if data.get("prompt") is not None:
        raise validation("vLLM-style /generate bodies (`prompt`) are not served yet; send TGI `inputs`.")
    if data.get("inputs") is None:
        raise validation(GENERATE_PARSE_ERROR)
    return await respond(request, parse_tgi(data, stream=False), as_array=False)


@post("/generate_stream", status_code=200)
async def generate_stream(request: Request) -> Response:
    return await respond(request, parse_tgi(await request.body(), stream=True), as_array=False)


async def respond(request: Request, req: TgiRequest, as_array: bool) -> Response:
    gateway = request.app.state.gateway
    session = Session(gateway, req.inputs, req.sampling, truncate=req.truncate,
                      return_prompt_ids=req.decoder_input_details)
    try:
        started = await unless_disconnected(request, session.start())
    except BaseException:
        await session.close()
        raise
    if req.stream:
        events = stream_events(session, req, started, gateway.cfg.server.full_text_enabled)
        return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        body = await unless_disconnected(request, collect(session, req, started))
    except ClientDisconnected:
        return Response(b"", status_code=499)
    finally:
        await session.close()
    return Response([body] if as_array else body, media_type="application/json")


ROUTES = [Router("/", route_handlers=[tgi_root, generate, generate_stream], exception_handlers=TGI_EXCEPTION_HANDLERS)]
