"""TGI routes: ``POST /`` (and SageMaker's ``POST /invocations``), ``POST /generate_stream``, and ``POST /generate``
with a TGI body."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, Router, post

from services.gateway.common.content import admit, markdown_images, prompt_parts
from services.gateway.common.served import Served
from services.gateway.request import lifecycle
from services.gateway.request.call import Call
from services.gateway.request.session import Session
from services.gateway.tgi.responses import collect, error_event, stream_events
from services.gateway.tgi.schemas import TgiRequest, parse_tgi
from services.gateway.web import off_loop
from services.gateway.web.errors import TGI_EXCEPTION_HANDLERS
from shared.errors import validation

GENERATE_PARSE_ERROR = (
    '{"Error": "`inputs` or `prompt` must be necessary and data type must be string. '
    'Additionally, the request body must be valid json", "error_type": "validation"}'
)


@post(["/", "/invocations"], status_code=200)
async def tgi_root(request: Request) -> Response:
    """``POST /``, and TGI's SageMaker route ``POST /invocations``, which answers as ``/`` does."""
    return await respond(request, await off_loop.read(request, parse_tgi, await request.body(), _served(request)),
                         as_array=True)


async def generate(request: Request, data: dict) -> Response:
    """``POST /generate`` with a TGI body (services/gateway/web/generate.py tells it from vLLM's)."""
    if data.get("inputs") is None:
        raise validation(GENERATE_PARSE_ERROR)
    return await respond(request, await off_loop.read(request, parse_tgi, data, _served(request), stream=False),
                         as_array=False)


@post("/generate_stream", status_code=200)
async def generate_stream(request: Request) -> Response:
    req = await off_loop.read(request, parse_tgi, await request.body(), _served(request), stream=True)
    return await respond(request, req, as_array=False)


def _served(request: Request) -> Served:
    return request.app.state.gateway.served()


async def respond(request: Request, req: TgiRequest, as_array: bool) -> Response:
    gateway = request.app.state.gateway
    modalities = gateway.modalities()
    listed = req.listed or (markdown_images(req.inputs, "inputs") if "image" in modalities else None)
    admit([listed], gateway.media_policy, modalities=modalities)
    sampling = msgspec.structs.replace(req.sampling, prompt_logprobs=0) if req.decoder_input_details else req.sampling
    session = Session(gateway.context, req.inputs, sampling, truncate=req.truncate, parts=prompt_parts(listed),
                      return_prompt_ids=req.decoder_input_details, adapter=req.adapter, api="tgi")
    call = Call(gateway.context, [session])
    full_text_mode = gateway.cfg.server.full_text_enabled
    return await lifecycle.respond(request, call, req.stream, lambda: collect(call, req, as_array),
                                   lambda: stream_events(call, req, full_text_mode), error_event)


ROUTES = [Router("/", route_handlers=[tgi_root, generate_stream], exception_handlers=TGI_EXCEPTION_HANDLERS)]
