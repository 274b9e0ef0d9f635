"""The object a cut-short JSON text begins: a forced tool call cut by max_tokens, as Anthropic returns it.

Anthropic's answer cut inside a ``tool_use`` ends with that block (its docs tell clients to retry with a higher
max_tokens); its stream has sent the input's JSON as far as it came, which the anthropic SDK reads with jiter's
partial mode: the complete members, an incomplete string or key left out, a number at the end kept. This reads
a whole answer's cut arguments the same way, so the body and the stream's final message agree.
"""

from __future__ import annotations

import json
from typing import Any

CLOSE = {"{": "}", "[": "]"}
NUMBER = set("-+.eE0123456789")


def partial_object(text: str) -> dict[str, Any] | None:
    """The object ``text`` begins, closed after its last complete value; None when it begins no object."""
    text = text.strip()
    if not text.startswith("{"):
        return None
    for candidate in (text, *_closed(text)):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def _closed(text: str) -> tuple[str, ...]:
    """``text`` cut after its last complete value (or opening bracket), with its open brackets closed; with a
    number at the end, first with it (``1.`` is no number: then without it)."""
    stack: list[str] = []
    key = [False]  # per open container: whether its next string is a key
    safe = (0, "")  # where the text can be cut, and the closers it then needs
    in_string = escaped = string_is_key = False
    number_start = -1
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if not string_is_key:
                    safe = (i + 1, _closers(stack))
            continue
        if number_start >= 0 and ch not in NUMBER:
            number_start = -1
            safe = (i, _closers(stack))
        if ch == '"':
            in_string, string_is_key = True, stack[-1:] == ["{"] and key[-1]
        elif ch in CLOSE:
            stack.append(ch)
            key.append(ch == "{")
            safe = (i + 1, _closers(stack))
        elif ch in "}]":
            stack.pop()
            key.pop()
            safe = (i + 1, _closers(stack))
        elif ch == ",":
            key[-1] = stack[-1:] == ["{"]
        elif ch == ":":
            key[-1] = False
        elif (ch == "-" or ch.isdigit()) and number_start < 0:
            number_start = i
        elif text.startswith(("true", "null", "false"), i):
            safe = (i + (5 if ch == "f" else 4), _closers(stack))
    cut, closers = safe
    if number_start >= 0:  # a number at the end is taken as it is (as jiter's partial mode takes it)
        return text + _closers(stack), text[:cut] + closers
    return (text[:cut] + closers,)


def _closers(stack: list[str]) -> str:
    return "".join(CLOSE[opener] for opener in reversed(stack))
