"""modelInstanceNumber 2 and tokenizerProcessNumber 2 under `switchboard serve`: the launcher starts two engines
and two tokenizers, status and slot counts sum both engines, Prometheus counts every token once, and SIGTERM
stops every child.

The engines' own word is their heartbeats (the health subject is a queue group: one engine answers it), so
the test listens to ``subjects.engine_heartbeat`` and keeps the latest per instance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.messages import EngineInfo
from switchboard.replicas import available_cores
from tests.lora_adapters import make_adapter
from tests.integration.stack import running_stack

ENGINES = TOKENIZERS = 2
REQUESTS = 12
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def many(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("many"), tiny_model_dir,
                       BackendConfig={"modelInstanceNumber": ENGINES, "tokenizerProcessNumber": TOKENIZERS},
                       Switchboard={"kvCacheMemoryMb": 16, "shutdownGraceSeconds": 60}) as stack:
        yield stack


def children(pid: int) -> dict[int, list[str]]:
    """The live child processes of ``pid`` and their command lines (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = [arg for arg in cmdline if arg]
    return found


def service_of(cmdline: list[str]) -> tuple[str, str]:
    """(service, --name) of a `python -m switchboard.cli <service> ... --name <name>` command line."""
    service = cmdline[cmdline.index("switchboard.cli") + 1]
    return service, cmdline[cmdline.index("--name") + 1]


async def heartbeats(stack, seconds: float = 1.2) -> dict[str, EngineInfo]:
    """Each engine's latest heartbeat over ``seconds`` (heartbeats go out four times per lease)."""
    latest: dict[str, EngineInfo] = {}
    nc = await nats.connect(stack.nats_url)
    try:
        async def on_beat(msg) -> None:
            info = msgspec.msgpack.decode(msg.data, type=EngineInfo)
            latest[info.instance] = info

        await nc.subscribe(subjects.engine_heartbeat(stack.model), cb=on_beat)
        await asyncio.sleep(seconds)
    finally:
        await nc.close()
    return latest


async def idle_heartbeats(stack, timeout: float = 15.0) -> dict[str, EngineInfo]:
    """The engines' heartbeats once every engine is idle with all its blocks free."""
    deadline = time.monotonic() + timeout
    while True:
        beats = await heartbeats(stack)
        idle = all(e.running == e.waiting == 0 and e.free_blocks == e.total_blocks for e in beats.values())
        if (len(beats) == ENGINES and idle) or time.monotonic() > deadline:
            return beats


def prometheus(stack) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(stack.metrics_url + "/metrics", timeout=10).text):
        for s in family.samples:
            instance = s.labels.get("engine_instance")
            out[s.name + (f"{{{instance}}}" if instance else "")] = s.value
    return out


