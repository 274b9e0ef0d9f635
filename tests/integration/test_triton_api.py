"""The Triton / KServe v2 family through all four services: the real tritonclient, raw HTTP framing,
stopInfer, and every validation rule of seed 004 / reference §3.29-§3.31 (tiny random model)."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

PROMPT = "My name is Olivier and I"
PROMPT_IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]
GREEDY = {"do_sample": False, "max_new_tokens": 8}
SERVER_KEYS = {"name", "version", "extensions"}
EXTENSION_KEYS = {"max_iter_times", "prefill_policy_type", "decode_policy_type", "max_prefill_batch_size",
                  "max_prefill_tokens"}
CONFIG_KEYS = {"model_name", "input_datatype", "output_datatype", "max_seq_len", "npu_mem_size", "cpu_mem_size",
               "world_size", "model_weight_path", "model_instance_type"}
TEXT_KEYS = ["id", "model_name", "model_version", "text_output"]
DETAIL_KEYS = ["finish_reason", "generated_tokens", "first_token_cost", "decode_cost", "perf_stat"]
STREAM_DETAIL_KEYS = ["generated_tokens", "first_token_cost", "decode_cost", "perf_stat", "batch_size",
                      "queue_wait_time"]


def client(url: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=url.removeprefix("http://"))


def post(stack, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(stack.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def model_path(stack, suffix: str) -> str:
    return f"/v2/models/{stack.model}{suffix}"


def infer_body(ids=PROMPT_IDS, parameters=None, **overrides) -> dict:
    body = {"id": "42", "inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32", "data": ids}],
            "outputs": [{"name": "output0"}], "parameters": {**GREEDY, **(parameters or {})}}
    return {**body, **overrides}


def sse_blocks(text: str) -> list[dict]:
    """Triton framing: every event is ``data:<json>`` with no space, blocks split by a blank line."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data:") and not block.startswith("data: "), f"bad Triton SSE framing: {block!r}"
        events.append(json.loads(block[len("data:"):]))
    return events


def assert_serving(stack) -> None:
    r = post(stack, model_path(stack, "/infer"), infer_body(parameters={"max_new_tokens": 2}))
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"][0]["data"]) == 2


def numpy_inputs(binary: bool) -> list[triton.InferInput]:
    tensor = triton.InferInput("input0", [1, len(PROMPT_IDS)], "UINT32")
    tensor.set_data_from_numpy(np.array([PROMPT_IDS], dtype=np.uint32), binary_data=binary)
    return [tensor]


# ---- metadata and health ------------------------------------------------------------------------


