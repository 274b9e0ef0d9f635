"""Management status and control: /v1/config, /v1/status, /v2/status, roles, /health/timed[-N]."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

ROLE_V1 = {"local": {"server_ip": "10.0.0.1", "device": [{"device_ip": "10.0.1.1", "device_logical_id": "0"}]},
           "peers": [{"server_ip": "10.0.0.2", "device": [{"device_ip": "10.0.1.2", "device_logical_id": "0"}]}]}
ROLE_V2 = {"local": [{"server_ip": "10.0.0.1", "host_ip": "10.0.0.1", "dp_inst_list": [
    {"dp_inst_id": "0", "device": [{"device_id": "0", "device_ip": "10.0.1.1", "rank_id": "0",
                                    "device_logical_id": "0"}]}]}], "peers": []}


def get(stack, path: str) -> httpx.Response:
    return httpx.get(stack.mgmt_url + path, timeout=60)


async def status_after_heartbeat(stack, idle) -> dict:
    """/v1/status once the gateway has heard the engine's idle heartbeat (status reads heartbeats)."""
    deadline = time.monotonic() + 5
    while True:
        body = get(stack, "/v1/status").json()
        if body["resource"]["availSlotsNum"] == idle.free_slots or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.1)


def test_v1_config(tiny_stack):
    body = get(tiny_stack, "/v1/config").json()
    assert body == {"modelName": tiny_stack.model, "maxSeqLen": 2560, "npuMemSize": -1, "cpuMemSize": 0,
                    "worldSize": 1, "maxOutputLen": 512, "cacheBlockSize": 16,
                    "quantization": "none", "kvCacheDtype": "float32"}


async def test_status_reports_the_engine_state(tiny_stack):
    info = await tiny_stack.wait_engine_idle()
    v1 = await status_after_heartbeat(tiny_stack, info)
    assert v1["service"] == {"roleStatus": "RoleReady", "currentRole": "none"}
    assert v1["resource"]["availSlotsNum"] == info.max_batch_size
    assert v1["resource"]["availBlockNum"] == v1["resource"]["totalNpuBlockNums"] == info.total_blocks
    assert v1["resource"]["runningRequestNum"] == v1["resource"]["waitingRequestNum"] == 0
    v2 = get(tiny_stack, "/v2/status").json()
    assert set(v2) == {"service", "resource", "linkStatus"}
    assert v2["resource"] == {"totalAvailNpuSlotsNum": info.max_batch_size, "totalAvailNpuBlockNum": info.total_blocks,
                              "maxAvailNpuBlockNum": info.total_blocks, "dpInstMap": {info.instance: info.total_blocks}}


def test_roles_are_set_validated_and_reported(tiny_stack):
    mgmt = tiny_stack.mgmt_url
    try:
        r = httpx.post(mgmt + "/v1/role/decode", json=ROLE_V1)
        assert r.status_code == 200 and r.json() == {"result": "ok"}
        assert get(tiny_stack, "/v1/status").json()["service"]["currentRole"] == "decode"
        assert httpx.post(mgmt + "/v2/role/prefill", json=ROLE_V2).json() == {"result": "ok"}
        assert get(tiny_stack, "/v2/status").json()["service"]["currentRole"] == "prefill"
        bad = httpx.post(mgmt + "/v1/role/prefill", json={"local": {"server_ip": 5}})
        assert bad.status_code == 422 and bad.json()["error_type"] == "Input validation error"
        for devices in ([], [{"device_ip": "x", "device_logical_id": "0"}],  # MindIE's checks of each device
                        [{"device_ip": "10.0.1.1", "device_logical_id": "abc"}]):
            bad = httpx.post(mgmt + "/v1/role/prefill", json={"local": {"server_ip": "10.0.0.1", "device": devices}})
            assert bad.status_code == 422 and "Reset to previous node status" in bad.json()["error"], bad.text
        assert httpx.post(mgmt + "/v2/role/flex", json=ROLE_V2).status_code == 404
        assert get(tiny_stack, "/v2/status").json()["service"]["currentRole"] == "prefill"  # unchanged
    finally:
        httpx.post(mgmt + "/v1/role/flex", json=ROLE_V1)


@pytest.mark.parametrize("path", ["/health/timed", "/health/timed-5", "/health/timed-600"])
def test_timed_health_runs_a_real_inference(tiny_stack, path):
    r = get(tiny_stack, path)
    assert r.status_code == 200 and r.json() == {"status": "healthy"}


def test_a_probes_queue_time_is_not_counted_as_a_clients(tiny_stack):
    """request_queue_time_seconds, like the other latency histograms, describes clients' requests: the probe
    (highest priority, it never waits) left it looking quieter than it was."""
    def queued() -> float:
        text = httpx.get(tiny_stack.metrics_url + "/metrics", timeout=10).text
        return next((float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("request_queue_time_seconds_count")), 0.0)

    before = queued()
    for _ in range(2):
        assert get(tiny_stack, "/health/timed").status_code == 200
    r = httpx.post(tiny_stack.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while queued() < before + 1:
        assert time.monotonic() < deadline, queued()
        time.sleep(0.1)
    time.sleep(0.5)
    assert queued() == before + 1


@pytest.mark.parametrize("path, message", [
    ("/health/timed-0", "Wait time should be in range of [1, 600]"),
    ("/health/timed-601", "Wait time should be in range of [1, 600]"),
    ("/health/timed-1000", "Max wait time is 600"),
    ("/health/timed-abc", "no route"),
])
def test_timed_health_bad_n_is_404(tiny_stack, path, message):
    r = get(tiny_stack, path)
    assert r.status_code == 404 and message in r.json()["error"]
    assert r.json()["error_type"] == "NotFoundError"


def test_status_routes_are_management_only(tiny_stack):
    for path in ("/v1/config", "/v1/status", "/v2/status", "/health/timed"):
        assert httpx.get(tiny_stack.url + path).status_code == 404
