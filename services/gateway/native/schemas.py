"""MindIE-native request bodies (reference §3.27 ``/infer``, §3.28 ``/infer_token``, §3.32 ``/v1/tokenizer``).

``/infer`` and ``/infer_token`` share one handler, as in MindIE: either URL takes text ``inputs`` or
token ids ``input_id``, never both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.common.content import ListInput, mindie_input
from services.gateway.common.sampling import NATIVE, mindie_sampling, refuse_tgi_only
from services.gateway.web.validation import MAX_INPUT_CHARS, Fields, parse_json_object, stream_flag
from shared.errors import validation
from shared.messages import Sampling

PARSE_ERROR = "Failed to parse context to json body"
MAX_TOKEN_ID = 1024 * 1024
MAX_TOKENS_NUM = 1048576


@dataclass(frozen=True)
class NativeRequest:
    text: str | None
    ids: list[int] | None
    sampling: Sampling
    stream: bool
    details: bool
    priority: int
    timeout_s: float
    listed: ListInput | None = None  # ``inputs`` in the list form (``text`` is then its joined text)


def parse_infer(body: bytes) -> NativeRequest:
    data = parse_json_object(body, PARSE_ERROR)
    text, ids, listed = _input(data)
    params = Fields(data).obj("parameters")
    refuse_tgi_only(params, "/infer and /infer_token do not take it")
    return NativeRequest(
        text=text, ids=ids, sampling=mindie_sampling(params, NATIVE), stream=stream_flag(data),
        details=params.boolean("details", False),
        priority=_priority(params),
        timeout_s=float(params.integer("timeout", 600, 0, 3600, lo_open=True)),
        listed=listed,
    )


def _input(data: dict[str, Any]) -> tuple[str | None, list[int] | None, ListInput | None]:
    """(text, ids, list form): ``inputs`` as a string or a list of items, or ``input_id``."""
    has_text, has_ids = data.get("inputs") is not None, "input_id" in data
    if has_text and has_ids:
        raise validation("Input conflict.")
    if has_ids:
        return None, _token_ids(data["input_id"]), None
    if "inputs" not in data:
        raise validation("Not found inputs.")
    text, listed = mindie_input(data["inputs"], "inputs", _text)
    return text, None, listed


def _text(value: Any) -> str:
    if value is None:
        raise validation("Inputs must not be null")
    if not isinstance(value, str):
        raise validation("The type of inputs is abnormal")
    if not 0 < len(value) <= MAX_INPUT_CHARS:
        raise validation(f"Inputs must be necessary and data type must be string and length in (0, {MAX_INPUT_CHARS}], "
                         f"but the length of inputs is {len(value)}")
    return value


def _token_ids(value: Any) -> list[int]:
    if value is None:
        raise validation("Input_id should not be empty")
    if not isinstance(value, list):
        raise validation("Parameter input_id must be an array")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise validation("Parameter input_id must be integer")
    if any(not 0 <= i <= MAX_TOKEN_ID for i in value):
        raise validation("Data element in param input_id is invalid")
    if not 0 < len(value) <= MAX_TOKENS_NUM:
        raise validation(f"Inputs token length must be in (0, {MAX_TOKENS_NUM}], but got {len(value)}")
    return value


def _priority(p: Fields) -> int:
    value = p.data.get("priority")
    if value is None:
        return 5
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise validation("priority must be unsigned type.")
    if not 1 <= value <= 5:
        raise validation(f"Parameter priority must be in [1,5], got {value}.")
    return value


# ---- /v1/tokenizer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeRequest:
    text: str
    do_decode: bool


def parse_tokenize(body: bytes, max_request_mb: int) -> TokenizeRequest:
    data = parse_json_object(body, "Req body converts to json fail.")
    text = data.get("inputs")
    if not isinstance(text, str):
        raise validation("Inputs in request body is invalid.")
    limit = min(MAX_INPUT_CHARS, max_request_mb * 1024 * 1024)
    if not 0 < len(text) <= limit:
        raise validation(f"Inputs data length in (0, {limit}], but the length of inputs is {len(text)}")
    do_decode = data.get("do_decode")
    return TokenizeRequest(text, do_decode if isinstance(do_decode, bool) else True)