def test_server_model_metadata_and_config_through_tritonclient(tiny_stack):
    c = client(tiny_stack.url)
    server = c.get_server_metadata()
    assert set(server) == SERVER_KEYS and server["name"] == "MindIE Server" and server["version"] == "1.0.0"
    assert set(server["extensions"]) == EXTENSION_KEYS and server["extensions"]["max_iter_times"] == 512
    assert server["extensions"]["max_prefill_batch_size"] == 16
    assert c.get_model_metadata(tiny_stack.model) == {
        "name": tiny_stack.model, "platform": "MindIE Server",
        "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
        "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]}
    assert c.get_model_metadata(tiny_stack.model, model_version="1")["name"] == tiny_stack.model
    config = c.get_model_config(tiny_stack.model)
    assert set(config) == CONFIG_KEYS
    assert config["model_name"] == tiny_stack.model and config["max_seq_len"] == 2560
    assert config["model_weight_path"] and "/" not in config["model_weight_path"]
    assert config["npu_mem_size"] == -1 and config["world_size"] == 1
    assert config["model_instance_type"] == "Standard"


def test_readiness_on_the_management_plane(tiny_stack):
    mgmt = client(tiny_stack.mgmt_url)
    assert mgmt.is_server_live() and mgmt.is_server_ready()
    assert mgmt.is_model_ready(tiny_stack.model)
    assert mgmt.is_model_ready(tiny_stack.model, model_version="1")
    assert not mgmt.is_model_ready("nope")
    # planes are split: ready is management-only, inference business-only
    assert httpx.get(tiny_stack.url + model_path(tiny_stack, "/ready")).status_code == 404
    assert httpx.post(tiny_stack.mgmt_url + model_path(tiny_stack, "/infer"), json=infer_body()).status_code == 404


def test_get_slot_count(tiny_stack):
    r = httpx.get(tiny_stack.mgmt_url + model_path(tiny_stack, "/getSlotCount"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["total_slots", "free_slots", "available_tokens_length"]
    assert body["total_slots"] == 32 and 0 <= body["free_slots"] <= 32
    assert body["available_tokens_length"] > 0 and body["available_tokens_length"] % 16 == 0
    assert httpx.get(tiny_stack.url + model_path(tiny_stack, "/getSlotCount")).status_code == 404


NOT_FOUND_ROUTES = [
    ("GET", "", "/v2/models/nope"), ("GET", "", "/v2/models/nope/config"),
    ("GET", "", "/v2/models/nope/versions/1"),
    ("POST", "", "/v2/models/nope/infer"), ("POST", "", "/v2/models/nope/generate"),
    ("POST", "", "/v2/models/nope/generate_stream"), ("POST", "", "/v2/models/nope/stopInfer"),
    ("GET", "mgmt", "/v2/models/nope/ready"), ("GET", "mgmt", "/v2/models/nope/getSlotCount"),
]


@pytest.mark.parametrize("method,plane,path", NOT_FOUND_ROUTES)
def test_unknown_model_is_404_in_mindie_shape(tiny_stack, method, plane, path):
    base = tiny_stack.mgmt_url if plane else tiny_stack.url
    r = httpx.request(method, base + path, json=infer_body() if method == "POST" else None)
    assert r.status_code == 404
    assert r.json() == {"error": "Model nope not found.", "error_type": "NotFoundError"}


def test_tritonclient_surfaces_errors(tiny_stack):
    c = client(tiny_stack.url)
    with pytest.raises(InferenceServerException) as err:
        c.get_model_metadata("nope")
    assert err.value.status() == "404" and "Model nope not found." in err.value.message()
    bad = triton.InferInput("input0", [1, 2], "INT32")
    bad.set_data_from_numpy(np.array([[1, 2]], dtype=np.int32), binary_data=False)
    with pytest.raises(InferenceServerException) as err:
        c.infer(tiny_stack.model, [bad])
    assert err.value.status() == "422" and "Unsupported datatype" in err.value.message()


# ---- /infer -----------------------------------------------------------------------------------


def test_infer_json_and_binary_tensors_give_the_same_greedy_tokens(tiny_stack):
    c = client(tiny_stack.url)
    params = {"do_sample": True, "seed": 7, "max_new_tokens": 8}  # seeded: varied ids, still reproducible
    as_json = c.infer(tiny_stack.model, numpy_inputs(False), request_id="r-json", parameters=params,
                      outputs=[triton.InferRequestedOutput("output0", binary_data=False)])
    as_binary = c.infer(tiny_stack.model, numpy_inputs(True), request_id="r-bin", parameters=params,
                        outputs=[triton.InferRequestedOutput("output0", binary_data=True)])
    unnamed = c.infer(tiny_stack.model, numpy_inputs(True), parameters=params)  # binary_data_output
    versioned = c.infer(tiny_stack.model, numpy_inputs(False), model_version="1", parameters=params)
    tokens = as_json.as_numpy("output0")
    assert tokens.dtype == np.uint32 and tokens.shape == (1, 8) and len(set(tokens[0].tolist())) > 1
    for other in (as_binary, unnamed, versioned):
        assert other.as_numpy("output0").tolist() == tokens.tolist()
    assert as_json.get_response()["id"] == "r-json" and as_binary.get_response()["id"] == "r-bin"
    raw = post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body(parameters=params))
    assert raw.json()["outputs"][0]["data"] == tokens[0].tolist()


def test_infer_json_shape_follows_seed_004(tiny_stack):
    r = post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body(parameters={"max_new_tokens": 5}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert "inference-header-content-length" not in r.headers
    body = r.json()
    assert list(body) == ["id", "model_name", "outputs"] and body["id"] == "42"  # KServe's model_name added
    assert body["model_name"] == tiny_stack.model
    (output,) = body["outputs"]
    assert list(output) == ["name", "shape", "datatype", "data"]
    assert output["name"] == "output0" and output["datatype"] == "UINT32"
    assert output["shape"] == [1, len(output["data"])] and 1 <= len(output["data"]) <= 5
    flat = post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body(
        inputs=[{"name": "input0", "shape": [8], "datatype": "UINT32", "data": PROMPT_IDS}],
        parameters={"max_new_tokens": 5}))
    assert flat.json()["outputs"][0]["data"] == output["data"]
    no_id = post(tiny_stack, model_path(tiny_stack, "/infer"), {k: v for k, v in infer_body().items() if k != "id"})
    assert isinstance(no_id.json()["id"], str) and no_id.json()["id"]


def binary_request(ids: list[int], header_extra: dict | None = None) -> tuple[bytes, int]:
    raw = struct.pack(f"<{len(ids)}I", *ids)
    header = json.dumps({"inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "output0", "parameters": {"binary_data": True}}],
                         "parameters": GREEDY, **(header_extra or {})}).encode()
    return header + raw, len(header)


def test_infer_binary_wire_format(tiny_stack):
    body, size = binary_request(PROMPT_IDS)
    r = httpx.post(tiny_stack.url + model_path(tiny_stack, "/infer"), content=body,
                   headers={"Inference-Header-Content-Length": str(size)}, timeout=60)
    assert r.status_code == 200, r.text
    length = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:length])
    (output,) = header["outputs"]
    assert output["parameters"] == {"binary_data_size": 32} and "data" not in output
    tokens = list(struct.unpack("<8I", r.content[length:]))
    assert tokens == post(tiny_stack, model_path(tiny_stack, "/infer"), infer_body()).json()["outputs"][0]["data"]


