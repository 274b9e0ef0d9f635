"""GET /stopService?scope=instance: this gateway drains (its stream finishes whole, new inference gets
503, readiness turns 503) and answers 200, but no shutdown is broadcast: every other service, the
engine among them, goes on running. What a Kubernetes preStop hook relies on (deploy/kubernetes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.integration.stack import running_stack
from tests.integration.test_stop_service import LONG_STREAMS, STREAM_TOKENS, read_stream


@pytest.fixture
def own_stack(tmp_path, tiny_model_dir):
    with running_stack(tmp_path, tiny_model_dir, **LONG_STREAMS) as stack:
        yield stack


async def test_instance_drain_finishes_its_stream_and_stops_nothing_else(own_stack):
    mgmt = own_stack.mgmt_url
    async with httpx.AsyncClient(timeout=60) as client:
        bad = await client.get(mgmt + "/stopService", params={"scope": "pod"})
        assert bad.status_code == 422
        assert bad.json()["error_type"] == "Input Validation Error" and "scope" in bad.json()["error"]
        assert (await client.get(mgmt + "/v2/health/ready")).status_code == 200  # a bad scope stops nothing

        stream = asyncio.create_task(read_stream(client, own_stack.url))
        await asyncio.sleep(0.5)  # the stream is running
        stopping = asyncio.create_task(client.get(mgmt + "/stopService", params={"scope": "instance"}))
        await asyncio.sleep(0.2)
        refused = await client.post(own_stack.url + "/infer", json={"inputs": "hi"})
        assert refused.status_code == 503
        assert refused.json() == {"error": "The service has been stopped", "error_type": "Service Unavailable"}
        assert (await client.get(mgmt + "/v2/health/ready")).status_code == 503  # out of the Service
        assert (await client.get(mgmt + "/v2/health/live")).status_code == 200  # but not restarted
        assert not stopping.done()  # it waits for the stream
        stopped = await stopping
        assert stopped.status_code == 200
        assert stream.done()  # the 200 comes after the drain
        assert await stream == STREAM_TOKENS  # whole
        assert (await client.post(own_stack.url + "/infer", json={"inputs": "hi"})).status_code == 503

    await asyncio.sleep(1.0)  # well past the moment a deployment-wide stop would broadcast its shutdown
    assert own_stack.proc.poll() is None  # the launcher saw no service leave
    engine = await own_stack.engine_info()  # the engine still answers over NATS
    assert engine.loaded and engine.running == 0
    assert not any("stopped by /stopService" in line for line in own_stack.output)
