"""The prefix cache across engines, on real processes: two engines announce their caches, the tokenizer
routes a conversation's next turn to the engine holding its history, a killed holder drops out of the
router's view within a lease (the turn runs elsewhere, token for token), a restarted engine is credited
with nothing, a busy holder's prefix is pulled by the idle engine and gives exactly the recomputed tokens
(greedy and seeded), and a burst sharing one prefix is spread.

``maxLoadGap`` 0 makes the decisions easy to force: only the least loaded engines are candidates (a
holder busy with one request is passed over, and the chosen engine pulls its prefix); among idle engines,
the one holding the longest prefix wins. The decisions are read from the tokenizer's ``Routed`` metrics
events, and each engine's process from its heartbeat (``pid``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.metrics_messages import Routed
from tests.integration.cluster import Cluster, FleetListener

BLOCK = 16
HISTORY = 12 * BLOCK + 5  # a first turn's prompt: 12 full blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    cluster = Cluster(tmp_path_factory.mktemp("fleet"), tiny_model_dir, engines=2, tokenizers=1,
                      Switchboard={"routing": {"maxLoadGap": 0, "pullMinTokens": 4 * BLOCK}},
                      **{"BackendConfig.ScheduleConfig": {"enablePrefixCache": True, "cacheBlockSize": BLOCK}})
    try:
        cluster.wait_ready()
        model = httpx.get(cluster.base + "/v1/models", timeout=10).json()["data"][0]["id"]
        listener = FleetListener(cluster.url, model)
        deadline = time.monotonic() + 30
        while len(listener.engines) < 2:
            assert time.monotonic() < deadline, "the engines' heartbeats were not heard"
            time.sleep(0.1)
        cluster.model, cluster.listener = model, listener
        yield cluster
        listener.close()
    finally:
        cluster.stop()


def complete(fleet, ids: list[int], max_tokens: int = 6, **extra) -> list[str]:
    """A completion of token ids; the generated tokens (as its logprobs name them)."""
    body = {"model": fleet.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(fleet.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def settled(fleet) -> None:
    """Past the window in which the last request counts as load, and its cache events are in."""
    time.sleep(1.2)


def last_route(fleet, count_before: int) -> Routed:
    deadline = time.monotonic() + 5
    while len(fleet.listener.routed) <= count_before:
        assert time.monotonic() < deadline, "no routing decision heard"
        time.sleep(0.02)
    return fleet.listener.routed[-1]


def conversation(seed: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 40000 for i in range(HISTORY)]


def turn(fleet, ids: list[int], **extra) -> tuple[Routed, list[str]]:
    before = len(fleet.listener.routed)
    out = complete(fleet, ids, **extra)
    return last_route(fleet, before), out


def test_a_conversations_next_turn_goes_to_the_engine_holding_its_history(fleet):
    for seed in range(4):
        history = conversation(seed)
        first, _ = turn(fleet, history)
        settled(fleet)
        second, _ = turn(fleet, history + [77, 78, 79, 80] * 5)
        settled(fleet)
        assert second.engine == first.engine, (seed, first, second)
        assert second.hit_tokens >= 12 * BLOCK and not second.pulled


def test_a_killed_holder_drops_out_and_the_turn_runs_elsewhere_exactly(fleet):
    history = conversation(10) + [5, 6, 7]
    first, reference = turn(fleet, history)
    settled(fleet)
    longer = history + conversation(12)[:4 * BLOCK]  # held by the same engine only, 4 blocks further
    extended, _ = turn(fleet, longer)
    assert extended.engine == first.engine and extended.hit_tokens >= 12 * BLOCK
    settled(fleet)
    name = next(n for n, p in fleet.procs.items() if p.pid == fleet.listener.engines[first.engine].pid)
    fleet.kill(name)
    time.sleep(2.5)  # a lease
    again, tokens = turn(fleet, history)
    assert again.engine != first.engine and tokens == reference
    assert again.best_hit_tokens == 0  # the dead engine's blocks are nobody's
    settled(fleet)
    fleet.start(name)  # restarted empty: a new instance, credited with nothing
    fleet.wait_started(name, 2)
    routed, _ = turn(fleet, longer + [1, 2])
    assert routed.engine == again.engine  # the survivor recomputed the first 12 blocks; nobody holds the rest
    assert routed.hit_tokens == routed.best_hit_tokens == 12 * BLOCK
    settled(fleet)


def test_a_busy_holders_prefix_is_pulled_and_gives_the_recomputed_tokens(fleet):
    history = conversation(20)
    for extra in ({}, {"temperature": 0.8, "seed": 1234}):
        follow = history + [300, 301, 302, 303]
        first, _ = turn(fleet, history, **extra)
        settled(fleet)
        held, reference = turn(fleet, follow, **extra)  # on the holder, from its cache
        assert held.engine == first.engine and not held.pulled
        settled(fleet)
        before = len(fleet.listener.pulled)
        with ThreadPoolExecutor(1) as pool:  # the holder busy with a long request of the same conversation
            routed = len(fleet.listener.routed)
            busy = pool.submit(complete, fleet, history + [9] * 3, 1500)
            last_route(fleet, routed)  # the busy request is the holder's load before the turn comes
            pulled, tokens = turn(fleet, follow, **extra)
            busy.result()
        assert pulled.engine != first.engine and pulled.pulled, pulled
        assert tokens == reference  # pulled K/V give exactly what the holder's own cache gave
        deadline = time.monotonic() + 5
        while len(fleet.listener.pulled) == before:
            assert time.monotonic() < deadline, "no pull reported"
            time.sleep(0.05)
        assert fleet.listener.pulled[-1].ok and fleet.listener.pulled[-1].tokens >= 4 * BLOCK
        settled(fleet)
        history = conversation(21)


def test_a_burst_sharing_one_prefix_is_spread(fleet):
    shared_prefix = conversation(30)
    turn(fleet, shared_prefix)
    settled(fleet)
    before = len(fleet.listener.routed)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: complete(fleet, shared_prefix + [i + 2, i + 3], 40), range(8)))
    engines = [r.engine for r in fleet.listener.routed[before:]]
    assert len(engines) == 8 and len(set(engines)) == 2
    assert max(engines.count(e) for e in set(engines)) <= 5


def test_routing_and_pulls_are_in_the_metrics(fleet):
    port = json.loads(fleet.config.read_text())["ServerConfig"]["metricsPort"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    label = f'model_name="{fleet.model}"'
    assert values[f'route_decisions_total{{{label},outcome="cache"}}'] >= 4
    assert values[f'route_decisions_total{{{label},outcome="pull"}}'] >= 2
    assert values[f"route_hit_tokens_total{{{label}}}"] >= 4 * 12 * BLOCK
    assert values[f"prefix_pull_tokens_total{{{label}}}"] >= 2 * 4 * BLOCK
    assert values[f"engine_load_imbalance{{{label}}}"] >= 1.0


def test_an_adapters_conversation_goes_to_the_engine_holding_it(fleet, tiny_model_dir, tmp_path):
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path / "x", seed=3, r=4, alpha=8)
    reply = httpx.post(fleet.mgmt + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter)},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 10
    while sum(any(a.name == "x" for a in e.adapters) for e in fleet.listener.engines.values()) < 2:
        assert time.monotonic() < deadline, "the engines do not list the adapter"
        time.sleep(0.1)
    salts = {a.salt for e in fleet.listener.engines.values() for a in e.adapters if a.name == "x"}
    assert len(salts) == 1 and len(salts.pop()) == 16  # its weights' digest, the same on both engines
    history = conversation(40)
    first, _ = turn(fleet, history, model="x")
    settled(fleet)
    second, _ = turn(fleet, history + [11, 12, 13], model="x")
    assert second.engine == first.engine and second.hit_tokens >= 12 * BLOCK
    base, _ = turn(fleet, history + [11, 12, 13])  # the base model's blocks of the same tokens are other blocks
    assert base.best_hit_tokens == 0
