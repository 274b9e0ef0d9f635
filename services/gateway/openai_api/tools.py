"""OpenAI tools on chat completions (reference §3.25): ``tools``, ``tool_choice``, ``parallel_tool_calls``, and
``tool_calls`` in the answer, whole or streamed.

* ``required`` and a named function are guaranteed by the grammar engine: the model's output is JSON that
  the grammar keeps valid — for a named function its arguments (the function's ``parameters`` schema), for
  ``required`` an array of ``{"name": <a declared function>, "arguments": <its parameters>}`` (one call
  unless ``parallel_tool_calls``). A stream sends each call's id and name first, then its arguments as
  they are generated.
* ``auto`` parses the model's own format, which the tokenizer service reads off the chat template
  (``Started.tool_format``), as vLLM's ``--tool-call-parser`` names them: ``hermes`` —
  ``<tool_call>{"name": …, "arguments": …}</tool_call>`` blocks (Qwen2.5, Hermes, SmolLM3, and the format
  the tokenizer describes to a model whose template has no tool support), the rest of the text being
  content; ``mistral`` — ``[TOOL_CALLS]`` then a JSON array of calls; ``llama3_json`` — an answer that is a
  JSON call ``{"name": …, "parameters": …}`` (after an optional ``<|python_tag|>``; several joined by ``;``).
  A stream sends content until a call may begin; Hermes calls go out as each block closes, the others at
  the end (their answer is all calls or all content).
* ``none``: the tools are shown to the model, and its text is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_api.errors import bad_param
from shared.grammar import json_schema, problem
from shared.messages import Grammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}\Z")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Tools:
    functions: dict[str, dict[str, Any]]  # name -> {"name", "description", "parameters"}
    choice: str  # none | auto | required | named
    named: str = ""
    parallel: bool = True
    strict: frozenset[str] = frozenset()  # functions declared ``strict``: their arguments take no undeclared key

    @property
    def declared(self) -> list[dict[str, Any]]:
        """The tools as the chat template takes them (OpenAI's objects)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def arguments(self, name: str) -> dict[str, Any]:
        """The schema a call of ``name``'s arguments is held to."""
        parameters = self.functions[name]["parameters"]
        return strict_schema(parameters) if name in self.strict else parameters

    def allowed(self, calls: list[Any]) -> list[Any]:
        """The calls an answer may make: without parallel_tool_calls, its first only."""
        return calls if self.parallel else calls[:1]

    def grammar(self) -> Grammar | None:
        if self.choice == "named":
            return json_schema(self.arguments(self.named), "tools")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": self.arguments(name)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name in self.functions]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return json_schema(schema, "tools")


def parse_tools(data: dict[str, Any]) -> Tools | None:
    """None when the request declares no tools (a ``tool_choice`` other than none is then a 400)."""
    raw, choice = data.get("tools"), data.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_param("tool_choice", "tool_choice needs tools.")
        return None
    if not isinstance(raw, list):
        raise bad_param("tools", "tools must be an array of function tools.")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(raw):
        name, function = _function(tool, i)
        if name in functions:
            raise bad_param(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is declared twice: "
                                                          "tool names must be unique.")
        functions[name] = function
    parallel = data.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "parallel_tool_calls must be boolean type.")
    strict = frozenset(t["function"]["name"] for t in raw if t["function"].get("strict") is True)
    tools = Tools(functions, *_choice(choice, functions), parallel=parallel, strict=strict)
    grammar = tools.grammar()
    if grammar is not None and (why := problem(grammar)) is not None:
        raise bad_param("tools", f"the tools' parameters cannot be used to constrain the output: {why}")
    return tools


def strict_schema(schema: Any) -> Any:
    """``schema`` with every object that does not say otherwise closed to undeclared keys (OpenAI's ``strict``)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_schema(value) if key in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else value
           for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in schema[key].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(schema["additionalProperties"])
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _function(tool: Any, i: int) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_param(where, f'{where} must be {{"type": "function", "function": {{...}}}}.')
    spec = tool["function"]
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_param(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ or -.")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_param(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON Schema object.")
    if "type" not in parameters:
        parameters = {"type": "object", **parameters}
    out = {"name": name, "parameters": parameters}
    if isinstance(spec.get("description"), str):
        out["description"] = spec["description"]
    return name, out


def _choice(choice: Any, functions: dict[str, dict]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return choice, ""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_param("tool_choice", f"tool_choice names function {name!r}, which is not in tools.")
        return "named", name
    if isinstance(choice, str) and choice in functions:  # TGI's: a declared function's name (its client's str)
        return "named", choice
    raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required", {"type": "function", '
                                   '"function": {"name": ...}} or a declared function\'s name (TGI\'s form).')


# ---- the answer --------------------------------------------------------------------------------


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def first_delta(index: int, name: str, arguments: str = "") -> dict[str, Any]:
    """A stream's first delta of call ``index``: its id and name (and the arguments, when whole)."""
    return {"index": index, **tool_call(name, arguments)}