def test_infer_accepts_gzip_request_bodies(tiny_stack):
    c = client(tiny_stack.url)
    plain = c.infer(tiny_stack.model, numpy_inputs(True), parameters=GREEDY)
    packed = c.infer(tiny_stack.model, numpy_inputs(True), parameters=GREEDY, request_compression_algorithm="gzip")
    assert packed.as_numpy("output0").tolist() == plain.as_numpy("output0").tolist()


# ---- /generate and /generate_stream -----------------------------------------------------------


def test_generate_shapes_follow_seed_002(tiny_stack):
    plain = post(tiny_stack, model_path(tiny_stack, "/generate"), {"id": "a123", "text_input": PROMPT,
                                                                   "parameters": GREEDY})
    assert plain.status_code == 200, plain.text
    assert list(plain.json()) == TEXT_KEYS
    assert plain.json()["id"] == "a123" and plain.json()["model_name"] == tiny_stack.model
    assert plain.json()["model_version"] is None
    r = post(tiny_stack, model_path(tiny_stack, "/generate"), {"id": "a123", "text_input": PROMPT, "parameters": {
        **GREEDY, "details": True, "perf_stat": True, "batch_size": 100, "priority": 5, "timeout": 10}})
    body = r.json()
    assert list(body) == TEXT_KEYS + ["details"] and body["text_output"] == plain.json()["text_output"]
    details = body["details"]
    assert list(details) == DETAIL_KEYS and details["finish_reason"] in ("length", "eos_token")
    assert details["first_token_cost"] is None and details["decode_cost"] is None
    assert details["generated_tokens"] == len(details["perf_stat"]) <= 8
    assert all(isinstance(i, int) and isinstance(ms, int) and ms >= 0 for i, ms in details["perf_stat"])
    only_details = post(tiny_stack, model_path(tiny_stack, "/generate"), {"text_input": PROMPT, "parameters": {
        **GREEDY, "details": True}}).json()["details"]
    assert list(only_details) == DETAIL_KEYS[:-1]


def test_generate_stream_is_data_colon_events(tiny_stack):
    full = post(tiny_stack, model_path(tiny_stack, "/generate"), {"text_input": PROMPT, "parameters": GREEDY})
    r = post(tiny_stack, model_path(tiny_stack, "/generate_stream"), {"id": "s1", "text_input": PROMPT,
                                                                      "parameters": {**GREEDY, "details": True,
                                                                                     "perf_stat": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("data:{")
    events = sse_blocks(r.text)
    assert events
    for n, event in enumerate(events, 1):
        assert list(event) == TEXT_KEYS + ["details", "prefill_time", "decode_time"] and event["id"] == "s1"
        keys = (["finish_reason"] if n == len(events) else []) + STREAM_DETAIL_KEYS
        assert list(event["details"]) == keys
        assert event["details"]["generated_tokens"] == n == len(event["details"]["perf_stat"])
        assert (event["prefill_time"] is None) == (n > 1) and (event["decode_time"] is None) == (n == 1)
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert "".join(e["text_output"] for e in events) == full.json()["text_output"]
    bare = sse_blocks(post(tiny_stack, model_path(tiny_stack, "/generate_stream"),
                           {"text_input": PROMPT, "parameters": GREEDY}).text)
    assert all(list(e) == TEXT_KEYS + ["prefill_time", "decode_time"] for e in bare)


def test_the_seed_002_examples_work(tiny_stack):
    params = {"details": True, "do_sample": True, "max_new_tokens": 5, "repetition_penalty": 1.1, "seed": 123,
              "temperature": 1, "top_k": 10, "top_p": 0.99, "batch_size": 100, "typical_p": 0.5, "watermark": False,
              "perf_stat": True, "priority": 5, "timeout": 10}
    first = post(tiny_stack, model_path(tiny_stack, "/generate"), {"id": "a123", "text_input": PROMPT,
                                                                   "parameters": params}).json()
    again = post(tiny_stack, model_path(tiny_stack, "/generate"), {"id": "a123", "text_input": PROMPT,
                                                                   "parameters": params}).json()
    assert first["text_output"] == again["text_output"] and first["details"]["generated_tokens"] == 5
    events = sse_blocks(post(tiny_stack, model_path(tiny_stack, "/generate_stream"),
                             {"id": "a123", "text_input": PROMPT, "parameters": params}).text)
    assert "".join(e["text_output"] for e in events) == first["text_output"]
    seed_infer = {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "do_sample": True, "seed": None,
                  "repetition_penalty": 1.03, "max_new_tokens": 20, "watermark": True, "priority": 5, "timeout": 10}
    r = post(tiny_stack, model_path(tiny_stack, "/infer"), {**infer_body(), "parameters": seed_infer})
    assert r.status_code == 200, r.text
