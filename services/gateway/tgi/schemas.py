"""TGI request bodies (seed 003, reference §3.22-§3.24) → the one internal request."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.common.content import ListInput, mindie_input
from services.gateway.common.sampling import TGI, mindie_sampling
from services.gateway.common.served import Served
from services.gateway.web.validation import INT32_MAX, Fields, parse_json_object, stream_flag, text_input
from shared.errors import validation
from shared.grammar import json_schema, problem
from shared.messages import Grammar, Sampling

PARSE_ERROR = "Failed to parse context to json body"
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
ADAPTER_ID = re.compile(r"^[a-zA-Z0-9_./-]{1,256}\Z")


@dataclass(frozen=True)
class TgiRequest:
    inputs: str
    sampling: Sampling
    truncate: int
    stream: bool
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    top_n_tokens: int  # 0: none
    adapter: str = ""  # the LoRA adapter (parameters.adapter_id); "" = the base model
    listed: ListInput | None = None  # ``inputs`` in the list form (``inputs`` is then its joined text)

    @property
    def wants_details(self) -> bool:
        return self.details or self.decoder_input_details


def parse_tgi(body: bytes | dict[str, Any], served: Served, stream: bool | None = None) -> TgiRequest:
    """Validate a TGI body; ``served`` says which adapter_id values run; ``stream`` forces streaming on or
    off (``/generate``, ``/generate_stream``)."""
    data = body if isinstance(body, dict) else parse_json_object(body, PARSE_ERROR)
    top = Fields(data)
    inputs, listed = _inputs(data.get("inputs"))
    params = top.obj("parameters")
    streaming = stream_flag(data) if stream is None else stream  # /generate and /generate_stream ignore ``stream``
    decoder_details = params.boolean("decoder_input_details", False)
    top_n = params.integer("top_n_tokens", 0, 0, MAX_TOP_N_TOKENS)
    if streaming and decoder_details:
        raise validation("The decoder_input_details must not be true when stream is true.")
    return TgiRequest(
        inputs=inputs,
        sampling=sampling_from(params, top_n),
        truncate=params.integer("truncate", 0, 0, INT32_MAX, lo_open=True),
        stream=streaming,
        details=params.boolean("details", False),
        decoder_input_details=decoder_details,
        return_full_text=params.boolean("return_full_text", False),
        top_n_tokens=top_n,
        adapter=_adapter(params.string("adapter_id"), served),
        listed=listed,
    )


def _inputs(value: Any) -> tuple[str, ListInput | None]:
    """A string, or seed 003's list of text and media items (its joined text)."""
    if value is None:
        raise validation("inputs must be necessary and its data type must be string or array.")
    return mindie_input(value, "inputs", lambda text: text_input(text, "inputs"))


def sampling_from(p: Fields, top_n_tokens: int = 0) -> Sampling:
    """Every token carries its logprob, as in TGI (``details.tokens``, stream events); ``top_n_tokens`` adds each
    step's most likely tokens."""
    _check_best_of(p)
    sampling = mindie_sampling(p, TGI, logprobs=top_n_tokens)
    if sampling.do_sample is False:  # TGI samples when any warper is set, do_sample or not (its client sends false)
        sampling = msgspec.structs.replace(sampling, do_sample=None)
    grammar = tgi_grammar(p.data.get("grammar"))
    return sampling if grammar is None else msgspec.structs.replace(sampling, grammar=grammar)


def tgi_grammar(value: Any) -> Grammar | None:
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": <JSON schema, object or text>}``,
    ``{"type": "regex", "value": "<regex>"}`` or ``{"type": "json_schema", "value": {"schema": ...}}``; 422 when it
    is malformed or cannot be compiled."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("json", "regex", "json_schema"):
        raise validation('grammar must be {"type": "json" | "regex" | "json_schema", "value": ...}.', "grammar")
    kind, spec = value["type"], value.get("value")
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise validation("grammar.value must be a non-empty regex string.", "grammar")
        grammar = Grammar("regex", spec)
    else:
        if kind == "json_schema":
            spec = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(spec, (dict, str)):
            raise validation("grammar.value must be a JSON schema (an object, or its JSON text).", "grammar")
        grammar = json_schema(spec)
    grammar.field = "grammar"
    if (why := problem(grammar)) is not None:
        raise validation(f"grammar cannot be compiled: {why}", "grammar")
    return grammar


def _check_best_of(p: Fields) -> None:
    best_of = p.integer("best_of", 1, 0, 128, lo_open=True)
    if best_of != 1:
        raise validation(f"best_of must be 1 on this endpoint, got {best_of}.")


def _adapter(adapter_id: str | None, served: Served) -> str:
    """The LoRA adapter named by adapter_id ("None", absent or the model's name: the base model)."""
    if adapter_id is None or adapter_id == "None":
        return ""
    if not ADAPTER_ID.match(adapter_id):
        raise validation("The format of adapter_id is invalid.", "adapter_id")
    adapter = served.adapter(adapter_id, "adapter_id")
    if adapter is None:
        raise validation(f"adapter_id {adapter_id!r} is not a loaded LoRA adapter.", "adapter_id")
    return adapter
