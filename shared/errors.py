"""One error taxonomy for every service and every API family.

Services raise or send :class:`ErrorInfo`; the gateway maps its ``kind`` to a status code and to
the error body of the family that was called (see ``services/gateway/web/errors.py``).
"""

from __future__ import annotations

import enum

import msgspec


class ErrorKind(str, enum.Enum):
    VALIDATION = "validation"  # bad input: 422 on MindIE/TGI families
    NOT_FOUND = "not_found"  # unknown model or route: 404
    TOO_LARGE = "too_large"  # body over maxRequestLength: 413
    OVERLOADED = "overloaded"  # no capacity: 429
    GENERATION = "generation"  # the request could not be built or enqueued: 424
    TIMEOUT = "timeout"  # a timeout ended the request: 500 "Incomplete Generation"
    INTERNAL = "internal"  # engine or service failure: 500
    UNAVAILABLE = "unavailable"  # not ready, stopping, or a service is down: 503


STATUS = {
    ErrorKind.VALIDATION: 422,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.GENERATION: 424,
    ErrorKind.TIMEOUT: 500,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNAVAILABLE: 503,
}

# MindIE's error_type names by kind (reference §4.2); TGI-family bodies use them too.
MINDIE_TYPE = {
    ErrorKind.VALIDATION: "Input Validation Error",
    ErrorKind.NOT_FOUND: "NotFoundError",
    ErrorKind.TOO_LARGE: "Bad Request",
    ErrorKind.OVERLOADED: "Model Overloaded",
    ErrorKind.GENERATION: "Generation Error",
    ErrorKind.TIMEOUT: "Incomplete Generation",
    ErrorKind.INTERNAL: "Incomplete Generation",
    ErrorKind.UNAVAILABLE: "Service Unavailable",
}


# TGI's error_type names (router/src/server.rs); its Python client maps errors by them.
TGI_TYPE = {
    ErrorKind.VALIDATION: "validation",
    ErrorKind.NOT_FOUND: "not_found",
    ErrorKind.TOO_LARGE: "validation",
    ErrorKind.OVERLOADED: "overloaded",
    ErrorKind.GENERATION: "generation",
    ErrorKind.TIMEOUT: "incomplete_generation",
    ErrorKind.INTERNAL: "incomplete_generation",
    ErrorKind.UNAVAILABLE: "unavailable",
}


class ErrorInfo(msgspec.Struct, frozen=True):
    """An error as it travels on the bus."""

    kind: ErrorKind
    message: str
    param: str | None = None  # the request field at fault, when one is (OpenAI's ``param``)

    @property
    def status(self) -> int:
        return STATUS[self.kind]


class SwitchboardError(Exception):
    """Raised inside a service; carries an :class:`ErrorInfo`."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.info = ErrorInfo(kind, message, param)

    @property
    def kind(self) -> ErrorKind:
        return self.info.kind

    @property
    def message(self) -> str:
        return self.info.message

    @property
    def param(self) -> str | None:
        return self.info.param


def validation(message: str, param: str | None = None) -> SwitchboardError:
    return SwitchboardError(ErrorKind.VALIDATION, message, param)
