"""GET /stopService: new inference refused, streams in flight finish whole, then everything exits 0."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config
from tests.integration.stack import Stack

# Long enough to still be running when the stop comes, however fast the engine is.
STREAM_TOKENS = 2000
LONG_STREAMS = {"BackendConfig.ScheduleConfig": {"maxIterTimes": STREAM_TOKENS}}
STREAM = {"prompt": "My name is Olivier and I", "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
          "stream": True}


@pytest.fixture
def own_stack(tmp_path, tiny_model_dir):
    with EmbeddedNats() as url:
        stack = Stack(write_config(tmp_path, tiny_model_dir, Switchboard={"natsUrl": url}, **LONG_STREAMS), url)
        try:
            yield stack.start()
        finally:
            stack.stop()


async def read_stream(client: httpx.AsyncClient, url: str) -> int:
    async with client.stream("POST", url + "/generate", json=STREAM) as r:
        assert r.status_code == 200
        body = b"".join([chunk async for chunk in r.aiter_bytes()])
    return len([c for c in body.split(b"\0") if c and json.loads(c)["text"][0]])


async def test_drain_finishes_streams_then_every_service_exits_zero(own_stack):
    async with httpx.AsyncClient(timeout=60) as client:
        streams = [asyncio.create_task(read_stream(client, own_stack.url)) for _ in range(3)]
        await asyncio.sleep(0.5)  # the streams are running
        stopping = asyncio.create_task(client.get(own_stack.mgmt_url + "/stopService"))
        await asyncio.sleep(0.2)
        refused = await client.post(own_stack.url + "/infer", json={"inputs": "hi"})
        assert refused.status_code == 503
        assert refused.json() == {"error": "The service has been stopped", "error_type": "Service Unavailable"}
        assert (await client.get(own_stack.mgmt_url + "/stopService")).status_code == 500  # already stopping
        # the status routes, as MindIE's after its stop flag (reference §2.3); /health/timed stays healthy
        for path in ("/health", "/v2/health/live", "/v2/health/ready", "/info", "/metrics-json", "/v1/status"):
            gated = await client.get(own_stack.mgmt_url + path)
            assert gated.status_code == 503, path
            assert gated.json() == {"error": "The service has been stopped.", "error_type": "Service Unavailable"}
        assert (await client.get(own_stack.mgmt_url + "/health/timed-5")).json() == {"status": "healthy"}
        stopped = await stopping
        assert stopped.status_code == 200
        assert all(s.done() for s in streams)  # the 200 comes after the drain
        tokens = [await s for s in streams]
    assert tokens == [STREAM_TOKENS] * 3  # none lost or cut
    assert await asyncio.to_thread(own_stack.proc.wait, 30) == 0
    assert any("stopped by /stopService" in line for line in own_stack.output + own_stack.drain_output())


async def test_force_answers_at_once(own_stack):
    async with httpx.AsyncClient(timeout=60) as client:
        stream = asyncio.create_task(read_stream(client, own_stack.url))
        await asyncio.sleep(0.5)
        r = await client.get(own_stack.mgmt_url + "/stopService", params={"mode": "Force"})
        assert r.status_code == 200
        await asyncio.gather(stream, return_exceptions=True)
    assert await asyncio.to_thread(own_stack.proc.wait, 30) == 0
