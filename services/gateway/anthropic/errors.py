"""Anthropic's error shape ``{"type": "error", "error": {"type", "message"}}`` and its status codes: 400
invalid_request_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error (with retry-after),
500 api_error, 529 overloaded_error (no engine or tokenizer serving; the SDK retries it)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from services.gateway.request.disconnect import gone_mid_body
from shared.errors import ErrorKind, SwitchboardError

log = logging.getLogger("switchboard.gateway")

STATUS = {
    ErrorKind.VALIDATION: 400, ErrorKind.NOT_FOUND: 404, ErrorKind.TOO_LARGE: 413, ErrorKind.OVERLOADED: 429,
    ErrorKind.GENERATION: 500, ErrorKind.TIMEOUT: 500, ErrorKind.INTERNAL: 500, ErrorKind.UNAVAILABLE: 529,
}
TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                  429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
RETRY_AFTER_S = "1"


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def invalid(message: str) -> SwitchboardError:
    return SwitchboardError(ErrorKind.VALIDATION, message)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    if status in (429, 529):
        headers = {**(headers or {}), "retry-after": RETRY_AFTER_S}
    return Response(error_body(status, message), status_code=status, headers=headers, media_type="application/json")


def on_switchboard_error(_: Request, exc: SwitchboardError) -> Response:
    message = f"{exc.param}: {exc.message}" if exc.param and not exc.message.startswith(exc.param) else exc.message
    return error_response(STATUS[exc.kind], message)


def on_http_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors here: body too large, wrong method."""
    if (left := gone_mid_body(exc)) is not None:
        return left
    status, message = exc.status_code, str(exc.detail)
    if status == 413:
        limit = request.app.state.gateway.cfg.server.max_request_length
        message = f"Request body too large. Maximum allowed size is {limit}MB."
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    return error_response(status, message, dict(exc.headers or {}))


def on_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "Internal server error")


ANTHROPIC_EXCEPTION_HANDLERS = {SwitchboardError: on_switchboard_error, HTTPException: on_http_error,
                                Exception: on_unexpected}
