"""Prefill/decode disaggregation in one deployment, as separate processes on a real nats-server: engine-0
prefills (``--role prefill``), engine-1 decodes (``--role decode``). Greedy and seeded streams equal an
in-process co-located engine token for token, the decode engine computes no prompt token (the K/V came
over the bus), and killing the decode engine mid-stream loses nothing (the gateway resumes; the prefill
engine, alone, serves whole)."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import msgspec
import pytest
from transformers import AutoTokenizer

from services.engine.engine import Engine
from services.engine.build import eos_token_ids
from shared import subjects
from shared.messages import EngineInfo
from tests.integration import test_failover
from tests.integration.cluster import Cluster
from tests.unit.engine_helpers import limits, make_runner, request, run_until_idle

TOKENS = 40
STREAMS = 4


def pd_body(i: int, seeded: bool) -> dict:
    return {"inputs": f"Request number {i}: " + "once upon a time, " * (10 + 15 * i),
            "parameters": test_failover.params(i, seeded, TOKENS)}


@pytest.fixture(scope="module", autouse=True)
def pd_streams():
    """test_failover's streams, with this module's prompts and count."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_failover, "body", pd_body)
        patch.setattr(test_failover, "STREAMS", STREAMS)
        yield


def pd_cluster(folder, model_dir) -> Iterator[Cluster]:
    c = Cluster(folder, model_dir, engines=2, tokenizers=1,
                args={"engine-0": ["--role", "prefill"], "engine-1": ["--role", "decode"]},
                **{"BackendConfig.ScheduleConfig": {"enablePrefixCache": True}})
    try:
        c.wait_ready()
        c.wait_started("engine-1", 1)
        c.wait_started("engine-0", 1)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    """One PD deployment for the tests that leave it as they found it (they count by differences)."""
    yield from pd_cluster(tmp_path_factory.mktemp("pd"), tiny_model_dir)


@pytest.fixture
def own_cluster(tmp_path, tiny_model_dir):
    """A PD deployment of the test's own: it kills a process."""
    yield from pd_cluster(tmp_path, tiny_model_dir)


def co_located(model_dir, seeded: bool) -> list[list[int]]:
    """The same requests on one in-process engine that does both (what a co-located deployment gives)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = make_runner(model_dir, 128)
    engine = Engine(runner, limits(), eos_token_ids(runner))
    for i in range(STREAMS):
        sampling = {"do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 1000 + i} if seeded else {}
        ids = tokenizer(pd_body(i, seeded)["inputs"]).input_ids
        engine.add_request(request(str(i), ids, max_new_tokens=TOKENS, **sampling))
    run = run_until_idle(engine)
    return [run.tokens[str(i)] for i in range(STREAMS)]


async def engine_infos(nats_url: str, model: str, wait_s: float = 1.5) -> dict[str, EngineInfo]:
    """Each engine's latest heartbeat, by role."""
    import nats

    latest: dict[str, EngineInfo] = {}
    nc = await nats.connect(nats_url)

    async def on_beat(msg) -> None:
        info = msgspec.msgpack.decode(msg.data, type=EngineInfo)
        latest[info.role] = info

    await nc.subscribe(subjects.engine_heartbeat(model), cb=on_beat)
    try:
        await asyncio.sleep(wait_s)
    finally:
        await nc.close()
    return latest


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_prefill_and_decode_engines_answer_as_one_engine_with_no_re_prefill(cluster, tiny_model_dir, seeded):
    before = asyncio.run(engine_infos(cluster.nats.url, model_name(cluster)))
    streams = test_failover.Streams(cluster.base, seeded)
    asyncio.run(streams.run())
    assert not any(streams.errors), (streams.errors, cluster.log_tails())
    assert streams.tokens == co_located(tiny_model_dir, seeded), cluster.log_tails()
    infos = asyncio.run(engine_infos(cluster.nats.url, model_name(cluster)))
    grew = {role: {name: getattr(infos[role], name) - getattr(before[role], name)
                   for name in ("prompt_tokens_total", "generation_tokens_total")} for role in ("prefill", "decode")}
    assert grew["decode"]["prompt_tokens_total"] == 0, (before, infos)  # no silent re-prefill
    assert grew["decode"]["generation_tokens_total"] == sum(len(t) - 1 for t in streams.tokens)
    assert grew["prefill"]["generation_tokens_total"] == STREAMS  # the first tokens
    assert transfers(cluster)["kv_transfer_seconds_count"] >= STREAMS


