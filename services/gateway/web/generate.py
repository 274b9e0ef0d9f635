"""``POST /generate``: TGI's and vLLM's route of one name, told apart by the body (reference §3.23). It
sits beside the families, so neither imports the other; its errors before either takes over are TGI's."""

from __future__ import annotations

from litestar import Request, Response, Router, post

from services.gateway.request.marks import mark_api
from services.gateway.tgi import routes as tgi
from services.gateway.vllm import routes as vllm
from services.gateway.web.errors import TGI_EXCEPTION_HANDLERS
from services.gateway.web.validation import parse_json_object


@post("/generate", status_code=200)
async def generate(request: Request) -> Response:
    data = parse_json_object(await request.body(), tgi.GENERATE_PARSE_ERROR)
    if data.get("prompt") is not None:
        mark_api("vllm")
        return await vllm.generate(request, data)
    return await tgi.generate(request, data)


ROUTES = [Router("/", route_handlers=[generate], exception_handlers=TGI_EXCEPTION_HANDLERS)]
