"""vLLM's ``POST /generate`` (a ``prompt`` body; the TGI router hands it over, reference §3.23).

Errors keep MindIE's ``{"error", "error_type"}`` body, the shape MindIE's vLLM entrance sends.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from services.gateway.errors import mindie_error
from services.gateway.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.respond import event_stream
from services.gateway.vllm.responses import close_all, collect, sessions_for, start_all, stream_chunks
from services.gateway.vllm.schemas import parse_vllm
from shared.errors import SwitchboardError


async def generate(request: Request, data: dict[str, Any]) -> Response:
    try:
        return await _generate(request, data)
    except SwitchboardError as exc:
        return mindie_error(exc.kind, exc.message)


async def _generate(request: Request, data: dict[str, Any]) -> Response:
    gateway = request.app.state.gateway
    schedule = gateway.cfg.schedule
    req = parse_vllm(data, gateway.model, schedule.max_iter_times,
                     min(schedule.max_n, schedule.max_batch_size, schedule.prefill_batch_size))
    sessions = sessions_for(gateway, req, req.n if req.stream else req.best_of)
    await unless_disconnected(request, start_all(sessions))
    if req.stream:
        return event_stream(stream_chunks(sessions, gateway.cfg.server.full_text_enabled), media_type="application/json")
    try:
        body = await unless_disconnected(request, collect(sessions, req))
    except ClientDisconnected:
        return Response(b"", status_code=499)
    finally:
        await close_all(sessions)
    return Response(body, media_type="application/json")