def test_every_family_answers_as_the_co_located_run(cluster, tiny_model_dir):
    """The seeded request of the streams test, in each API family: the same text as TGI's, whose tokens equal
    the co-located run's; Triton's /infer (token ids in and out) equals it token for token."""
    import httpx

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = pd_body(1, True)["inputs"]
    expected = co_located(tiny_model_dir, seeded=True)[1]
    seeded = {"temperature": 0.9, "top_k": 50, "seed": 1001}
    tgi = {"do_sample": True, "max_new_tokens": TOKENS, **seeded}
    model = model_name(cluster)

    def post(path: str, body: dict) -> dict:
        r = httpx.post(cluster.base + path, json=body, timeout=120)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    text = post("/generate", {"inputs": prompt, "parameters": {**tgi, "details": True}})
    assert [t["id"] for t in text["details"]["tokens"]] == expected
    text = text["generated_text"]
    assert post("/infer", {"inputs": prompt, "stream": False, "parameters": tgi})["generated_text"] == text
    assert post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": TOKENS, **seeded}
                )["choices"][0]["text"] == text
    assert post("/generate", {"prompt": prompt, "max_tokens": TOKENS, **seeded})["text"][0].endswith(text)
    assert post(f"/v2/models/{model}/generate", {"text_input": prompt, "parameters": tgi})["text_output"] == text
    ids = tokenizer(prompt).input_ids
    infer = post(f"/v2/models/{model}/infer", {"id": "t", "inputs": [
        {"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32", "data": ids}], "parameters": tgi})
    assert infer["outputs"][0]["data"] == expected


def transfers(cluster) -> dict[str, float]:
    """The K/V transfer histograms' samples from the Prometheus endpoint."""
    import json

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    port = json.loads(cluster.config.read_text())["ServerConfig"].get("metricsPort", 1027)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            if family.name.startswith("kv_transfer") for sample in family.samples if not sample.labels.get("le")}


def test_the_decode_engine_killed_mid_stream_loses_nothing(own_cluster, tiny_model_dir):
    cluster = own_cluster
    expected = co_located(tiny_model_dir, seeded=False)
    streams = test_failover.Streams(cluster.base, seeded=False)
    started = time.monotonic()
    asyncio.run(streams.run(fault=lambda: cluster.kill("engine-1"), after_tokens=5))
    assert not any(streams.errors), (streams.errors, cluster.log_tails())
    assert streams.tokens == expected, cluster.log_tails()
    assert time.monotonic() - started < 60


def model_name(cluster) -> str:
    import json

    return json.loads(cluster.config.read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]


