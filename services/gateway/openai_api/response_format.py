"""OpenAI ``response_format`` (chat and completions, reference §3.25): ``text`` (free), ``json_object`` (any
JSON object) or ``json_schema`` (``{"name", "schema", "strict", "description"}``), and TGI's ``json`` /
``json_object`` / ``regex`` with a ``value`` (its Messages API's), as a ``Grammar`` the engine
enforces token by token (``strict`` or not: the output always follows the schema; ``strict`` also closes every
object that does not say otherwise to undeclared keys, as OpenAI's strict mode and strict tools do). A schema
the grammar engine cannot compile is a 400 naming ``response_format`` before anything runs."""

from __future__ import annotations

import re
from typing import Any

from services.gateway.openai_api.errors import bad_param
from services.gateway.openai_api.tools import strict_schema
from shared.grammar import json_schema, problem
from shared.messages import Grammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}\Z")
ANY_OBJECT = {"type": "object"}


def response_format(value: Any) -> Grammar | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_param("response_format", "response_format must be an object.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind in ("json_object", "json", "regex") and value.get("value") is not None:
        return _tgi_grammar(kind, value["value"])
    if kind == "json_object":
        return json_schema(ANY_OBJECT)
    if kind != "json_schema":
        raise bad_param("response_format.type", "response_format.type must be one of text, json_object, "
                                                f"json_schema (or TGI's json and regex with a value), got {kind!r}.")
    return _json_schema(value.get("json_schema"))


def _tgi_grammar(kind: str, spec: Any) -> Grammar:
    """TGI's Messages API forms: ``{"type": "json" | "json_object", "value": <JSON Schema>}`` (huggingface_hub's
    InferenceClient sends a json_schema request so) and ``{"type": "regex", "value": "<regex>"}``."""
    where = "response_format.value"
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise bad_param(where, f"{where} must be a non-empty regex string.")
        grammar = Grammar("regex", spec)
    elif isinstance(spec, dict):
        grammar = json_schema(spec)
    else:
        raise bad_param(where, f"{where} must be a JSON Schema object.")
    grammar.field = where
    if (why := problem(grammar)) is not None:
        raise bad_param(where, f"{where} cannot be used for structured output: {why}")
    return grammar


def _json_schema(spec: Any) -> Grammar:
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_param(where, f"{where} must be an object with a name and a schema.")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_param(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, underscores or dashes.")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_param(f"{where}.strict", f"{where}.strict must be boolean type.")
    schema = spec.get("schema")
    if schema is None:
        schema = {}  # no schema: any JSON value
    if not isinstance(schema, dict):
        raise bad_param(f"{where}.schema", f"{where}.schema must be a JSON Schema object.")
    grammar = json_schema(strict_schema(schema) if spec.get("strict") else schema)
    grammar.field = f"{where}.schema"
    if (why := problem(grammar)) is not None:
        raise bad_param(f"{where}.schema", f"{where}.schema cannot be used for structured output: {why}")
    return grammar
