"""Typed reads of a JSON object with MindIE's rules (reference §2.4, §5).

A missing or null optional key takes its default; a wrong type is "<key> must be <type> type.";
an out-of-range value names the range and the value. Every failure is a 422 validation error.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.errors import validation
from shared.messages import Sampling

FLT_MAX = 3.4028234663852886e38
INT32_MAX = 2147483647
UINT64_MAX = 18446744073709551615
MAX_INPUT_CHARS = 4 * 1024 * 1024  # longest text input, every family


def parse_json_object(body: bytes, message: str) -> dict[str, Any]:
    """Decode a request body that must be a JSON object; ``message`` is the family's parse error."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise validation(message) from None
    if not isinstance(data, dict):
        raise validation(message)
    return data


def text_input(value: Any, key: str) -> str:
    """A prompt that must be one string of 1..MAX_INPUT_CHARS characters (a list is the multimodal form)."""
    if isinstance(value, list):
        raise validation(f"{key} as a multimodal list is not supported: the served model is text-only.")
    if not isinstance(value, str):
        raise validation(f"{key} must be string type.")
    if not 0 < len(value) <= MAX_INPUT_CHARS:
        raise validation(f"{key} must be 1 to {MAX_INPUT_CHARS} characters long, got {len(value)}.")
    return value


def _fmt(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


class Fields:
    """Reads and checks the fields of one JSON object; ``where`` prefixes key names in messages."""

    def __init__(self, data: dict[str, Any], where: str = ""):
        self.data = data
        self.where = where

    def _get(self, key: str) -> Any:
        return self.data.get(key)

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise validation(f"{self._name(key)} must be boolean type.")
        return value

    def number(self, key: str, default: float, lo: float, hi: float, lo_open: bool, hi_open: bool) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise validation(f"{self._name(key)} must be float type.")
        self._check_range(key, value, lo, hi, lo_open, hi_open)
        return float(value)

    def integer(self, key: str, default: int | None, lo: int, hi: int, lo_open: bool = False) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        unsigned = lo >= 0
        if isinstance(value, bool) or not isinstance(value, int) or (unsigned and value < 0):
            raise validation(f"{self._name(key)} must be {'unsigned' if unsigned else 'integer'} type.")
        self._check_range(key, value, lo, hi, lo_open, False)
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise validation(f"{self._name(key)} must be string type.")
        return value

    def obj(self, key: str) -> "Fields":
        value = self._get(key)
        if value is None:
            return Fields({}, self.where)
        if not isinstance(value, dict):
            raise validation(f"{self._name(key)} must be object type.")
        return Fields(value, self.where)

    def stop_list(self, key: str, max_items: int = 1024, max_len: int = 1024, max_total: int = 32768) -> list[str]:
        value = self._get(key)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise validation(f"{self._name(key)} must be string or array of strings type.")
        if len(items) > max_items:
            raise validation(f"{self._name(key)} must have at most {max_items} items, got {len(items)}.")
        for s in items:
            if not 1 <= len(s) <= max_len:
                raise validation(f"each {self._name(key)} item must be 1 to {max_len} characters long, got {len(s)}.")
        if sum(len(s) for s in items) > max_total:
            raise validation(f"{self._name(key)} must have at most {max_total} characters in total.")
        return items

    def _check_range(self, key: str, value: float, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
        below = value <= lo if lo_open else value < lo
        above = value >= hi if hi_open else value > hi
        if below or above:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise validation(f"{self._name(key)} must be in {left}{_fmt(lo)}, {_fmt(hi)}{right}, got {_fmt(value)}.")


def stream_flag(data: dict[str, Any]) -> bool:
    """The top-level ``stream`` of the MindIE-style bodies (TGI, native)."""
    value = data.get("stream")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise validation("Stream must be boolean type.")
    return value


def mindie_sampling(p: Fields) -> Sampling:
    """The ``parameters`` object TGI and the native API share (seed 003, reference §3.22, §3.27)."""
    p.boolean("watermark", False)
    return Sampling(
        do_sample=p.boolean("do_sample"),
        temperature=p.number("temperature", 1.0, 0.0, FLT_MAX, lo_open=True, hi_open=False),
        top_k=p.integer("top_k", 0, 0, INT32_MAX, lo_open=True),
        top_p=p.number("top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=True),
        typical_p=p.number("typical_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=p.number("repetition_penalty", 1.0, 0.0, FLT_MAX, lo_open=True, hi_open=False),
        seed=p.integer("seed", None, 0, UINT64_MAX),
        max_new_tokens=p.integer("max_new_tokens", 20, 0, INT32_MAX, lo_open=True),
        stop=p.stop_list("stop"),
    )