def test_four_concurrent_thousand_token_handoffs_all_complete(cluster, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    words = [f"Story {i}: " + " ".join(f"word{j}" for j in range(400)) for i in range(4)]
    prompts = [tokenizer.decode(tokenizer(w).input_ids[:1000]) for w in words]
    assert all(len(tokenizer(p).input_ids) >= 990 for p in prompts)

    async def one(client, prompt: str) -> list[int]:
        r = await client.post(cluster.base + "/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": 8, "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    async def all_four() -> list[list[int]]:
        import httpx

        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    before = asyncio.run(engine_infos(cluster.nats.url, model_name(cluster)))["decode"].prompt_tokens_total
    got = asyncio.run(all_four())
    runner = make_runner(tiny_model_dir, 512)
    engine = Engine(runner, limits(), eos_token_ids(runner))
    for i, p in enumerate(prompts):
        engine.add_request(request(str(i), tokenizer(p).input_ids, max_new_tokens=8))
    run = run_until_idle(engine)
    assert got == [run.tokens[str(i)] for i in range(4)]
    after = asyncio.run(engine_infos(cluster.nats.url, model_name(cluster)))["decode"].prompt_tokens_total
    assert after == before  # all four prompts' K/V came over the bus


def test_handoffs_fit_a_bus_that_takes_small_messages(tmp_path, tiny_model_dir):
    """A nats-server without the shipped config takes 1 MiB messages; here 128 KiB: a 1,000-token prompt's K/V
    goes over in parts that fit (nothing recomputed on the decode engine), and the tokens are the co-located ones."""
    from services.engine.kv_transfer import HEADROOM

    c = Cluster(tmp_path, tiny_model_dir, engines=2, tokenizers=1, nats_max_payload=HEADROOM + (128 << 10),
                args={"engine-0": ["--role", "prefill"], "engine-1": ["--role", "decode"]})
    try:
        c.wait_ready()
        c.wait_started("engine-1", 1)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        prompt = tokenizer.decode(tokenizer("Story: " + " ".join(f"word{j}" for j in range(400))).input_ids[:1000])
        import httpx

        r = httpx.post(c.base + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}},
                       timeout=120)
        assert r.status_code == 200, r.text
        runner = make_runner(tiny_model_dir, 128)
        engine = Engine(runner, limits(), eos_token_ids(runner))
        engine.add_request(request("p", tokenizer(prompt).input_ids, max_new_tokens=8))
        assert [t["id"] for t in r.json()["details"]["tokens"]] == run_until_idle(engine).tokens["p"]
        infos = asyncio.run(engine_infos(c.nats.url, model_name(c)))
        decode = infos["decode"]  # the K/V came over the bus, and the decode engine went on from it
        assert decode.prompt_tokens_total == 0 and decode.generation_tokens_total == 7, (infos, c.log_tails())
    finally:
        c.stop()


def test_blocks_cached_on_the_decode_engine_do_not_travel_again(cluster, tiny_model_dir):
    """The same 1,000-token prompt twice: the second transfer sends only what the decode engine's prefix
    cache lacks (its last, partial block), and the answers are equal."""
    import httpx

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.decode(tokenizer("Again: " + " ".join(f"word{j}" for j in range(400))).input_ids[:1000])
    sent, answers = [], []
    for _ in range(2):
        before = transfers(cluster).get("kv_transfer_bytes_sum", 0.0)
        r = httpx.post(cluster.base + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 4}},
                       timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["generated_text"])
        deadline = time.monotonic() + 10
        while transfers(cluster).get("kv_transfer_bytes_sum", 0.0) == before:  # the metrics event is on its way
            assert time.monotonic() < deadline, cluster.log_tails()
            time.sleep(0.1)
        sent.append(transfers(cluster)["kv_transfer_bytes_sum"] - before)
    assert answers[0] == answers[1]
    assert sent[1] <= sent[0] / 30, sent  # 1 or 2 blocks of some 63


def test_a_frozen_decode_engine_ends_in_recompute_within_the_transfer_timeout(tmp_path, tiny_model_dir):
    """SIGSTOP the decode engine: its lease is still good, so prefill engines hand requests to it, and the
    transfers go unanswered; after kvTransTimeoutSeconds each request is recomputed on the prefill engine."""
    import os
    import signal

    c = Cluster(tmp_path, tiny_model_dir, engines=2, tokenizers=1, Switchboard={"kvTransTimeoutSeconds": 2},
                args={"engine-0": ["--role", "prefill"], "engine-1": ["--role", "decode"]})
    try:
        c.wait_ready()
        c.wait_started("engine-1", 1)
        os.kill(c.procs["engine-1"].pid, signal.SIGSTOP)
        streams = test_failover.Streams(c.base, seeded=False)
        started = time.monotonic()
        asyncio.run(streams.run())
        elapsed = time.monotonic() - started
        os.kill(c.procs["engine-1"].pid, signal.SIGCONT)
        assert not any(streams.errors), (streams.errors, c.log_tails())
        assert streams.tokens == co_located(tiny_model_dir, seeded=False), c.log_tails()
        assert elapsed < 2 + 20, elapsed
        assert "handoff failed" in (tmp_path / "engine-0.log").read_text()
    finally:
        c.stop()