def extract(tools: Tools, text: str, fmt: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer. A forced call (``required``, a named function) is never
    content: cut short (by max_tokens or a stop sequence), its calls as far as they came, the last one's
    arguments partial (what OpenAI returns, with finish_reason "length"), exactly as a stream sends them.
    With ``auto`` an answer that does not parse stays content. ``fmt``: the model's tool-call format."""
    if tools.choice == "named":
        return None, [tool_call(tools.named, text)]
    if tools.choice == "required":  # the arguments' text as generated, as a stream sends it
        return None, partial_calls(text)
    if tools.choice == "auto" and fmt == "hermes":
        calls = [c for c in map(_hermes, BLOCK.findall(text)) if c is not None and c[0] in tools.functions]
        if calls:
            content = BLOCK.sub("", text).strip()
            return content or None, [tool_call(name, args) for name, args in tools.allowed(calls)]
    elif tools.choice == "auto" and (calls := _whole_answer_calls(text, fmt, tools)):
        return None, [tool_call(name, args) for name, args in tools.allowed(calls)]
    return text, []


CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')  # a call up to its arguments


def partial_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a ``required`` answer cut short (``[{"name": …, "arguments": …}, …`` unfinished), read as a
    stream reads them (``_ArrayScan``): each whose name is complete, its arguments' text as far as it came."""
    calls: list[dict[str, Any]] = []
    for delta in _ArrayScan().feed(text):
        if "id" in delta:
            calls.append(tool_call(delta["function"]["name"], ""))
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


MISTRAL, PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"


def _whole_answer_calls(text: str, fmt: str, tools: Tools) -> list[tuple[str, str]]:
    """Mistral's and Llama 3's formats: the whole answer is calls (or it is content: [])."""
    body = text.strip()
    if fmt == "mistral" and body.startswith(MISTRAL):
        parsed = _loads(body[len(MISTRAL):].strip())
        found = parsed if isinstance(parsed, list) else []
    elif fmt == "llama3_json" and body.startswith(("{", PYTHON_TAG)):
        found = [_loads(part) for part in body.removeprefix(PYTHON_TAG).split(";")]
    else:
        return []
    calls = [_hermes_obj(c) for c in found]
    if not calls or any(c is None or c[0] not in tools.functions for c in calls):
        return []
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes(block: str) -> tuple[str, str] | None:
    return _hermes_obj(_loads(block))


def _hermes_obj(call: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object (its arguments under "arguments" or "parameters")."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# ---- streaming ---------------------------------------------------------------------------------


@dataclass
class ToolStream:
    """One choice's stream: turns text deltas into (content delta, tool-call deltas)."""

    tools: Tools
    fmt: str = "hermes"  # the model's tool-call format, for auto
    text: str = ""  # everything generated so far
    sent: int = 0  # auto: content characters sent; named/required: characters scanned
    calls: int = 0  # tool calls begun
    scan: "_ArrayScan" = field(default_factory=lambda: _ArrayScan())

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.tools.choice == "named":
            return self._named(delta)
        if self.tools.choice == "required":
            out = self.scan.feed(delta)
            self.calls += sum("id" in d for d in out)
            return "", out
        if self.tools.choice == "auto" and self.fmt == "hermes":
            return self._auto(final)
        if self.tools.choice == "auto":
            return self._whole(final)
        return delta, []

    def _whole(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Mistral's and Llama 3's formats: content streams unless the answer may be calls; then it is held
        to the end and read whole."""
        marker = MISTRAL if self.fmt == "mistral" else "{"
        head = self.text.lstrip()
        maybe_calls = head.startswith(marker) or marker.startswith(head) or (
            self.fmt == "llama3_json" and (head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)))
        if not final and maybe_calls:
            return "", []
        if final and maybe_calls and (calls := self.tools.allowed(_whole_answer_calls(self.text, self.fmt, self.tools))):
            self.calls = len(calls)
            self.sent = len(self.text)
            return "", [first_delta(i, n, a) for i, (n, a) in enumerate(calls)]
        content, self.sent = self.text[self.sent:], len(self.text)
        return content, []

    def _named(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        out = []
        if self.calls == 0:
            self.calls = 1
            out.append(first_delta(0, self.tools.named))
        if delta:
            out.append({"index": 0, "function": {"arguments": delta}})
        return "", out

    def _auto(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content up to a tool-call block (holding back what may begin one), each block as one call."""
        content, out = "", []
        while True:
            rest = self.text[self.sent:]
            start = rest.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(rest, OPEN)
                content += rest[:len(rest) - keep]
                self.sent += len(rest) - keep
                return content, out
            content += rest[:start]
            end = rest.find(CLOSE, start)
            if end < 0:
                self.sent += start
                if final:  # an unfinished block is text
                    content += rest[start:]
                    self.sent = len(self.text)
                return content, out
            call = _hermes(rest[start + len(OPEN):end].strip())
            if call is not None and call[0] in self.tools.functions:
                if self.tools.parallel or not self.calls:  # without parallel_tool_calls, later calls are dropped
                    out.append(first_delta(self.calls, *call))
                    self.calls += 1
            else:
                content += rest[start:end + len(CLOSE)]
            self.sent += end + len(CLOSE)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _ArrayScan:
    """``required``'s JSON array of ``{"name": …, "arguments": {…}}`` read character by character: a call's id
    and name once its name is complete, then its arguments as they come."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    call: str = ""  # the current call object's text so far
    in_arguments: bool = False
    index: int = -1

    def feed(self, delta: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        arguments = ""
        for ch in delta:
            before = self.depth
            self._track(ch)
            if before == 1 and ch == "{":  # a call begins
                self.index, self.call, self.in_arguments = self.index + 1, "", False
            if self.depth >= 2 or before >= 2:
                self.call += ch
            if self.in_arguments and (before >= 3 or (before == 2 and ch == "{")):
                arguments += ch
            elif self.index >= 0 and not self.in_arguments and before == 2:
                match = CALL_HEAD.match(self.call)
                if match:
                    self.in_arguments = True
                    out.append(first_delta(self.index, match.group(1)))
            if before == 2 and self.depth == 1 and arguments:  # the call closed: flush its arguments
                out.append({"index": self.index, "function": {"arguments": arguments}})
                arguments = ""
        if arguments:
            out.append({"index": self.index, "function": {"arguments": arguments}})
        return out

    def _track(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