async def generate(client: httpx.AsyncClient, stack, i: int) -> int:
    body = {"inputs": f"Request number {i} says", "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False,
                                                                  "details": True}}
    r = await client.post(stack.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_tokens"]


def test_the_launcher_starts_two_engines_and_two_tokenizers(many):
    started = sorted(service_of(cmd) for cmd in children(many.proc.pid).values())
    assert started == [("engine", "engine-0"), ("engine", "engine-1"), ("gateway", "gateway"),
                       ("metrics", "metrics"), ("tokenizer", "tokenizer-0"), ("tokenizer", "tokenizer-1")]
    threads = str(max(1, available_cores() // ENGINES))
    for cmd in children(many.proc.pid).values():
        if service_of(cmd)[0] == "engine":
            assert cmd[cmd.index("--torch-threads") + 1] == threads


async def test_status_slots_and_metrics_cover_both_engines(many):
    before = await idle_heartbeats(many)
    assert len(before) == ENGINES
    tokens_before = prometheus(many)["generation_tokens_total"]
    async with httpx.AsyncClient(timeout=120) as client:
        generated = await asyncio.gather(*(generate(client, many, i) for i in range(REQUESTS)))
    after = await idle_heartbeats(many)
    assert set(after) == set(before)
    grown = {i: after[i].generation_tokens_total - before[i].generation_tokens_total for i in after}
    assert all(n > 0 for n in grown.values()), f"an engine got no work: {grown}"
    assert sum(grown.values()) == sum(generated)

    await asyncio.sleep(0.6)  # the gateway and the metrics service hear the same idle heartbeats
    metrics = prometheus(many)
    assert metrics["generation_tokens_total"] - tokens_before == sum(generated)
    assert metrics["generation_tokens_total"] == sum(e.generation_tokens_total for e in after.values())
    assert metrics["prompt_tokens_total"] == sum(e.prompt_tokens_total for e in after.values())
    for instance, info in after.items():
        assert metrics[f"engine_generation_tokens_total{{{instance}}}"] == info.generation_tokens_total
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0

    total = sum(e.total_blocks for e in after.values())
    v1 = httpx.get(many.mgmt_url + "/v1/status").json()["resource"]
    slots_total = sum(e.max_batch_size for e in after.values())
    assert v1["availSlotsNum"] == sum(e.free_slots for e in after.values()) == slots_total
    assert v1["availBlockNum"] == v1["totalNpuBlockNums"] == total
    assert v1["runningRequestNum"] == v1["waitingRequestNum"] == 0
    v2 = httpx.get(many.mgmt_url + "/v2/status").json()["resource"]
    assert v2["totalAvailNpuBlockNum"] == total and v2["totalAvailNpuSlotsNum"] == v1["availSlotsNum"]
    assert v2["dpInstMap"] == {i: e.total_blocks for i, e in after.items()}
    assert v2["maxAvailNpuBlockNum"] == max(e.total_blocks for e in after.values())
    slots = httpx.get(f"{many.mgmt_url}/v2/models/{many.model}/getSlotCount").json()
    block = 16  # cacheBlockSize
    assert slots == {"total_slots": slots_total,
                     "free_slots": sum(e.free_slots for e in after.values()), "available_tokens_length": total * block}
    remain = {item["metric"][0]["__name__"]: item["value"]
              for item in httpx.get(many.mgmt_url + "/metrics-json").json()["result"]}
    assert remain["remainBlocks"] == str(total)


async def test_a_lora_adapter_loads_on_every_engine_and_serves_from_both(many, tiny_model_dir, tmp_path):
    make_adapter(tiny_model_dir, tmp_path / "a", seed=0, r=4, alpha=8, b_scale=0.2)
    load = httpx.post(many.mgmt_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")},
                      timeout=120)
    assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'a' added successfully.")
    before = await heartbeats(many)
    assert len(before) == ENGINES and all([x.name for x in e.adapters] == ["a"] for e in before.values())
    async with httpx.AsyncClient(timeout=120) as client:
        bodies = [{"model": "a", "prompt": f"Request number {i} says", "max_tokens": NEW_TOKENS, "temperature": 0}
                  for i in range(REQUESTS)]
        answers = await asyncio.gather(*(client.post(many.url + "/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 and r.json()["model"] == "a" for r in answers), [r.text for r in answers]
    after = await idle_heartbeats(many)
    assert all(after[i].generation_tokens_total > before[i].generation_tokens_total for i in after)
    unload = httpx.post(many.mgmt_url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=120)
    assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
    assert not any(e.adapters for e in (await heartbeats(many)).values())


def pid_of(stack, name: str) -> int:
    (pid,) = [pid for pid, cmd in children(stack.proc.pid).items() if service_of(cmd)[1] == name]
    return pid


def test_the_launcher_starts_a_killed_engine_and_tokenizer_again_and_no_stream_notices(many):
    """``kill -9`` of an engine, then of a tokenizer, mid-stream under `switchboard serve`: every stream ends exactly
    as an uninterrupted run of it (the peers take the dead one's requests), the deployment serves on, and the
    launcher starts the dead child again."""
    from tests.integration.test_failover import Streams

    expected = Streams(many.url, seeded=False)
    asyncio.run(expected.run())
    assert not any(expected.errors), expected.errors
    for name in ("engine-0", "tokenizer-0"):
        before = pid_of(many, name)
        streams = Streams(many.url, seeded=False)
        asyncio.run(streams.run(fault=lambda: os.kill(before, 9)))
        assert not any(streams.errors), (streams.errors, many.output[-30:])
        assert streams.tokens == expected.tokens
        many.wait_for_line(f"switchboard: {name} is serving again", 120)
        assert pid_of(many, name) != before and many.proc.poll() is None
    assert len(asyncio.run(heartbeats(many))) == ENGINES


def test_an_engine_given_sigterm_alone_drains_and_is_started_again(many):
    """An operator's SIGTERM to one engine (a rollout): its streams end exactly as uninterrupted, the deployment
    serves on, and the launcher starts it again; only /stopService stops the deployment (it stopped it all)."""
    from tests.integration.test_failover import Streams

    expected = Streams(many.url, seeded=False)
    asyncio.run(expected.run())
    before = pid_of(many, "engine-1")
    streams = Streams(many.url, seeded=False)
    asyncio.run(streams.run(fault=lambda: os.kill(before, signal.SIGTERM)))
    assert not any(streams.errors) and streams.tokens == expected.tokens, (streams.errors, many.output[-30:])
    many.wait_for_line("switchboard: the engine-1 service stopped (exit 0); starting it again", 60)
    many.wait_for_line("switchboard: engine-1 is serving again", 120)
    assert pid_of(many, "engine-1") != before and many.proc.poll() is None
    assert not any("stopped by /stopService" in line for line in many.output)
    assert len(asyncio.run(heartbeats(many))) == ENGINES


def test_a_crash_looping_tokenizer_is_backed_off_while_its_peer_serves(many):
    """A child that dies more than 3 times in 120 s while a peer of its service serves does not stop the
    deployment (it did, the healthy peers with it): it is started again after a back-off, as Kubernetes does."""
    name = "tokenizer-1"

    def serving_again() -> int:
        return sum(line.startswith(f"switchboard: {name} is serving again") for line in many.output)

    for kill in range(4):  # three restarts, then the fourth death within the window
        before, count = pid_of(many, name), serving_again()
        os.kill(before, 9)
        if kill < 3:
            deadline = time.monotonic() + 120
            while serving_again() == count:
                assert time.monotonic() < deadline and many.proc.poll() is None, many.output[-20:]
                time.sleep(0.2)
    line = many.wait_for_line(f"switchboard: the {name} service exited with code -9 (3 restarts within 120s", 30)
    assert "its peers serve on, starting it again in 10s" in line, line
    for _ in range(3):  # served meanwhile by tokenizer-0
        r = httpx.post(many.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while serving_again() < 4:  # after the back-off
        assert time.monotonic() < deadline and many.proc.poll() is None, many.output[-20:]
        time.sleep(0.2)
    assert len(children(many.proc.pid)) == ENGINES + TOKENIZERS + 2


def test_sigterm_drains_the_streams_then_stops_every_child(many):
    """SIGTERM: the gateway takes no new connection, the streams it serves run to their ends (exactly as
    uninterrupted), then every child stops."""
    from tests.integration.test_failover import Streams

    pids = list(children(many.proc.pid))
    assert len(pids) == ENGINES + TOKENIZERS + 2
    expected = Streams(many.url, seeded=False)
    asyncio.run(expected.run())
    streams = Streams(many.url, seeded=False)
    asyncio.run(streams.run(fault=lambda: many.proc.send_signal(signal.SIGTERM)))
    assert not any(streams.errors) and streams.tokens == expected.tokens, (streams.errors, many.output[-30:])
    with pytest.raises(httpx.TransportError):
        httpx.get(many.url + "/v1/models", timeout=5)
    assert many.stop(timeout=30) == 0
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for pid in left:  # leave nothing behind for the next test, then fail
        os.kill(pid, 9)
    assert not left, f"children still running after SIGTERM: {left}"

