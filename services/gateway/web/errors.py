"""The error taxonomy shaped into each family's body (MindIE/TGI shape here; the others' in their packages)."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from services.gateway.anthropic import errors as anthropic_errors
from services.gateway.openai_api import errors as openai_errors
from services.gateway.request.disconnect import ClientDisconnected, gone, gone_mid_body
from shared.errors import MINDIE_TYPE, STATUS, TGI_TYPE, ErrorKind, SwitchboardError

log = logging.getLogger("switchboard.gateway")


def mindie_body(kind: ErrorKind, message: str) -> dict[str, str]:
    return {"error": message, "error_type": MINDIE_TYPE[kind]}


def mindie_error(kind: ErrorKind, message: str) -> Response:
    return Response(mindie_body(kind, message), status_code=STATUS[kind], media_type="application/json")


def tgi_body(kind: ErrorKind, message: str) -> dict[str, str]:
    return {"error": message, "error_type": TGI_TYPE[kind]}


def on_switchboard_error(_: Request, exc: SwitchboardError) -> Response:
    return mindie_error(exc.kind, exc.message)


def on_tgi_error(_: Request, exc: SwitchboardError) -> Response:
    return Response(tgi_body(exc.kind, exc.message), status_code=STATUS[exc.kind], media_type="application/json")


MINDIE_V1 = ("/v1/tokenizer", "/v1/config", "/v1/status", "/v1/role/")  # MindIE's own /v1 routes: its shape


def family_of(path: str) -> str:
    """Whose error shape a path's client reads: "anthropic" (/v1/messages), "openai" (/v1/, but MindIE's own
    routes there), else "mindie"."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai" if path.startswith("/v1/") and not path.startswith(MINDIE_V1) else "mindie"


def shaped_body(path: str, status: int, message: str, mindie_type: str) -> dict:
    """An error body in the shape of ``path``'s family (for answers made below the routes: the connection cap, a
    body that never came)."""
    family = family_of(path)
    if family == "anthropic":
        return anthropic_errors.error_body(status, message)
    if family == "openai":
        return openai_errors.error_body(status, message)
    return {"error": message, "error_type": mindie_type}


def on_http_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors outside a family's router (no route for the path, or for the method): OpenAI's shape
    under /v1/ (Anthropic's under /v1/messages), as the client of that prefix reads it; else MindIE's."""
    if (left := gone_mid_body(exc)) is not None:
        return left
    path = request.url.path
    if family_of(path) == "anthropic":
        return anthropic_errors.on_http_error(request, exc)
    if family_of(path) == "openai":
        if exc.status_code == 404:  # OpenAI's words for a route it does not have
            body = openai_errors.error_body(404, f"Invalid URL ({request.method} {path})")
            return Response(body, status_code=404, media_type="application/json")
        return openai_errors.on_http_error(request, exc)
    if exc.status_code == 413:
        limit = request.app.state.gateway.cfg.server.max_request_length
        return Response({"message": f"Request body too large. Maximum allowed size is {limit}MB."}, status_code=413)
    return Response({"error": exc.detail, "error_type": _type_for(exc.status_code)}, status_code=exc.status_code,
                    headers=exc.headers)


def on_client_gone(_: Request, exc: ClientDisconnected) -> Response:
    """The client left before its request started: nobody reads this answer, nothing went wrong."""
    return gone()


def on_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return mindie_error(ErrorKind.INTERNAL, "Server internal error")


def _type_for(status: int) -> str:
    for kind, code in STATUS.items():
        if code == status:
            return MINDIE_TYPE[kind]
    return "Bad Request"


TGI_EXCEPTION_HANDLERS = {SwitchboardError: on_tgi_error}
EXCEPTION_HANDLERS = {SwitchboardError: on_switchboard_error, HTTPException: on_http_error,
                      ClientDisconnected: on_client_gone, Exception: on_unexpected}
