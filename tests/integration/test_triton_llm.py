"""Triton's LLM convention on /v2/models/{m}/infer (the vLLM and TensorRT-LLM backends; litellm's triton/
provider): a BYTES text_input tensor and scalar tensors in, a BYTES text_output tensor out, JSON or binary,
through the real tritonclient and raw HTTP on the tiny stack."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

PROMPT = "My name is Olivier and I"


def infer_path(stack) -> str:
    return f"{stack.url}/v2/models/{stack.model}/infer"


def post_infer(stack, body: dict) -> httpx.Response:
    return httpx.post(infer_path(stack), json=body, timeout=60)


def tensor(name: str, datatype: str, data: list) -> dict:
    return {"name": name, "shape": [len(data)], "datatype": datatype, "data": data}


def generated(stack, max_tokens: int = 8, **params) -> str:
    body = {"text_input": PROMPT, "parameters": {"top_k": 1, "max_new_tokens": max_tokens, **params}}
    r = httpx.post(f"{stack.url}/v2/models/{stack.model}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def test_litellms_infer_body_answers_a_text_output_tensor(tiny_stack):
    """Exactly what litellm's TritonInferConfig sends: text_input BYTES [1] and max_tokens INT32 [1]."""
    r = post_infer(tiny_stack, {"inputs": [tensor("text_input", "BYTES", [PROMPT]),
                                           tensor("max_tokens", "INT32", [8])]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == tiny_stack.model and isinstance(body["id"], str)
    (output,) = body["outputs"]
    assert output["name"] == "text_output" and output["datatype"] == "BYTES" and output["shape"] == [1]
    (text,) = output["data"]
    assert isinstance(text, str) and text  # litellm joins the data list into the message content


def test_tensors_set_the_sampling_as_generate_parameters_do(tiny_stack):
    expected = generated(tiny_stack)
    inputs = [tensor("text_input", "BYTES", [PROMPT]), tensor("max_tokens", "INT32", [8]),
              tensor("runtime_top_k", "INT32", [1]), tensor("return_num_input_tokens", "BOOL", [True]),
              tensor("return_num_output_tokens", "BOOL", [True]), tensor("return_finish_reason", "BOOL", [True])]
    body = post_infer(tiny_stack, {"id": "llm-1", "inputs": inputs}).json()
    out = {o["name"]: o["data"][0] for o in body["outputs"]}
    assert body["id"] == "llm-1" and out["text_output"] == expected
    assert out["num_output_tokens"] == 8 and out["finish_reason"] == "length" and out["num_input_tokens"] > 0
    vllm_style = post_infer(tiny_stack, {"inputs": [
        tensor("text_input", "BYTES", [PROMPT]),
        tensor("sampling_parameters", "BYTES", [json.dumps({"top_k": 1, "max_tokens": 8})]),
        tensor("exclude_input_in_output", "BOOL", [False])]}).json()
    assert vllm_style["outputs"][0]["data"] == [PROMPT + expected]
    seeded = [tensor("text_input", "BYTES", [PROMPT]), tensor("max_tokens", "INT32", [6]),
              tensor("temperature", "FP32", [0.9]), tensor("random_seed", "UINT64", [11])]
    assert post_infer(tiny_stack, {"inputs": seeded}).json()["outputs"][0]["data"] == \
        [generated(tiny_stack, 6, top_k=0, do_sample=True, temperature=0.9, seed=11)]


def test_a_temperature_of_zero_is_greedy_as_the_llm_backends_take_it(tiny_stack):
    """vLLM's and TensorRT-LLM's backends decode greedily at temperature 0 (MindIE's own parameters.temperature
    keeps its range (0, max])."""
    expected = generated(tiny_stack)
    for inputs in ([tensor("temperature", "FP32", [0.0])],
                   [tensor("sampling_parameters", "BYTES", [json.dumps({"temperature": 0, "seed": 3})])]):
        body = {"inputs": [tensor("text_input", "BYTES", [PROMPT]), tensor("max_tokens", "INT32", [8]), *inputs]}
        assert post_infer(tiny_stack, body).json()["outputs"][0]["data"] == [expected]


def test_generates_top_level_fields_are_the_llm_backends_inputs(tiny_stack):
    """Triton's generate extension: fields beside id and parameters are the model's inputs, as TensorRT-LLM's
    documented body sends them; they override parameters; a field no backend input names is a 422."""
    path = f"{tiny_stack.url}/v2/models/{tiny_stack.model}/generate"
    expected = generated(tiny_stack, 5)
    for body in ({"max_tokens": 5, "bad_words": "", "stop_words": "", "temperature": 0},
                 {"sampling_parameters": json.dumps({"max_tokens": 5, "temperature": 0}), "stream": False},
                 {"parameters": {"max_new_tokens": 50, "top_k": 1}, "max_tokens": 5, "bad_words": [""]},
                 {"parameters": {"max_tokens": 5, "bad_words": [""], "stop_words": [""], "temperature": 1e-9},
                  "stream": False},  # litellm's triton/ body
                 {"max_tokens": 5, "temperature": 0, "stop_words": None, "bad_words": None,
                  "sampling_parameters": None, "stream": None},  # null is the default (§2.4)
                 # the vLLM backend's own sample client: numbers as strings; its top_k -1 is "all tokens"
                 {"sampling_parameters": json.dumps({"temperature": "0", "max_tokens": "5", "top_k": -1})}):
        r = httpx.post(path, json={"text_input": PROMPT, **body}, timeout=60)
        assert r.status_code == 200 and r.json()["text_output"] == expected, (body, r.text)
    stop = expected.split()[1]
    for body in ({"max_tokens": 5, "temperature": 0, "stop_words": [stop]},
                 {"parameters": {"max_tokens": 5, "top_k": 1, "stop_words": [stop]}}):
        cut = httpx.post(path, json={"text_input": PROMPT, **body}, timeout=60).json()["text_output"]
        assert cut == expected[: expected.index(stop)], body
    for body, needle in (({"max_tokens": -1}, "max_tokens must"), ({"random_seed": -1}, "random_seed must"),
                         ({"beam_width": 2}, "beam_width"),
                         ({"stream": True}, "generate_stream"), ({"bad_words": "Paris"}, "bad_words"),
                         ({"exclude_input_in_output": False}, "exclude_input_in_output")):
        r = httpx.post(path, json={"text_input": PROMPT, **body}, timeout=60)
        assert r.status_code == 422 and needle in r.json()["error"], (body, r.text)


def test_tritonclient_binary_text_tensors(tiny_stack):
    c = triton.InferenceServerClient(url=tiny_stack.url.removeprefix("http://"))
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=True)
    limit = triton.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([8], dtype=np.int32), binary_data=True)
    top_k = triton.InferInput("top_k", [1], "INT32")
    top_k.set_data_from_numpy(np.array([1], dtype=np.int32), binary_data=False)
    count = triton.InferInput("return_num_output_tokens", [1], "BOOL")
    count.set_data_from_numpy(np.array([True]), binary_data=True)
    result = c.infer(tiny_stack.model, [text, limit, top_k, count], outputs=[
        triton.InferRequestedOutput("text_output", binary_data=True),
        triton.InferRequestedOutput("num_output_tokens", binary_data=False)])
    assert result.as_numpy("text_output")[0].decode() == generated(tiny_stack)
    assert result.as_numpy("num_output_tokens").tolist() == [8]
    assert result.get_response()["model_name"] == tiny_stack.model


