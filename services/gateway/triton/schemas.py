"""Triton request parts shared by ``infer`` and ``generate``: the ``id`` and ``parameters`` (reference §3.29, §3.31).

Sampling ranges are MindIE's dialect for Triton (``sampling.TRITON``: top_k [0, 2^31-1], top_p (0, 1],
seed (0, 2^64-1], ``max_tokens`` standing in for an absent ``max_new_tokens``); besides them
priority [1, 5] (default 5), timeout (0, 3600] seconds (default 600, reference §6 #3), batch_size
(0, 2^31-1]. ``timeout`` is MindIE's, in seconds, not KServe's microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.gateway.common.content import ListInput, mindie_input
from services.gateway.common.sampling import TRITON, mindie_sampling, refuse_tgi_only
from services.gateway.triton.llm_inputs import as_sent, generate_inputs
from services.gateway.web.validation import INT32_MAX, Fields, parse_json_object, text_input
from shared.errors import validation
from shared.messages import Sampling

PARSE_ERROR = "Failed to parse context to json body."
ID_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,256}\Z")
ID_ERROR = ("The id can contain only digits, letters, underscores(_), hyphens(-) "
            "and no more than 256 characters in length.")
DEFAULT_PRIORITY = 5
DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class Options:
    """The validated ``parameters`` of a Triton request."""

    sampling: Sampling
    priority: int
    timeout_s: float
    details: bool
    perf_stat: bool


@dataclass(frozen=True)
class TextRequest:
    """``/generate`` and ``/generate_stream``."""

    user_id: str | None
    text: str
    options: Options
    listed: ListInput | None = None  # ``text_input`` in the list form (``text`` is then its joined text)


def optional_id(data: dict[str, Any]) -> str | None:
    """The optional request ``id``; absent or null means the server's own id."""
    value = data.get("id")
    if value is None:
        return None
    return checked_id(value)


def checked_id(value: Any) -> str:
    if not isinstance(value, str):
        raise validation("id must be string type.")
    if not ID_PATTERN.match(value):
        raise validation(ID_ERROR)
    return value


def parse_options(p: Fields) -> Options:
    p.integer("batch_size", 1, 0, INT32_MAX, lo_open=True)
    refuse_tgi_only(p, "Triton's routes do not take it")
    sampling = mindie_sampling(p, TRITON)
    return Options(
        sampling=sampling,
        priority=p.integer("priority", DEFAULT_PRIORITY, 1, 5),
        timeout_s=float(p.integer("timeout", DEFAULT_TIMEOUT_S, 0, 3600, lo_open=True)),
        details=p.boolean("details", False),
        perf_stat=p.boolean("perf_stat", False),
    )


def parse_text_request(body: bytes, streaming: bool) -> TextRequest:
    """``parameters``, overridden by the top-level inputs of Triton's LLM backends (``llm_inputs.py``)."""
    data = parse_json_object(body, PARSE_ERROR)
    user_id = optional_id(data)
    text, listed = _text_input(data.get("text_input"))
    sent: dict[str, str] = {}
    params = generate_inputs(data, Fields(data).obj("parameters").data, streaming, sent)
    options = as_sent(lambda: parse_options(Fields(params, "parameters.")), sent, "parameters.")
    return TextRequest(user_id, text, options, listed)


def _text_input(value: Any) -> tuple[str, ListInput | None]:
    """A string, or the list form of text and media items (reference §3.31: its joined text)."""
    if value is None:
        raise validation("The text_input not found: it is required and must be a string or an array.")
    return mindie_input(value, "text_input", lambda text: text_input(text, "text_input"),
                        empty="Parameter text_input arr is empty")
