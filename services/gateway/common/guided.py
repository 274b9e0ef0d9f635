"""vLLM's guided decoding fields on its OpenAI routes and ``/generate``: the output held to a grammar, which the
engine's grammar engine (llguidance) enforces token by token, as ``response_format`` and TGI's ``grammar`` are.

* ``guided_json``: a JSON schema (an object, or its text); ``guided_regex``: a regular expression;
  ``guided_choice``: one of the given strings; ``guided_grammar``: a grammar in Lark's EBNF (what llguidance
  reads) or in GBNF (``root ::= ...``, as vLLM's docs write them), converted to Lark.
* ``structured_outputs`` (vLLM's newer form): ``{"json" | "regex" | "choice" | "grammar" | "json_object": …}``.

At most one of them. A grammar the engine cannot compile is a 4xx naming the field. Their backend hints
(``guided_decoding_backend``) name the implementation, not the output: taken and set aside. Anything that
would change the output in a way not honoured here (``guided_whitespace_pattern``) is refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from services.gateway.web.validation import Fields
from shared.errors import validation
from shared.grammar import json_schema, problem
from shared.messages import Grammar

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def guided(f: Fields) -> Grammar | None:
    """The grammar a body's guided decoding fields ask for, or None."""
    if f.data.get("guided_whitespace_pattern") is not None:
        raise validation("guided_whitespace_pattern is not supported: JSON output takes the grammar engine's "
                         "whitespace.", "guided_whitespace_pattern")
    backend = f.data.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise validation("guided_decoding_backend must be a string.", "guided_decoding_backend")
    given = [(name, f.data[name]) for name in GUIDED if f.data.get(name) is not None]
    given += _structured(f.data.get("structured_outputs"))
    if len(given) > 1:
        raise validation(f"give one way to guide the output, not {', '.join(name for name, _ in given)}.",
                         given[1][0])
    if not given:
        return None
    name, value = given[0]
    grammar = _grammar(name, value)
    grammar.field = name
    if (why := problem(grammar)) is not None:
        raise validation(f"{name} cannot constrain the output: {why}", name)
    return grammar


def _structured(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise validation("structured_outputs must be an object.", "structured_outputs")
    out = []
    for key, item in value.items():
        if item is None or item is False:
            continue
        if key == "json_object":
            out.append(("structured_outputs.json_object", {"type": "object"}))
        elif key in STRUCTURED:
            out.append((f"structured_outputs.{key}", item))
        else:
            raise validation(f"structured_outputs.{key} is not supported; it takes json, regex, choice, grammar "
                             "and json_object.", "structured_outputs")
    return out


def _grammar(name: str, value: Any) -> Grammar:
    kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind in ("json", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise validation(f"{name} must be a JSON schema (an object, or its JSON text).", name) from None
        if not isinstance(value, dict):
            raise validation(f"{name} must be a JSON schema (an object, or its JSON text).", name)
        return json_schema(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise validation(f"{name} must be a non-empty array of non-empty strings.", name)
        return Grammar("regex", "(" + "|".join(re.escape(c) for c in value) + ")")
    if not isinstance(value, str) or not value:
        raise validation(f"{name} must be a non-empty string.", name)
    if kind == "regex":
        return Grammar("regex", value)
    return Grammar("lark", _as_lark(name, value))


def _as_lark(name: str, text: str) -> str:
    """A grammar in Lark's EBNF as it is; one in GBNF (``root ::= ...``, the form vLLM's docs and xgrammar use)
    converted to Lark by llguidance's own converter."""
    try:
        return any_to_lark(text)
    except (GbnfToLarkError, ValueError) as exc:
        raise validation(f"{name} is neither a Lark nor a GBNF grammar: {exc}", name) from None
