"""Typed reads of a JSON object with MindIE's rules (reference §2.4, §5).

A missing or null optional key takes its default; a wrong type is "<key> must be <type> type.";
an out-of-range value names the range and the value. Every failure is a 422 validation error.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

import msgspec

from shared.errors import validation

FLT_MAX = 3.4028234663852886e38
INT32_MAX = 2147483647
INT64_MIN = -(2**63)
UINT64_MAX = 18446744073709551615
MAX_INPUT_CHARS = 4 * 1024 * 1024  # longest text input, every family
MAX_JSON_DEPTH = 64  # the deepest valid body (a Triton row, a PD role's peers) nests under 10 levels

# A JSON string, or an unterminated one up to the end; possessive, so it never backtracks.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
_DEPTH_STEP[ord("[")] = _DEPTH_STEP[ord("{")] = 1
_DEPTH_STEP[ord("]")] = _DEPTH_STEP[ord("}")] = -1
_LONG_DIGITS = re.compile(rb"[0-9]{19,}")  # any integer outside 64 bits has at least 19 digits
_BAD_NUMBER = re.compile(rb"-?(?:NaN|Infinity)")
_AT_BYTE = re.compile(r"\(byte (\d+)\)")
# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or one of those not after a \uD800-\uDBFF
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"))  # their magic numbers


class BodyError(ValueError):
    """A request body that is not one usable JSON object; the message names the problem."""


class NumberError(BodyError):
    """Valid JSON with a number no 64-bit integer or float holds: a field's error (``param``, its path), not
    a parse error."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def parse_json_object(body: bytes, message: str) -> dict[str, Any]:
    """Decode a request body that must be a JSON object; ``message`` is the family's parse error.

    Every problem is a 422 validation error (400 on OpenAI routes) reading "<message> (<problem>)".
    """
    try:
        return read_json_object(body)
    except NumberError as exc:
        raise validation(str(exc), exc.param) from None
    except BodyError as exc:
        raise validation(f"{message} ({exc})") from None


UTF8_BOM = b"\xef\xbb\xbf"


