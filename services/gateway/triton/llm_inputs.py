"""The inputs of Triton's LLM backends (vLLM's, TensorRT-LLM's) in the Triton ``parameters``' words, for the two
routes that take them: ``/infer``'s text tensors (``llm_infer.py``) and ``/generate``'s top-level fields (Triton's
generate extension: a body's fields other than ``id`` and ``parameters`` are the model's inputs, as
TensorRT-LLM's documented ``{"text_input": …, "max_tokens": 20, "bad_words": "", "stop_words": ""}`` sends them).

* ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_k`` / ``runtime_top_k``, ``top_p`` /
  ``runtime_top_p``, ``seed`` / ``random_seed``, ``repetition_penalty``: the Triton parameter of the same meaning,
  checked with its range; a ``temperature`` of 0 is greedy decoding, as those backends take it (MindIE's own
  ``parameters.temperature`` stays in (0, max]).
* ``stop_words``: stop strings (empty strings are no stop); ``bad_words`` may only be empty.
* ``sampling_parameters``: the vLLM backend's JSON object of the same keys (and ``stop``). Its numbers may be
  strings, as the backend reads them with ``float()`` / ``int()`` (its own sample client sends
  ``{"temperature": "0.1", "max_tokens": "100"}``), and ``top_k`` -1 (or 0) is vLLM's "all tokens".
"""

from __future__ import annotations

import json
from typing import Any, Callable

from shared.errors import SwitchboardError, validation

ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
           "top_k": "top_k", "runtime_top_k": "top_k", "top_p": "top_p", "runtime_top_p": "top_p", "seed": "seed",
           "random_seed": "seed", "repetition_penalty": "repetition_penalty"}


def aliased(params: dict[str, Any], name: str, value: Any, sent: dict[str, str] | None = None,
            sent_as: str = "") -> None:
    """Input ``name`` (one of ``ALIASES``) into ``params`` under its parameter's name; temperature 0 is greedy.
    ``sent``: each parameter's name as the request gave it (``sent_as``, else ``name``), for its errors."""
    if ALIASES[name] == "temperature" and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and value == 0:
        params.pop("temperature", None)
        params["do_sample"] = False
        return
    params[ALIASES[name]] = value
    if sent is not None:
        sent[ALIASES[name]] = sent_as or name


def as_sent(parse: Callable[[], Any], sent: dict[str, str], where: str) -> Any:
    """``parse()``, its validation error naming the field as the request sent it (``max_tokens``, not the
    ``parameters.max_new_tokens`` it was read as)."""
    try:
        return parse()
    except SwitchboardError as exc:
        name = (exc.param or "").removeprefix(where)
        if not exc.param or not exc.param.startswith(where) or name not in sent:
            raise
        raise validation(exc.message.replace(exc.param, sent[name]), sent[name]) from None


def _param(where: str, name: str) -> str:
    """The error's param: the tensors' ``inputs`` (``where`` "inputs."), else the body's field ``name``."""
    return where.rstrip(".") or name


def words(stop: list[str], bad: list[str], where: str) -> dict[str, Any]:
    """``stop_words`` as ``stop``; ``bad_words`` only empty (TensorRT-LLM's clients send [""] or "")."""
    if any(bad):
        raise validation(f"{where}bad_words is not supported (got {[w for w in bad if w][:3]!r}); send it empty or "
                         "leave it out.", _param(where, "bad_words"))
    stops = [w for w in stop if w]
    return {"stop": stops} if stops else {}


def sampling_parameters(text: str | dict[str, Any], where: str, sent: dict[str, str] | None = None) -> dict[str, Any]:
    """The vLLM backend's JSON object of sampling keys (as text, or already an object), in the Triton
    parameters' names (``sent``: as ``aliased``)."""
    data = text
    if isinstance(text, str):
        try:
            data = json.loads(text, parse_constant=_not_json)
        except ValueError:  # (JSONDecodeError, and NaN / Infinity, which JSON does not have)
            data = None
    if not isinstance(data, dict):
        raise validation(f"{where}sampling_parameters must be a JSON object.", _param(where, "sampling_parameters"))
    params: dict[str, Any] = {}
    for key, value in data.items():
        if key == "stop":
            params["stop"] = value
        elif key in ALIASES:
            value = _backend_number(key, value, where)
            if not (ALIASES[key] == "top_k" and value in (-1, 0)):  # (vLLM's "all tokens": no top_k)
                aliased(params, key, value, sent, f"{where}sampling_parameters.{key}")
        else:
            raise validation(f"{where}sampling_parameters.{key} is not supported; it takes stop, "
                             f"{', '.join(sorted(ALIASES))}.", _param(where, "sampling_parameters"))
    return params


INTEGER_KEYS = {"max_new_tokens", "top_k", "seed"}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _backend_number(key: str, value: Any, where: str) -> Any:
    """A number given as a string, as the vLLM backend reads it (``int()`` for counts, ``float()`` else)."""
    if not isinstance(value, str):
        return value
    kind = int if ALIASES[key] in INTEGER_KEYS else float
    try:
        return kind(value.strip())
    except ValueError:
        raise validation(f"{where}sampling_parameters.{key} must be {'an integer' if kind is int else 'a number'}"
                         f" (or a string of one), got {value!r}.", _param(where, "sampling_parameters")) from None


GENERATE_TAKES = sorted({"id", "parameters", "text_input", "stop_words", "bad_words", "sampling_parameters", "stream",
                         "exclude_input_in_output", *ALIASES})


def generate_inputs(data: dict[str, Any], parameters: dict[str, Any], streaming: bool,
                    sent: dict[str, str] | None = None) -> dict[str, Any]:
    """``/generate``'s ``parameters`` with the body's top-level inputs besides ``id`` and ``text_input`` over
    them. ``stream`` must say what the route does; ``exclude_input_in_output`` may only be true (the answer is
    the generated text). Any other field is refused with the list of the ones taken. ``stop_words`` and
    ``bad_words`` count among the parameters too (litellm's ``triton/`` client sends them there)."""
    params = dict(parameters)
    stop = _strings("parameters.stop_words", params.pop("stop_words", None))
    bad = _strings("parameters.bad_words", params.pop("bad_words", None))
    for name, value in data.items():
        if name in ("id", "parameters", "text_input") or (value is None and name in GENERATE_TAKES):
            continue  # (null is the default, §2.4)
        if name in ALIASES:
            aliased(params, name, value, sent)
        elif name in ("stop_words", "bad_words"):
            (stop if name == "stop_words" else bad).extend(_strings(name, value))
        elif name == "sampling_parameters":
            params.update(sampling_parameters(value, "", sent))
        elif name == "stream":
            if value is not streaming:
                raise validation(f"stream must be {str(streaming).lower()} on this route (or left out): "
                                 f"{'/generate_stream' if value else '/generate'} is the one that "
                                 f"{'streams' if value else 'answers whole'}.", "stream")
        elif name == "exclude_input_in_output":
            if value is not True:
                raise validation("exclude_input_in_output may only be true here: the answer is the generated text.",
                                 "exclude_input_in_output")
        else:
            raise validation(f"the body has a field named {name!r}, which this model does not take; it takes "
                             f"{', '.join(GENERATE_TAKES)}.", name)
    params.update(words(stop, bad, ""))
    return params


def _strings(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in values):
        raise validation(f"{name} must be a string or an array of strings.", name)
    return values
