"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` (serving-anchors §3)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from services.gateway.request.disconnect import gone_mid_body
from shared.errors import STATUS, ErrorKind, SwitchboardError

log = logging.getLogger("switchboard.gateway")

# OpenAI clients and vLLM answer bad input with 400, not MindIE's 422.
OPENAI_STATUS = {**STATUS, ErrorKind.VALIDATION: 400}

TYPE_BY_STATUS = {
    400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
    413: "invalid_request_error", 424: "server_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable_error",
}
CODE_BY_KIND = {
    ErrorKind.NOT_FOUND: "not_found", ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.OVERLOADED: "model_overloaded", ErrorKind.GENERATION: "generation_error",
    ErrorKind.TIMEOUT: "timeout", ErrorKind.UNAVAILABLE: "service_unavailable",
}


class OpenAIError(SwitchboardError):
    """A SwitchboardError that also names the offending request field and an OpenAI ``code``."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None):
        super().__init__(kind, message, param)
        self.code = code


def bad_param(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(ErrorKind.VALIDATION, message, param)


def content_error(message: str, param: str | None) -> OpenAIError:
    """:func:`bad_param` in the argument order of ``services.gateway.common.content``'s ``Fail``."""
    return bad_param(param, message)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.NOT_FOUND, f"The model `{model}` does not exist.", "model", "model_not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def switchboard_body(exc: SwitchboardError) -> dict[str, Any]:
    """The body of an error, also sent as the last event of a stream that already started."""
    code = getattr(exc, "code", None) or CODE_BY_KIND.get(exc.kind)
    return error_body(OPENAI_STATUS[exc.kind], exc.message, exc.param, code)


def on_switchboard_error(_: Request, exc: SwitchboardError) -> Response:
    return Response(switchboard_body(exc), status_code=OPENAI_STATUS[exc.kind], media_type="application/json")


def on_http_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors on OpenAI routes: body too large, wrong method, bad path parameter."""
    if (left := gone_mid_body(exc)) is not None:
        return left
    status = exc.status_code
    message = str(exc.detail)
    code = None
    if status == 413:
        limit = request.app.state.gateway.cfg.server.max_request_length
        message, code = f"Request body too large. Maximum allowed size is {limit}MB.", "request_too_large"
    elif status == 405:
        message, code = f"Method {request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    return Response(error_body(status, message, None, code), status_code=status, headers=exc.headers,
                    media_type="application/json")


def on_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return Response(error_body(500, "Server internal error", None, None), status_code=500,
                    media_type="application/json")


OPENAI_EXCEPTION_HANDLERS = {SwitchboardError: on_switchboard_error, HTTPException: on_http_error,
                             Exception: on_unexpected}
