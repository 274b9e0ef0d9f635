"""``POST /v2/models/{m}/infer`` bodies (seed 004, reference §3.29): UINT32 token ids in, JSON or binary.

* ``inputs``: exactly one tensor with ``name`` (string, at most 256 characters), ``shape`` ``[n]`` or
  ``[1, n]`` with n in (0, 1048576], ``datatype`` ``"UINT32"`` only, and n ids either in ``data``
  (flat, or one nested row) or as ``parameters.binary_data_size`` bytes after the JSON header.
  Whether the ids lie in the vocabulary is checked by the tokenizer service.
* ``outputs``: when given, as many as inputs (one), each with a string ``name``; its
  ``parameters.binary_data`` picks a binary answer. Seed 004 marks ``outputs`` required, but
  tritonclient leaves it out when the caller names no outputs (sending ``binary_data_output``
  instead), so an absent ``outputs`` means "the one output, ``output0``".
* ``parameters``: as ``schemas.parse_options`` plus ``binary_data_output`` (KServe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.triton.binary import Tail, split_body, unpack_uint32
from services.gateway.triton.llm_infer import TextInferRequest, is_text_infer, parse_text_infer
from services.gateway.triton.schemas import PARSE_ERROR, Options, optional_id, parse_options
from services.gateway.web.validation import Fields, parse_json_object
from shared.errors import validation

MAX_TOKENS = 1048576
UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class InferRequest:
    user_id: str | None
    prompt_ids: list[int]
    binary_output: bool
    options: Options


def parse_infer(body: bytes, header_length: str | None) -> InferRequest | TextInferRequest:
    """MindIE's token ids, or Triton's LLM convention when the inputs include ``text_input`` (llm_infer.py)."""
    header, blob = split_body(body, header_length)
    data = parse_json_object(header, PARSE_ERROR)
    user_id = optional_id(data)
    tail = Tail(blob)
    if is_text_infer(data.get("inputs")):
        binary = Fields(data).obj("parameters").boolean("binary_data_output", False)
        return parse_text_infer(data, tail, user_id, binary)
    tensor = _single_input(data.get("inputs"))
    ids = _input_ids(tensor, tail)
    tail.check_consumed()
    params = Fields(data).obj("parameters")
    binary = _binary_output(data.get("outputs"), params.boolean("binary_data_output", False))
    return InferRequest(user_id, ids, binary, parse_options(params))


def _single_input(value: Any) -> Fields:
    if value is None:
        raise validation("Not found inputs: it is required and must be an array with one tensor.")
    if not isinstance(value, list):
        raise validation("inputs must be array type.")
    if len(value) != 1:
        raise validation(f"inputs must have exactly 1 item, got {len(value)}.")
    if not isinstance(value[0], dict):
        raise validation("inputs items must be object type.")
    return Fields(value[0], "inputs.")


def _input_ids(tensor: Fields, tail: Tail) -> list[int]:
    _required(tensor, "name")
    name = tensor.string("name")
    if len(name) > 256:
        raise validation(f"inputs.name must be at most 256 characters long, got {len(name)}.")
    _required(tensor, "datatype")
    datatype = tensor.string("datatype")
    if datatype != "UINT32":
        raise validation(f"Unsupported datatype, got {datatype}. inputs.datatype must be \"UINT32\".")
    count = _shape_length(tensor)
    size = tensor.obj("parameters").integer("binary_data_size", None, 0, 2**63 - 1)
    ids = unpack_uint32(tail.take(size)) if size is not None else _json_data(tensor)
    if len(ids) != count:
        raise validation(f"inputs.data has {len(ids)} ids but inputs.shape says {count}.")
    return ids


def _required(tensor: Fields, key: str) -> None:
    if key not in tensor.data:
        raise validation(f"Not found inputs.{key}.")
    if tensor.data[key] is None:
        raise validation(f"inputs.{key} must not be null.")


def _shape_length(tensor: Fields) -> int:
    _required(tensor, "shape")
    shape = tensor.data["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise validation("inputs.shape must be an array of integers.")
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != 1):
        raise validation(f"inputs.shape must be [n] or [1, n], got {shape}.")
    if not 0 < shape[-1] <= MAX_TOKENS:
        raise validation(f"inputs.shape's token count must be in (0, {MAX_TOKENS}], got {shape[-1]}.")
    return shape[-1]


def _json_data(tensor: Fields) -> list[int]:
    _required(tensor, "data")
    data = tensor.data["data"]
    if isinstance(data, list) and len(data) == 1 and isinstance(data[0], list):
        data = data[0]  # one nested row for shape [1, n]
    if not isinstance(data, list):
        raise validation("inputs.data must be array type.")
    for value in data:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32_MAX:
            raise validation(f"inputs.data must hold UINT32 token ids (integers in [0, {UINT32_MAX}]), got {value!r}.")
    return data


def _binary_output(outputs: Any, default: bool) -> bool:
    """Whether to answer with a binary tensor (KServe ``binary_data`` / ``binary_data_output``)."""
    if outputs is None:
        return default
    if not isinstance(outputs, list):
        raise validation("outputs must be array type.")
    if len(outputs) != 1:
        raise validation(f"outputs must have as many items as inputs (1), got {len(outputs)}.")
    if not isinstance(outputs[0], dict):
        raise validation("outputs items must be object type.")
    output = Fields(outputs[0], "outputs.")
    if output.string("name") is None:
        raise validation("Not found outputs.name: each output needs a string name.")
    return output.obj("parameters").boolean("binary_data", default)
