"""The stored /v1/responses bucket on a real nats-server: with JetStream it keeps, finds and deletes records and
a second connection (another gateway) sees them; without JetStream it says so, and the Responses route turns
``store: true`` into a 400 naming why while ``store: false`` and a left-out store still work."""

from __future__ import annotations

import asyncio
import subprocess

import nats
import pytest

from services.gateway.openai_api.errors import OpenAIError
from services.gateway.responses_api.routes import _stored
from shared.response_store import ResponseStore
from switchboard.natsd import EmbeddedNats, find_binary, free_port, wait_for_port


async def test_records_are_kept_shared_and_deleted():
    with EmbeddedNats() as url:
        one, two = await nats.connect(url), await nats.connect(url)
        try:
            mine, theirs = ResponseStore(one, 60, 1 << 20), ResponseStore(two, 60, 1 << 20)
            await mine.open()
            await theirs.open()
            assert mine.available and theirs.available
            await mine.put("resp_1", {"response": {"id": "resp_1"}, "conversation": [{"role": "user", "content": "hi"}]})
            assert (await theirs.get("resp_1"))["conversation"][0]["content"] == "hi"
            assert await theirs.get("resp_2") is None
            assert await theirs.delete("resp_1") and await mine.get("resp_1") is None
            assert not await mine.delete("resp_1")
        finally:
            await one.close()
            await two.close()


async def test_without_jetstream_store_true_is_a_clear_400():
    port = free_port()
    server = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10.0, server)
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        store = ResponseStore(nc, 60, 1 << 20)
        await store.open()
        assert not store.available and "JetStream" in store.why
        with pytest.raises(OpenAIError) as err:
            _stored({"store": True}, store)
        assert err.value.param == "store" and "JetStream" in err.value.message
        assert _stored({"store": False}, store) is False and _stored({}, store) is False
        await nc.close()
    finally:
        server.terminate()
        server.wait(10)


async def test_a_store_opened_before_jetstream_was_up_opens_once_it_is():
    """The gateway's first try was its last: a NATS without JetStream as it started left the store off until
    the gateway restarted (a left-out ``store`` then stored nothing)."""
    port = free_port()
    bare = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    jetstream = EmbeddedNats(port=port)
    nc = None
    try:
        wait_for_port("127.0.0.1", port, 10.0, bare)
        nc = await nats.connect(f"nats://127.0.0.1:{port}", reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        store = ResponseStore(nc, 60, 1 << 20, retry_s=0.5)
        await store.open()
        assert not store.available and not await store.ready()  # (asked again at once: not tried again)
        bare.terminate()
        bare.wait(10)
        jetstream.start()
        deadline = asyncio.get_running_loop().time() + 20
        while not await store.ready():
            assert asyncio.get_running_loop().time() < deadline, store.why
            await asyncio.sleep(0.2)
        await store.put("resp_1", {"response": {"id": "resp_1"}, "conversation": []})
        assert (await store.get("resp_1"))["response"]["id"] == "resp_1"
    finally:
        if nc is not None:
            await nc.close()
        if bare.poll() is None:
            bare.terminate()
            bare.wait(10)
        jetstream.stop()


async def test_a_full_bucket_drops_its_oldest_records_and_takes_a_new_cap():
    """Past responsesMaxMb the oldest records go first (nats-py made the bucket refuse every new record once
    full: each store a 503 for good), and a bucket made under another cap or TTL takes this configuration's."""
    with EmbeddedNats() as url:
        nc = await nats.connect(url)
        try:
            small = ResponseStore(nc, 60, 1 << 20)
            await small.open()
            record = {"response": {"id": "x"}, "conversation": [{"role": "user", "content": "-" * 60_000}]}
            for i in range(40):  # 2.4 MB into a 1 MiB bucket
                await small.put(f"resp_{i}", record)
            assert await small.get("resp_0") is None and await small.get("resp_39") is not None
            larger = ResponseStore(nc, 120, 4 << 20)  # restarted with a larger cap and a longer TTL
            await larger.open()
            config = (await nc.jetstream().stream_info("KV_switchboard_responses")).config
            assert (config.max_bytes, config.max_age) == (4 << 20, 120.0)
            for i in range(40, 100):
                await larger.put(f"resp_{i}", record)
            assert await larger.get("resp_40") is not None and await larger.get("resp_99") is not None
        finally:
            await nc.close()