@pytest.mark.parametrize("inputs, outputs, needle", [
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("end_id", "INT32", [2])], None, "end_id"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("stream", "BOOL", [True])], None, "generate_stream"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("bad_words", "BYTES", ["Paris"])], None, "bad_words"),
    ([tensor("text_input", "BYTES", [PROMPT, "again"])], None, "exactly one"),
    ([tensor("text_input", "INT32", [5])], None, "BYTES"),
    ([tensor("text_input", "STRING", [PROMPT])], None, "not a KServe v2 datatype"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("text_input", "BYTES", [PROMPT])], None, "twice"),
    ([{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": [PROMPT]}], None, "shape"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("temperature", "FP32", [-1.0])], None, "inputs.temperature"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("max_tokens", "FP32", [1.5])], None, "inputs.max_tokens must"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("sampling_parameters", "BYTES", ['{"top_p": 2}'])], None,
     "inputs.sampling_parameters.top_p must"),  # (errors name the field as it was sent)
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("sampling_parameters", "BYTES", ['{"best_of": 2}'])], None,
     "best_of"),
    ([tensor("text_input", "BYTES", [""])], None, "text_input"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("sampling_parameters", "BYTES", ['{"temperature": NaN}'])],
     None, "sampling_parameters"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("sampling_parameters", "BYTES", ['{"top_p": "x"}'])], None,
     "sampling_parameters.top_p"),
    ([tensor("text_input", "BYTES", [PROMPT]), tensor("temperature", "FP32", [None])], None, "null"),
    ([tensor("text_input", "BYTES", [PROMPT])], [{"name": "output0"}], "output0"),
])
def test_bad_text_tensors_are_422_naming_the_problem(tiny_stack, inputs, outputs, needle):
    body = {"inputs": inputs, **({"outputs": outputs} if outputs else {})}
    r = post_infer(tiny_stack, body)
    assert r.status_code == 422 and needle in r.json()["error"], r.text
    assert post_infer(tiny_stack, {"inputs": [tensor("text_input", "BYTES", [PROMPT]),
                                              tensor("max_tokens", "INT32", [2])]}).status_code == 200


def test_tritonclient_reports_a_bad_text_tensor(tiny_stack):
    c = triton.InferenceServerClient(url=tiny_stack.url.removeprefix("http://"))
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=object), binary_data=True)
    with pytest.raises(InferenceServerException) as err:
        c.infer(tiny_stack.model, [text])
    assert err.value.status() == "422" and "UTF-8" in err.value.message()


@pytest.mark.parametrize("name, datatype", [("temperature", np.float32), ("top_p", np.float64),
                                             ("repetition_penalty", np.float32)])
def test_a_nan_in_a_binary_tensor_is_a_422(tiny_stack, name, datatype):
    """JSON has no NaN, but a binary tensor does: it is refused before anything runs (it reached the engine and
    failed there, a 500)."""
    c = triton.InferenceServerClient(url=tiny_stack.url.removeprefix("http://"))
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=True)
    value = triton.InferInput(name, [1], "FP32" if datatype == np.float32 else "FP64")
    value.set_data_from_numpy(np.array([np.nan], dtype=datatype), binary_data=True)
    with pytest.raises(InferenceServerException) as err:
        c.infer(tiny_stack.model, [text, value])
    assert err.value.status() == "422" and "finite" in err.value.message()
