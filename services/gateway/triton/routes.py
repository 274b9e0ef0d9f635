"""Triton / KServe v2 routes (reference §3.19–§3.21, §3.29–§3.31; §3.2 and §3.5 on the management plane).

``{model}`` must be the served model name, else 404 ``Model <name> not found.``. Every model route
also answers under ``/v2/models/{model}/versions/{version}/...``: MindIE documents the segment as
"not supported, do not pass" (reference §2.1), but tritonclient adds it whenever a caller names a
version, so it is accepted and the version ignored (there is only ever one).
Errors use MindIE's ``{"error", "error_type"}`` body (the app's handlers), which tritonclient reads.
"""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.params import FromPath

from services.gateway.common.content import admit, prompt_parts
from services.gateway.request import lifecycle
from services.gateway.request.call import Call
from services.gateway.request.session import Session
from services.gateway.triton import metadata
from services.gateway.triton.binary import HEADER, decode_body
from services.gateway.triton.llm_infer import TextInferRequest
from services.gateway.triton.responses import (collect_text, error_event, infer_response, stream_events,
                                                text_infer_response)
from services.gateway.triton.schemas import PARSE_ERROR, checked_id, parse_text_request
from services.gateway.triton.tensors import parse_infer
from services.gateway.web.errors import mindie_error
from services.gateway.web.validation import parse_json_object
from shared.errors import ErrorKind, SwitchboardError, validation


def model_paths(suffix: str = "") -> list[str]:
    return [f"/v2/models/{{model:str}}{suffix}", f"/v2/models/{{model:str}}/versions/{{version:str}}{suffix}"]


def served(request: Request, model: str):
    """The gateway, once ``model`` is known to be the served one."""
    gateway = request.app.state.gateway
    if model != gateway.model:
        raise SwitchboardError(ErrorKind.NOT_FOUND, f"Model {model} not found.")
    return gateway


# ---- business plane ---------------------------------------------------------------------------


@get("/v2")
async def server_metadata(request: Request) -> Response:
    return Response(metadata.server_metadata(request.app.state.gateway.cfg))


@get(model_paths())
async def model_metadata(request: Request, model: FromPath[str]) -> Response:
    return Response(metadata.model_metadata(served(request, model).model))


@get(model_paths("/config"))
async def model_config(request: Request, model: FromPath[str]) -> Response:
    return Response(metadata.model_config(served(request, model).cfg))


@post(model_paths("/infer"), status_code=200)
async def infer(request: Request, model: FromPath[str]) -> Response:
    gateway = served(request, model)
    limit = gateway.cfg.server.max_request_length * 1024 * 1024
    body = decode_body(await request.body(), request.headers.get("content-encoding"), limit)
    req = parse_infer(body, request.headers.get(HEADER))
    opts = req.options
    if isinstance(req, TextInferRequest):
        session = Session(gateway.context, req.text, opts.sampling, user_id=req.user_id, priority=opts.priority,
                          timeout_s=opts.timeout_s, api="triton")
        answer = lambda: text_infer_response(call, req)  # noqa: E731
    else:
        session = Session(gateway.context, "", opts.sampling, user_id=req.user_id, prompt_ids=req.prompt_ids,
                          priority=opts.priority, timeout_s=opts.timeout_s, api="triton")
        answer = lambda: infer_response(call, req.binary_output)  # noqa: E731
    call = Call(gateway.context, [session])
    return await lifecycle.respond(request, call, False, answer, _no_stream, error_event)


async def _no_stream():  # /infer answers whole
    yield b""


@post(model_paths("/generate"), status_code=200)
async def generate(request: Request, model: FromPath[str]) -> Response:
    return await _text(request, model, streaming=False)


@post(model_paths("/generate_stream"), status_code=200)
async def generate_stream(request: Request, model: FromPath[str]) -> Response:
    return await _text(request, model, streaming=True)


async def _text(request: Request, model: str, streaming: bool) -> Response:
    gateway = served(request, model)
    req = parse_text_request(await request.body(), streaming)
    admit([req.listed], gateway.media_policy, modalities=gateway.modalities())
    opts = req.options
    session = Session(gateway.context, req.text, opts.sampling, user_id=req.user_id, priority=opts.priority,
                      timeout_s=opts.timeout_s, parts=prompt_parts(req.listed), api="triton")
    call = Call(gateway.context, [session])
    return await lifecycle.respond(request, call, streaming, lambda: collect_text(call, opts),
                                   lambda: stream_events(call, opts), error_event)


@post(model_paths("/stopInfer"), status_code=200)
async def stop_infer(request: Request, model: FromPath[str]) -> Response:
    """End the Triton request the client named ``id``; 200 echoes the body (reference §3.30)."""
    gateway = served(request, model)
    data = parse_json_object(await request.body(), PARSE_ERROR)
    if "id" not in data:
        raise validation("Not found id.")
    if data["id"] is None:
        raise validation("id must not be null.")
    user_id = checked_id(data["id"])
    if not await gateway.stop_infer(user_id):
        raise SwitchboardError(ErrorKind.NOT_FOUND, f"RequestId is {user_id} not found.")
    return Response(data, media_type="application/json")


# ---- management plane -------------------------------------------------------------------------


@get(model_paths("/ready"))
async def model_ready(request: Request, model: FromPath[str]) -> Response:
    gateway = served(request, model)
    gateway.refuse_stopped()
    ready = await gateway.is_ready()
    return Response(b"", status_code=200 if ready else 503)


@get(model_paths("/getSlotCount"))
async def slot_count(request: Request, model: FromPath[str]) -> Response:
    gateway = served(request, model)
    gateway.refuse_stopped()
    engine = gateway.engine_info()
    if engine is None:
        return mindie_error(ErrorKind.UNAVAILABLE, "the engine service is not answering")
    return Response(metadata.slot_count(gateway.cfg, engine))


ROUTES = [server_metadata, model_metadata, model_config, infer, generate, generate_stream, stop_infer]
MANAGEMENT_ROUTES = [model_ready, slot_count]
