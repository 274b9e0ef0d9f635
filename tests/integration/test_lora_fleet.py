"""LoRA across a fleet of engines, each service its own process on a real nats-server.

A load through one gateway reaches both engines, and both serve the adapter with PEFT's own greedy
tokens; an engine started after the load follows the fleet's set (its peers' heartbeats) and serves
the adapter alone once the first two are killed; the only engine restarted gets the set from the gateway;
after an unload no engine lists it and the OpenAI family answers 404.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import nats
import pytest

from shared import subjects
from shared.messages import EngineInfo
from tests.integration.cluster import Cluster
from tests.lora_adapters import make_adapter, peft_greedy

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
NEW_TOKENS = 12
REQUESTS = 8


@pytest.fixture(scope="module")
def adapter(smol_dir, tmp_path_factory):
    return make_adapter(smol_dir, tmp_path_factory.mktemp("fleet-lora") / "x", seed=1, r=8, alpha=16)


@pytest.fixture(scope="module")
def expected(smol_dir, adapter):
    """PEFT's greedy text with the adapter, and the base model's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    ids = tokenizer(PROMPT).input_ids
    texts = {name: tokenizer.decode(peft_greedy(smol_dir, path, [ids], NEW_TOKENS)[0][0])
             for name, path in (("x", adapter), (MODEL, None))}
    assert texts["x"] != texts[MODEL]
    return texts


@pytest.fixture
def cluster(tmp_path, smol_dir):
    c = Cluster(tmp_path, smol_dir, engines=2, tokenizers=1,
                Switchboard={"kvCacheMemoryMb": 128, "torchThreads": 1})
    try:
        yield c.wait_ready()
    finally:
        c.stop()


async def engine_beats(nats_url: str, seconds: float = 1.0) -> dict[str, EngineInfo]:
    """Each engine's latest heartbeat over ``seconds``."""
    nc = await nats.connect(nats_url)
    beats: dict[str, EngineInfo] = {}
    decode = msgspec.msgpack.Decoder(EngineInfo).decode

    async def on_beat(msg) -> None:
        info = decode(msg.data)
        beats[info.instance] = info

    await nc.subscribe(subjects.engine_heartbeat(MODEL), cb=on_beat)
    await asyncio.sleep(seconds)
    await nc.close()
    return beats


def listing(cluster: Cluster, count: int, timeout: float = 60.0) -> dict[str, set[str]]:
    """Adapters per live engine, once ``count`` engines are heard."""
    deadline = time.monotonic() + timeout
    while True:
        beats = asyncio.run(engine_beats(cluster.url))
        if len(beats) >= count or time.monotonic() > deadline:
            return {i: {a.name for a in b.adapters} for i, b in beats.items()}


def complete(cluster: Cluster, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(cluster.base + "/v1/completions", json=body, timeout=120)


def statuses_until_served(cluster: Cluster, model: str, timeout: float = 120.0) -> list[int]:
    """Ask for ``model`` every 0.1 s (two tokens each) until it is served: the statuses, in order."""
    deadline = time.monotonic() + timeout
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    statuses: list[int] = []
    while not statuses or statuses[-1] != 200:
        assert time.monotonic() < deadline, statuses
        statuses.append(httpx.post(cluster.base + "/v1/completions", json=body, timeout=60).status_code)
        time.sleep(0.1 if statuses[-1] != 200 else 0)
    return statuses


def texts(cluster: Cluster, model: str, n: int) -> list[str]:
    """``n`` completions at once (spread over the live engines by load)."""
    async def many() -> list[str]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(cluster.base + "/v1/completions", json=body)
                                             for _ in range(n)))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    return asyncio.run(many())


def test_both_engines_and_a_later_one_serve_a_loaded_adapter(cluster, adapter, expected):
    reply = httpx.post(cluster.mgmt + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter)},
                       timeout=120)
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'x' added successfully."
    assert list(listing(cluster, 2).values()) == [{"x"}, {"x"}]
    assert set(texts(cluster, "x", REQUESTS)) == {expected["x"]}
    assert set(texts(cluster, MODEL, 2)) == {expected[MODEL]}

    cluster.start("engine-2")  # after the load: it follows its peers' adapter set
    cluster.wait_started("engine-2", 1)
    deadline = time.monotonic() + 30
    while (beats := listing(cluster, 3)) and not (len(beats) == 3 and all(v == {"x"} for v in beats.values())):
        assert time.monotonic() < deadline, beats
    cluster.kill("engine-0")
    cluster.kill("engine-1")
    time.sleep(3)  # their leases run out: only engine-2 is left
    assert len(listing(cluster, 1)) == 1
    assert set(texts(cluster, "x", 2)) == {expected["x"]}

    # the only engine restarted: no peer has the set to follow, and the gateway gives it again (the runtime
    # load was lost: clients naming "x" got 404s); while it does, requests for "x" wait, not 404
    cluster.kill("engine-2")
    cluster.start("engine-3")
    statuses = statuses_until_served(cluster, "x")
    assert set(statuses) <= {200, 503}, statuses  # 503: no engine is live yet
    cluster.wait_started("engine-3", 1)
    deadline = time.monotonic() + 30
    while (beats := listing(cluster, 1)) and list(beats.values()) != [{"x"}]:
        assert time.monotonic() < deadline, beats
    assert set(texts(cluster, "x", 2)) == {expected["x"]}

    reply = httpx.post(cluster.mgmt + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60)
    assert reply.text == "Success: LoRA adapter 'x' removed successfully."
    assert list(listing(cluster, 1).values()) == [set()]
    missing = complete(cluster, "x")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