def read_json_object(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body``, or :class:`BodyError`: the one JSON reader of every route.

    A UTF-8 byte order mark before it is skipped. Refused before decoding: an empty body, bytes that are not UTF-8, nesting deeper than
    MAX_JSON_DEPTH (counted without recursion, so the decoder never recurses that deep). Refused
    after: NaN/Infinity, numbers a 64-bit float or integer cannot hold, a top level that is not an object.
    """
    body = body.removeprefix(UTF8_BOM)  # as json.loads of bytes reads it (FastAPI, under vLLM, takes it)
    if not body.strip():
        raise BodyError("the request body is empty")
    _check_utf8(body)
    _check_depth(body)
    data = _decode(body)
    if not isinstance(data, dict):
        raise BodyError(f"the top level must be a JSON object, got {json_kind(data)}")
    _check_integers(body, data)
    return data


def json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _check_utf8(body: bytes) -> None:
    if body.isascii():
        return
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        for magic, name in _COMPRESSED:
            if body.startswith(magic):  # a client's Content-Encoding: only Triton's routes take one (tritonclient's)
                raise BodyError(f"the request body is {name}-compressed: this route takes JSON uncompressed "
                                "(Content-Encoding is taken on the Triton routes /v2/...)") from None
        raise BodyError(f"the request body is not valid UTF-8: byte {exc.start} is {body[exc.start]:#04x}") from None


def _check_depth(body: bytes) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH; brackets inside strings do not count."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if depth > MAX_JSON_DEPTH:
        raise BodyError(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")


def _decode(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.ValidationError as exc:  # msgspec's word for a number it cannot hold
        if str(exc).startswith("Integer"):
            raise BodyError("an integer is outside the 64-bit range") from None
        where = _infinite_number(body)
        raise NumberError(f"{where or 'a number'} is too large for a 64-bit float (like 1e400)", where) from None
    except msgspec.DecodeError as exc:
        raise BodyError(_decode_problem(body, str(exc))) from None
    except (RecursionError, UnicodeDecodeError) as exc:  # guarded against above; never a 500
        raise BodyError(f"the JSON could not be read: {exc}") from None


def _decode_problem(body: bytes, text: str) -> str:
    """msgspec's parse error, naming NaN and Infinity, which JSON does not allow, and a lone surrogate escape
    (msgspec calls that "Input data was truncated")."""
    lone = _LONE_SURROGATE.search(body) if "truncated" in text else None
    if lone is not None:
        return (f"{lone.group().decode()} at byte {lone.start()} is a lone UTF-16 surrogate: a JSON string's "
                "\\u escapes must make whole characters")
    at = _AT_BYTE.search(text)
    if at is not None:
        start = max(int(at.group(1)) - 1, 0)
        literal = _BAD_NUMBER.match(body, start) or _BAD_NUMBER.match(body, start + 1)
        if literal is not None:
            return f"{literal.group().decode()} is not a valid JSON number (byte {literal.start()})"
    return f"invalid JSON: {text}"


def _check_integers(body: bytes, data: dict[str, Any]) -> None:
    """Refuse integers outside [-2^63, 2^64-1], naming where; the tree is walked only when digits are long."""
    if _LONG_DIGITS.search(body) is None:
        return
    where = _first_path(data, lambda v: isinstance(v, int) and not INT64_MIN <= v <= UINT64_MAX)
    if where is not None:
        raise NumberError(f"{where} is an integer outside the 64-bit range", where)


def _infinite_number(body: bytes) -> str | None:
    """The path of the first number a 64-bit float cannot hold (the standard library reads it as inf)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _first_path(data, lambda v: isinstance(v, float) and math.isinf(v)) if isinstance(data, dict) else None


def _first_path(data: dict[str, Any], bad) -> str | None:
    """The path of the first value ``bad`` holds for, walked without recursion."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in data.items()]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif bad(value):
            return path
    return None


def text_input(value: Any, key: str) -> str:
    """A prompt that must be one string of 1..MAX_INPUT_CHARS characters (the list form is read by
    ``services.gateway.common.content``, which hands its joined text here)."""
    if not isinstance(value, str):
        raise validation(f"{key} must be string type.", key)
    if not 0 < len(value) <= MAX_INPUT_CHARS:
        raise validation(f"{key} must be 1 to {MAX_INPUT_CHARS} characters long, got {len(value)}.", key)
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
            raise validation(f"{self._name(key)} must be boolean type.", self._name(key))
        return value

    def number(self, key: str, default: float, lo: float, hi: float, lo_open: bool, hi_open: bool) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise validation(f"{self._name(key)} must be float type.", self._name(key))
        if not math.isfinite(value):  # (JSON has no NaN, but binary tensors and JSON-in-a-string do)
            raise validation(f"{self._name(key)} must be a finite number, got {value!r}.", self._name(key))
        self._check_range(key, value, lo, hi, lo_open, hi_open)
        return float(value)

    def integer(self, key: str, default: int | None, lo: int, hi: int, lo_open: bool = False) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        unsigned = lo >= 0
        if isinstance(value, bool) or not isinstance(value, int) or (unsigned and value < 0):
            raise validation(f"{self._name(key)} must be {'unsigned' if unsigned else 'integer'} type.",
                             self._name(key))
        self._check_range(key, value, lo, hi, lo_open, False)
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise validation(f"{self._name(key)} must be string type.", self._name(key))
        return value

    def obj(self, key: str) -> "Fields":
        value = self._get(key)
        if value is None:
            return Fields({}, self.where)
        if not isinstance(value, dict):
            raise validation(f"{self._name(key)} must be object type.", self._name(key))
        return Fields(value, self.where)

    def stop_list(self, key: str, max_items: int = 1024, max_len: int = 1024, max_total: int = 32768) -> list[str]:
        value = self._get(key)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise validation(f"{self._name(key)} must be string or array of strings type.", self._name(key))
        if len(items) > max_items:
            raise validation(f"{self._name(key)} must have at most {max_items} items, got {len(items)}.",
                             self._name(key))
        for s in items:
            if not 1 <= len(s) <= max_len:
                raise validation(f"each {self._name(key)} item must be 1 to {max_len} characters long, got {len(s)}.",
                                 self._name(key))
        if sum(len(s) for s in items) > max_total:
            raise validation(f"{self._name(key)} must have at most {max_total} characters in total.", self._name(key))
        return items

    def _check_range(self, key: str, value: float, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
        below = value <= lo if lo_open else value < lo
        above = value >= hi if hi_open else value > hi
        if below or above:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise validation(f"{self._name(key)} must be in {left}{_fmt(lo)}, {_fmt(hi)}{right}, got {_fmt(value)}.",
                             self._name(key))


def stream_flag(data: dict[str, Any]) -> bool:
    """The top-level ``stream`` of the MindIE-style bodies (TGI, native)."""
    value = data.get("stream")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise validation("Stream must be boolean type.", "stream")
    return value
