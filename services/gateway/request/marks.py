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
