"""/metrics (Prometheus, metrics plane) and /metrics-json (management plane) after a known workload.

A stack of its own, so the counts are exactly this test's requests.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import post, running_stack

PROMPT = "My name is Olivier and I"  # 8 tokens


@pytest.fixture(scope="module")
def metrics_stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("metrics"), tiny_model_dir,
                       **{"BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 64}}) as stack:
        yield stack


def samples(text: str) -> dict[str, float]:
    """name{labels} -> value, with the model label dropped for brevity."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out[key] = s.value
    return out


async def test_counters_and_histograms_after_a_known_workload(metrics_stack):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for _ in range(3):
        assert post(metrics_stack, "/generate", body).status_code == 200
    too_long = post(metrics_stack, "/generate", {"prompt": "word " * 200})
    assert too_long.status_code == 422  # refused by the tokenizer: never received
    assert post(metrics_stack, "/generate", {"prompt": PROMPT, "max_tokens": 0}).status_code == 422
    assert post(metrics_stack, "/generate", {"inputs": PROMPT, "parameters": {"top_p": 2}}).status_code == 422
    assert post(metrics_stack, "/v1/chat/completions", {"model": "nope", "messages": []}).status_code in (400, 404)
    await asyncio.sleep(1.5)  # two heartbeats carry the engine's counters
    r = httpx.get(metrics_stack.metrics_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'model_name="' in r.text
    m = samples(r.text)
    base = '{"adapter": "", "api": "vllm"}'  # the request counters' LoRA adapter ("" for the base model) and API
    assert m["request_received_total" + base] == 3
    assert m["request_success_total" + base] == 3
    assert m.get("request_failed_total" + base, 0) == 0
    assert m['request_finished_total{"adapter": "", "api": "vllm", "finished_reason": "length"}'] == 3
    assert m["prompt_tokens_total"] == 3 * 8
    assert m["generation_tokens_total"] == 3 * 5
    assert m["request_generation_tokens_sum"] == 15 and m["request_generation_tokens_count"] == 3
    assert m["request_prompt_tokens_sum"] == 24
    assert m["time_to_first_token_seconds_count"] == 3
    assert m["time_per_output_token_seconds_count"] == 3 * 4  # each token after the first
    assert m['time_per_output_token_seconds_bucket{"le": "+Inf"}'] == 12
    assert 0 < m["time_per_output_token_seconds_sum"] < m["e2e_request_latency_seconds_sum"]
    assert m["e2e_request_latency_seconds_count"] == 3
    assert m["request_queue_time_seconds_count"] == 3
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    assert m["npu_cache_usage_perc"] == 0.0
    assert m["failed_request_perc"] == 0
    assert m["prompt_tokens_cached_total"] >= 0
    # refused before they were received (the gateway's checks, the tokenizer's): counted apart, by route and status
    assert m['request_refused_total{"api": "vllm", "status": "422"}'] == 2
    assert m['request_refused_total{"api": "tgi", "status": "422"}'] == 1
    assert sum(v for k, v in m.items() if k.startswith('request_refused_total{"api": "openai-chat"')) == 1
    assert m['time_to_first_token_seconds_bucket{"le": "+Inf"}'] == 3


def test_metrics_json_shape(metrics_stack):
    r = httpx.get(metrics_stack.mgmt_url + "/metrics-json")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["resultType"] == "vector"
    names = [item["metric"][0]["__name__"] for item in body["result"]]
    assert names == ["TTFT", "TBT", "waitingInferRequestNum", "processingInferRequestNum", "remainBlocks"]
    for item in body["result"]:
        assert isinstance(item["value"], str) and item["value"].isdigit()
        assert item["metric"][0]["job"] == "node"
        assert item["metric"][0]["instance"] == metrics_stack.mgmt_url.removeprefix("http://")
    remain = int(body["result"][4]["value"])
    assert remain > 0


def test_routes_live_on_their_planes(metrics_stack):
    assert httpx.get(metrics_stack.url + "/metrics").status_code == 404
    assert httpx.get(metrics_stack.url + "/metrics-json").status_code == 404
    assert httpx.get(metrics_stack.metrics_url + "/metrics-json").status_code == 404
    assert httpx.get(metrics_stack.mgmt_url + "/metrics").status_code == 404
