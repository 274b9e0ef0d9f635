"""vLLM's ``POST /generate`` (a ``prompt`` body; the TGI router hands it over, reference §3.23).

Errors keep MindIE's ``{"error", "error_type"}`` body, the shape MindIE's vLLM entrance sends.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from services.gateway.common.content import admit
from services.gateway.request import lifecycle
from services.gateway.vllm.responses import build_call, collect, error_chunk, stream_chunks
from services.gateway.vllm.schemas import parse_vllm
from services.gateway.web import off_loop
from services.gateway.web.errors import mindie_error
from shared.errors import SwitchboardError


async def generate(request: Request, data: dict[str, Any]) -> Response:
    try:
        return await _generate(request, data)
    except SwitchboardError as exc:
        return mindie_error(exc.kind, exc.message)


async def _generate(request: Request, data: dict[str, Any]) -> Response:
    gateway = request.app.state.gateway
    schedule = gateway.cfg.schedule
    req = await off_loop.read(request, parse_vllm, data, gateway.served(), schedule.max_iter_times,
                              min(schedule.max_n, schedule.max_batch_size, schedule.prefill_batch_size))
    admit([req.listed], gateway.media_policy, modalities=gateway.modalities())
    call = build_call(gateway.context, req)
    full_text_mode = gateway.cfg.server.full_text_enabled
    return await lifecycle.respond(request, call, req.stream, lambda: collect(call, req),
                                   lambda: stream_chunks(call, full_text_mode), error_chunk,
                                   media_type="application/json", keep_alive=b"\0")  # an empty chunk
