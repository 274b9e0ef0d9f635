"""Every validation rule of seed 004 / reference §3.29-§3.31: bad input gets 422 in MindIE's shape, then
a good request still succeeds (tiny random model); plus the default model's greedy ids (smol)."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from tests.integration.test_triton_api import (PROMPT, PROMPT_IDS, assert_serving, infer_body, model_path,
                                               post, sse_blocks)
from tests.media_items import PNG_URL

BAD_PARAMETERS = [
    {"temperature": 0}, {"temperature": -1.0}, {"temperature": "1"}, {"top_k": -1}, {"top_k": 2147483648},
    {"top_k": 1.5}, {"top_p": 0}, {"top_p": 1.01}, {"top_p": "0.5"}, {"typical_p": 0}, {"typical_p": 1.5},
    {"do_sample": "true"}, {"do_sample": 1}, {"seed": -1}, {"seed": 0}, {"seed": 1.5}, {"seed": 18446744073709551616},
    {"repetition_penalty": 0}, {"repetition_penalty": -2}, {"max_new_tokens": 0}, {"max_new_tokens": -1},
    {"max_new_tokens": 2147483648}, {"max_new_tokens": 2.5}, {"watermark": "no"}, {"details": 1},
    {"perf_stat": "yes"}, {"batch_size": 0}, {"batch_size": 2147483648}, {"priority": 0}, {"priority": 6},
    {"priority": -1}, {"priority": 2.5}, {"timeout": 0}, {"timeout": 3601}, {"timeout": -5}, {"timeout": 1.5},
]


def assert_422(r: httpx.Response, fragment: str = "") -> None:
    assert r.status_code == 422, r.text
    body = r.json()
    assert list(body) == ["error", "error_type"] and body["error_type"] == "Input Validation Error"
    assert fragment in body["error"], body["error"]


@pytest.mark.parametrize("parameters", BAD_PARAMETERS, ids=lambda p: json.dumps(p)[:40])
def test_bad_parameters_get_422_on_every_route(tiny_stack, parameters):
    assert_422(post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body(parameters=parameters)),
               next(iter(parameters)))
    for route in ("/generate", "/generate_stream"):
        r = post(tiny_stack, model_path(tiny_stack, route), {"text_input": PROMPT, "parameters": parameters})
        assert_422(r, next(iter(parameters)))
    assert_serving(tiny_stack)


def test_boundary_parameters_are_accepted(tiny_stack):
    edge = {"top_k": 0, "top_p": 1.0, "typical_p": 1.0, "priority": 1, "timeout": 3600, "seed": 1,
            "temperature": 1, "batch_size": 2147483647, "max_new_tokens": 2}
    assert post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body(parameters=edge)).status_code == 200
    r = post(tiny_stack, model_path(tiny_stack, "/generate"), {"text_input": PROMPT, "parameters": edge})
    assert r.status_code == 200, r.text


def tensor(**changes) -> dict:
    base = {"name": "input0", "shape": [1, len(PROMPT_IDS)], "datatype": "UINT32", "data": PROMPT_IDS}
    return {k: v for k, v in {**base, **changes}.items() if v != "<drop>"}


BAD_INFER_BODIES = [
    (b"{not json", "Failed to parse"),
    (b"[1]", "Failed to parse"),
    ({"id": "bad id!", **{k: v for k, v in infer_body().items() if k != "id"}}, "The id can contain only"),
    ({**infer_body(), "id": "x" * 257}, "The id can contain only"),
    ({**infer_body(), "id": ""}, "The id can contain only"),
    ({**infer_body(), "id": 42}, "id must be string type."),
    ({k: v for k, v in infer_body().items() if k != "inputs"}, "inputs"),
    ({**infer_body(), "inputs": {}}, "inputs must be array type."),
    ({**infer_body(), "inputs": []}, "exactly 1"),
    ({**infer_body(), "inputs": [tensor(), tensor()]}, "exactly 1"),
    ({**infer_body(), "inputs": ["x"]}, "object"),
    ({**infer_body(), "inputs": [tensor(name="<drop>")]}, "inputs.name"),
    ({**infer_body(), "inputs": [tensor(name=7)]}, "inputs.name must be string type."),
    ({**infer_body(), "inputs": [tensor(name="n" * 257)]}, "inputs.name"),
    ({**infer_body(), "inputs": [tensor(datatype="INT64")]}, "Unsupported datatype, got INT64."),
    ({**infer_body(), "inputs": [tensor(datatype="<drop>")]}, "inputs.datatype"),
    ({**infer_body(), "inputs": [tensor(shape="<drop>")]}, "inputs.shape"),
    ({**infer_body(), "inputs": [tensor(shape=[1, 9])]}, "inputs.shape says 9"),
    ({**infer_body(), "inputs": [tensor(shape=[7])]}, "inputs.shape says 7"),
    ({**infer_body(), "inputs": [tensor(shape=[2, 4])]}, "inputs.shape must be [n] or [1, n]"),
    ({**infer_body(), "inputs": [tensor(shape=[1, 1, 8])]}, "inputs.shape must be [n] or [1, n]"),
    ({**infer_body(), "inputs": [tensor(shape=[1, 0], data=[])]}, "(0, 1048576]"),
    ({**infer_body(), "inputs": [tensor(shape=["8"])]}, "inputs.shape must be an array of integers."),
    ({**infer_body(), "inputs": [tensor(data="<drop>")]}, "inputs.data"),
    ({**infer_body(), "inputs": [tensor(data=[1.5] * 8)]}, "UINT32"),
    ({**infer_body(), "inputs": [tensor(data=[-1] * 8)]}, "UINT32"),
    ({**infer_body(), "inputs": [tensor(data=[2**32] * 8)]}, "UINT32"),
    ({**infer_body(), "inputs": [tensor(data="12")]}, "inputs.data must be array type."),
    ({**infer_body(), "inputs": [tensor(data=[999999] * 8)]}, "outside the vocabulary"),
    ({**infer_body(), "inputs": [tensor(shape=[1, 100], data=[5] * 100)]}, "tokens"),  # > maxInputTokenLen 64
    ({**infer_body(), "outputs": {}}, "outputs must be array type."),
    ({**infer_body(), "outputs": []}, "outputs must have as many items as inputs"),
    ({**infer_body(), "outputs": [{"name": "output0"}, {"name": "output1"}]}, "outputs must have as many"),
    ({**infer_body(), "outputs": [{}]}, "outputs.name"),
    ({**infer_body(), "outputs": [{"name": 3}]}, "outputs.name must be string type."),
    ({**infer_body(), "outputs": [{"name": "output0", "parameters": {"binary_data": "yes"}}]}, "binary_data"),
    ({**infer_body(), "parameters": [1]}, "parameters must be object type."),
    ({**infer_body(), "parameters": {"binary_data_output": 1}}, "binary_data_output"),
]


@pytest.mark.parametrize("body,fragment", BAD_INFER_BODIES, ids=lambda b: str(b)[:50])
def test_bad_infer_bodies_get_422(tiny_stack, body, fragment):
    assert_422(post(tiny_stack, model_path(tiny_stack, "/infer"), body), fragment)
    assert_serving(tiny_stack)


def raw_infer(stack, content: bytes, header_length: str) -> httpx.Response:
    return httpx.post(stack.url + model_path(stack, "/infer"), content=content,
                      headers={"Inference-Header-Content-Length": header_length}, timeout=60)


def test_bad_binary_bodies_get_422(tiny_stack):
    raw = struct.pack("<8I", *PROMPT_IDS)
    header = json.dumps(infer_body(inputs=[tensor(data="<drop>", parameters={"binary_data_size": 32})])).encode()
    assert raw_infer(tiny_stack, header + raw, str(len(header))).status_code == 200
    assert_422(raw_infer(tiny_stack, header + raw, "abc"), "Inference-Header-Content-Length")
    assert_422(raw_infer(tiny_stack, header + raw, str(len(header) + len(raw) + 1)), "Inference-Header-Content-Length")
    assert_422(raw_infer(tiny_stack, header + raw[:-4], str(len(header))), "past the end")
    assert_422(raw_infer(tiny_stack, header + raw + b"\0\0\0\0", str(len(header))), "after the last")
    short = json.dumps(infer_body(inputs=[tensor(data="<drop>", parameters={"binary_data_size": 30})])).encode()
    assert_422(raw_infer(tiny_stack, short + raw[:30], str(len(short))), "multiple of 4")
    negative = json.dumps(infer_body(inputs=[tensor(data="<drop>", parameters={"binary_data_size": -4})])).encode()
    assert_422(raw_infer(tiny_stack, negative + raw, str(len(negative))), "binary_data_size")
    r = httpx.post(tiny_stack.url + model_path(tiny_stack, "/infer"), content=header + raw, timeout=60,
                   headers={"Inference-Header-Content-Length": str(len(header)), "Content-Encoding": "br"})
    assert_422(r, "Content-Encoding")
    assert_serving(tiny_stack)


BAD_TEXT_BODIES = [
    ({"text_input": "hi", "parameters": {"truncate": 20}}, "parameters.truncate is a TGI parameter"),
    (b"{oops", "Failed to parse"),
    ({"parameters": {}}, "text_input"),
    ({"text_input": None}, "text_input"),
    ({"text_input": 12}, "text_input must be string type."),
    ({"text_input": ""}, "text_input must be 1 to"),
    ({"text_input": []}, "Parameter text_input arr is empty"),
    ({"text_input": [{"type": "text", "text": 5}]}, "Request param text must be string"),
    ({"text_input": [{"type": "image_url", "image_url": PNG_URL}]}, "text-only"),
    ({"text_input": PROMPT, "id": "has space"}, "The id can contain only"),
    ({"text_input": PROMPT, "id": ["a"]}, "id must be string type."),
    ({"text_input": PROMPT, "parameters": "x"}, "parameters must be object type."),
    ({"text_input": "word " * 200}, "tokens"),  # > maxInputTokenLen 64
]


@pytest.mark.parametrize("body,fragment", BAD_TEXT_BODIES, ids=lambda b: str(b)[:40])
def test_bad_text_bodies_get_422(tiny_stack, body, fragment):
    for route in ("/generate", "/generate_stream"):
        assert_422(post(tiny_stack, model_path(tiny_stack, route), body), fragment)
    assert_serving(tiny_stack)


def test_wrong_method_and_route_stay_in_mindie_shape(tiny_stack):
    r = httpx.get(tiny_stack.url + model_path(tiny_stack, "/infer"))
    assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}


def test_default_model_greedy_ids_match_transformers(smol_stack, smol_dir):
    """``"My name is Olivier and I"`` as ids → the ids of HF's greedy continuation, JSON and binary alike."""
    from transformers import AutoTokenizer

    expected = "'m here to help you with your business. I'll be your go-to person to ensure your"
    c = triton.InferenceServerClient(url=smol_stack.url.removeprefix("http://"))
    tensor_in = triton.InferInput("input0", [1, len(PROMPT_IDS)], "UINT32")
    tensor_in.set_data_from_numpy(np.array([PROMPT_IDS], dtype=np.uint32), binary_data=True)
    result = c.infer(smol_stack.model, [tensor_in], parameters={"do_sample": False, "max_new_tokens": 20},
                     outputs=[triton.InferRequestedOutput("output0", binary_data=True)])
    ids = result.as_numpy("output0")[0].tolist()
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    assert tokenizer.decode(ids) == expected
    events = sse_blocks(post(smol_stack, model_path(smol_stack, "/generate_stream"), {
        "text_input": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": 20}}).text)
    assert "".join(e["text_output"] for e in events) == expected


def test_an_error_after_the_stream_started_is_a_final_event(smol_stack):
    """A client timeout mid-generation ends the stream with ``data:{"error", "error_type"}``."""
    r = post(smol_stack, model_path(smol_stack, "/generate_stream"), {
        "text_input": PROMPT, "parameters": {"max_new_tokens": 512, "timeout": 1, "details": True}})
    assert r.status_code == 200
    events = sse_blocks(r.text)
    assert events[-1] == {"error": events[-1]["error"], "error_type": "Incomplete Generation"}
    assert "timeout" in events[-1]["error"]
    assert all("text_output" in e for e in events[:-1])
