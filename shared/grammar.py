"""Structured output's grammars, one reading for every family (OpenAI ``response_format``, TGI ``grammar``):
a ``Grammar`` (``json_schema``, ``regex`` or ``lark``) as llguidance's grammar text, and its check.

llguidance is the grammar engine (see docs/benchmarks.md, "Grammar engines": on this tokenizer it builds a
JSON-schema matcher in about 1 ms and a next-token mask in about 20 µs, with no further dependency). The
gateway checks a request's grammar here before anything runs, so a schema or regex the engine could not
compile is the client's 4xx; the engine builds the same grammar with the model's tokenizer
(``services/engine/grammar.py``).
"""

from __future__ import annotations

import json

import llguidance

from shared.messages import Grammar

KINDS = ("json_schema", "regex", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no whitespace between tokens


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for ``grammar``; ValueError when it cannot be read."""
    if grammar.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(grammar.value, defaults=JSON_OPTIONS)
    if grammar.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(grammar.value)
    if grammar.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(grammar.value)
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


def problem(grammar: Grammar) -> str | None:
    """Why the grammar cannot be compiled, or None when it can."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(grammar))
    except (ValueError, TypeError) as exc:
        return str(exc)
    return messages[0].replace(ONE_OF_HINT, ONE_OF_INSTEAD) if is_error else None


# llguidance's hint names an option of its own that no API here exposes
ONE_OF_HINT = "Enable 'coerce_one_of' option to approximate oneOf with anyOf"
ONE_OF_INSTEAD = "Use anyOf instead (OpenAI's strict mode takes anyOf, not oneOf)"


def json_schema(schema: object, field: str = "") -> Grammar:
    """A JSON-schema grammar from a schema object (or JSON text); ``field``: the request field it came from."""
    return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema), field)
