"""TGI's ``POST /tokenize`` (``{"inputs": ..., "parameters": {"truncate": n}, "add_special_tokens": true}``): each
token's id, its text and its [start, stop) character offsets in ``inputs``, as TGI answers; errors in TGI's
shape. ``/tokenize`` tells this body from vLLM's by ``inputs`` (as ``/generate`` does)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from services.gateway.web.errors import on_tgi_error
from services.gateway.web.validation import INT32_MAX, Fields, text_input
from shared.errors import SwitchboardError
from shared.messages import Tokenize


def is_tgi(data: dict[str, Any]) -> bool:
    return data.get("inputs") is not None and data.get("prompt") is None and data.get("messages") is None


async def tgi_tokenize(request: Request, data: dict[str, Any]) -> Response:
    try:
        return Response(await _tokens(request.app.state.gateway, data), media_type="application/json")
    except SwitchboardError as exc:
        return on_tgi_error(request, exc)


async def _tokens(gateway, data: dict[str, Any]) -> list[dict[str, Any]]:
    inputs = text_input(data["inputs"], "inputs")
    f = Fields(data)
    special = bool(f.boolean("add_special_tokens", True))
    truncate = f.obj("parameters").integer("truncate", 0, 0, INT32_MAX, lo_open=True) or 0
    result = await gateway.tokenize(Tokenize(text=inputs, add_special_tokens=special, offsets=True))
    tokens = [{"id": i, "text": inputs[start:stop], "start": start, "stop": stop}
              for i, (start, stop) in zip(result.ids, result.offsets)]
    return tokens[-truncate:] if truncate else tokens
