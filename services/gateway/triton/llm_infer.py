"""Triton's LLM convention on ``POST /v2/models/{m}/infer``: text in, text out.

Triton's vLLM and TensorRT-LLM backends take a BYTES ``text_input`` tensor and optional scalar tensors, and
answer a BYTES ``text_output`` tensor; litellm's ``triton/`` provider and tritonclient users send exactly
that (JSON, or KServe binary tensors). A body whose inputs include ``text_input`` is read here; any other
body is MindIE's token-id inference (``tensors.py``).

Inputs (each one element unless said):
* ``text_input`` BYTES (required): the prompt.
* ``max_tokens``, ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``seed``, ``repetition_penalty`` and their
  aliases, ``stop_words`` BYTES (any count), ``bad_words`` (only empty), ``sampling_parameters`` BYTES (the vLLM
  backend's JSON object): the Triton parameters of the same meaning (``llm_inputs.py``), checked with their
  ranges (``schemas.parse_options``).
* ``exclude_input_in_output`` BOOL (default true here, so litellm's chat text is the answer alone;
  false prepends the prompt, as the vLLM backend does by default).
* ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens`` BOOL: add the
  ``finish_reason`` (BYTES: ``stop`` / ``length``), ``num_input_tokens`` and ``num_output_tokens`` (UINT32) outputs.
* ``stream`` BOOL: only false; a stream is ``/generate_stream``.
Any other input name is refused with the list of the ones taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.triton.binary import Tail, unpack_tensor
from services.gateway.triton.llm_inputs import ALIASES, aliased, as_sent, sampling_parameters, words
from services.gateway.triton.schemas import Options, parse_options
from services.gateway.web.validation import Fields, text_input
from shared.errors import validation

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
FLAGS = {"stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens"}
EXTRA_OUTPUTS = {"finish_reason": "return_finish_reason", "num_input_tokens": "return_num_input_tokens",
                 "num_output_tokens": "return_num_output_tokens"}
TAKEN = sorted({TEXT_INPUT, "stop_words", "bad_words", "sampling_parameters", *ALIASES, *FLAGS})


@dataclass(frozen=True)
class TextInferRequest:
    user_id: str | None
    text: str
    options: Options
    include_prompt: bool
    outputs: list[tuple[str, bool]]  # (output name, binary), in answer order


def is_text_infer(inputs: Any) -> bool:
    return isinstance(inputs, list) and any(isinstance(t, dict) and t.get("name") == TEXT_INPUT for t in inputs)


def parse_text_infer(data: dict[str, Any], tail: Tail, user_id: str | None, binary: bool) -> TextInferRequest:
    tensors = _tensors(data["inputs"], tail)
    tail.check_consumed()
    text = _text(tensors.pop(TEXT_INPUT))
    flags = {name: _flag(name, tensors.pop(name)) for name in FLAGS if name in tensors}
    if flags.get("stream"):
        raise validation("stream is not supported on /infer (it answers whole); use "
                         "/v2/models/{model}/generate_stream for a stream.", "stream")
    params, sent = dict(Fields(data).obj("parameters").data), {}
    if "sampling_parameters" in tensors:
        given = _string("sampling_parameters", _one("sampling_parameters", tensors.pop("sampling_parameters")))
        params.update(sampling_parameters(given, "inputs.", sent))
    params.update(words([_string("stop_words", v) for v in tensors.pop("stop_words", [])],
                        [_string("bad_words", v) for v in tensors.pop("bad_words", [])], "inputs."))
    for name, values in tensors.items():
        if name not in ALIASES:
            raise validation(f"inputs has a tensor named {name!r}, which this model does not take; it takes "
                             f"{', '.join(TAKEN)}.", "inputs")
        aliased(params, name, _scalar(name, values), sent, f"inputs.{name}")
    options = as_sent(lambda: parse_options(Fields(params, "inputs.")), sent, "inputs.")
    return TextInferRequest(user_id, text, options, include_prompt=flags.get("exclude_input_in_output") is False,
                            outputs=_outputs(data.get("outputs"), flags, binary))


KSERVE_DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                    "FP64", "BF16", "BYTES")


def _tensors(inputs: list, tail: Tail) -> dict[str, list]:
    tensors: dict[str, list] = {}
    for item in inputs:
        if not isinstance(item, dict):
            raise validation("inputs items must be object type.", "inputs")
        tensor = Fields(item, "inputs.")
        name, datatype = tensor.string("name"), tensor.string("datatype")
        if name is None or datatype is None:
            raise validation("each inputs item needs a string name and datatype.", "inputs")
        if datatype not in KSERVE_DATATYPES:
            raise validation(f"inputs.{name}.datatype {datatype!r} is not a KServe v2 datatype "
                             f"({', '.join(KSERVE_DATATYPES)}).", "inputs")
        if name in tensors:
            raise validation(f"inputs names {name!r} twice.", "inputs")
        size = tensor.obj("parameters").integer("binary_data_size", None, 0, 2**63 - 1)
        values = unpack_tensor(datatype, tail.take(size)) if size is not None else _json_values(item)
        _check_shape(name, item.get("shape"), len(values))
        tensors[name] = values
    return tensors


def _json_values(item: dict[str, Any]) -> list:
    data = item.get("data")
    if not isinstance(data, list):
        raise validation(f"inputs.{item['name']}.data must be array type.", "inputs")
    flat: list = []
    for value in data:
        flat.extend(value if isinstance(value, list) else [value])
    return flat


def _check_shape(name: str, shape: Any, count: int) -> None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise validation(f"inputs.{name}.shape must be an array of non-negative integers.", "inputs")
    elements = 1
    for dim in shape:
        elements *= dim
    if elements != count:
        raise validation(f"inputs.{name} has {count} elements but its shape {shape} says {elements}.", "inputs")


def _one(name: str, values: list) -> Any:
    if len(values) != 1:
        raise validation(f"inputs.{name} must hold exactly one element, got {len(values)}.", "inputs")
    return values[0]


def _string(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise validation(f"inputs.{name} is not valid UTF-8 text.", "inputs") from None
    if not isinstance(value, str):
        raise validation(f"inputs.{name} must hold BYTES (text), got {value!r}.", "inputs")
    return value


def _text(values: list) -> str:
    return text_input(_string(TEXT_INPUT, _one(TEXT_INPUT, values)), "inputs.text_input")


def _flag(name: str, values: list) -> bool:
    value = _one(name, values)
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        value = bool(value)  # BOOL sent as an integer tensor
    if not isinstance(value, bool):
        raise validation(f"inputs.{name} must hold one BOOL, got {value!r}.", "inputs")
    return value


def _scalar(name: str, values: list) -> Any:
    value = _one(name, values)
    if isinstance(value, bytes):
        raise validation(f"inputs.{name} must be a number tensor, not BYTES.", "inputs")
    if value is None:  # (a JSON tensor's null element: not "use the default", which is leaving the tensor out)
        raise validation(f"inputs.{name} must hold a number, got null.", "inputs")
    return value


def _outputs(requested: Any, flags: dict[str, bool], binary: bool) -> list[tuple[str, bool]]:
    """The outputs named in ``outputs`` (each possibly binary), else text_output and those the flags ask for."""
    available = [TEXT_OUTPUT] + [name for name, flag in EXTRA_OUTPUTS.items() if flags.get(flag)]
    if requested is None:
        return [(name, binary) for name in available]
    if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
        raise validation("outputs must be an array of objects.", "outputs")
    chosen = []
    for item in requested:
        output = Fields(item, "outputs.")
        name = output.string("name")
        if name not in available:
            raise validation(f"outputs names {name!r}; this request has {', '.join(available)}.", "outputs")
        chosen.append((name, bool(output.obj("parameters").boolean("binary_data", binary))))
    return chosen
