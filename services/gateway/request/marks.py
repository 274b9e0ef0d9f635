"""Each HTTP request's ``Mark`` (a context variable its tasks share): whether a session of its call has said
``Received`` (from then on its end is counted with the request counters), and the ``api`` a route decided where
the path does not say it (POST /generate is TGI's or vLLM's). ``web/refusals.py`` counts the rest."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass
class Mark:
    received: bool = False
    api: str = ""
    late_status: int = 0  # a stream begun before its call started (keep-alives while queued) whose start failed


MARK: contextvars.ContextVar[Mark | None] = contextvars.ContextVar("switchboard_request_mark", default=None)


def mark_received() -> None:
    """A session of the current HTTP request emitted ``Received``."""
    mark = MARK.get()
    if mark is not None:
        mark.received = True


def mark_api(api: str) -> None:
    mark = MARK.get()
    if mark is not None:
        mark.api = api


def mark_failed_in_stream(status: int) -> None:
    """The call failed after its stream's 200 went out: the status its error would have had."""
    mark = MARK.get()
    if mark is not None and not mark.late_status:
        mark.late_status = status
