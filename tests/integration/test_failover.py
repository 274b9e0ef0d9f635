"""Failover with nothing lost: killed engines and tokenizers, a restarted nats-server.

Each service runs as its own process on a real nats-server (tests/integration/cluster.py); faults
are real: SIGKILL by the process's own pid, a nats-server stopped and started again. Every stream
must end exactly as an uninterrupted run of the same request (greedy or seeded), or with an
explicit error event — never a silently shortened or altered text.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import Cluster

TOKENS = 160
STREAMS = 8


def params(i: int, seeded: bool, tokens: int) -> dict:
    """TGI parameters of stream ``i``: greedy, or sampling with a seed of its own."""
    out = {"max_new_tokens": tokens}
    if seeded:
        out.update(do_sample=True, temperature=0.9, top_k=50, seed=1000 + i)
    return out


def body(i: int, seeded: bool) -> dict:
    return {"inputs": f"Request number {i}: once upon a time", "parameters": params(i, seeded, TOKENS)}


class Streams:
    """STREAMS concurrent TGI streams; what each received, and when."""

    def __init__(self, base: str, seeded: bool):
        self.base = base
        self.seeded = seeded
        self.tokens: list[list[int]] = [[] for _ in range(STREAMS)]
        self.errors: list[list[dict]] = [[] for _ in range(STREAMS)]
        self.ended_at: list[float | None] = [None] * STREAMS

    async def one(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", self.base + "/generate_stream", json=body(i, self.seeded)) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            self.errors[i].append(event)
                        else:
                            self.tokens[i].append(event["token"]["id"])
        self.ended_at[i] = time.monotonic()

    async def run(self, fault=None, after_tokens: int = 15) -> None:
        """Run all streams; once each has ``after_tokens`` tokens, call ``fault()`` (on this thread: a process it
        starts dies with the thread that started it, see switchboard.natsd.die_with_parent)."""
        tasks = [asyncio.create_task(self.one(i)) for i in range(STREAMS)]
        if fault is not None:
            deadline = time.monotonic() + 60
            while min(len(t) for t in self.tokens) < after_tokens and not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, "the streams never got going"
                await asyncio.sleep(0.01)
            fault()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)


def reference(cluster: Cluster, seeded: bool) -> list[list[int]]:
    streams = Streams(cluster.base, seeded)
    asyncio.run(streams.run())
    assert not any(streams.errors), streams.errors
    return streams.tokens


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir, engines=2, tokenizers=2)
    try:
        yield c.wait_ready()
    finally:
        c.stop()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_an_engine_killed_mid_stream_loses_nothing(cluster, seeded):
    expected = reference(cluster, seeded)
    streams = Streams(cluster.base, seeded)
    asyncio.run(streams.run(fault=lambda: cluster.kill("engine-0")))
    assert not any(streams.errors), (streams.errors, cluster.log_tails())
    assert streams.tokens == expected, cluster.log_tails()


def test_a_tokenizer_killed_mid_stream_loses_nothing(cluster):
    expected = reference(cluster, seeded=False)
    streams = Streams(cluster.base, seeded=False)
    asyncio.run(streams.run(fault=lambda: cluster.kill("tokenizer-0")))
    assert not any(streams.errors), (streams.errors, cluster.log_tails())
    assert streams.tokens == expected, cluster.log_tails()


def test_a_rolling_engine_restart_loses_nothing(cluster):
    """Each engine in turn gets SIGTERM (it drains: no new request is routed to it, its running ones finish)
    and is started again, while streams run; every stream is exact."""
    expected = reference(cluster, seeded=False)
    for round_no, name in enumerate(("engine-0", "engine-1")):
        streams = Streams(cluster.base, seeded=False)
        asyncio.run(streams.run(fault=lambda: cluster.procs[name].terminate()))
        assert cluster.procs[name].wait(60) == 0
        assert not any(streams.errors), (streams.errors, cluster.log_tails())
        assert streams.tokens == expected, cluster.log_tails()
        cluster.start(name)
        cluster.wait_started(name, times=2)


def test_nats_restarted_mid_stream_every_stream_exact_or_an_explicit_error(cluster):
    expected = reference(cluster, seeded=False)
    streams = Streams(cluster.base, seeded=False)
    asyncio.run(streams.run(fault=lambda: cluster.restart_nats()))
    for got, errors, want in zip(streams.tokens, streams.errors, expected):
        if errors:  # ended explicitly; what came before the error is an exact prefix
            assert got == want[: len(got)]
        else:
            assert got == want, cluster.log_tails()
    assert sum(not e for e in streams.errors) >= STREAMS // 2, (streams.errors, cluster.log_tails())
    ok = httpx.post(cluster.base + "/generate", json=body(0, False), timeout=60)
    assert ok.status_code == 200 and ok.json()["generated_text"], ok.text  # every service is back


def test_requests_sent_as_nats_goes_down_get_a_503_within_two_leases_and_serve_once_it_is_back(cluster):
    """The bus gone: a request sent in its first second (the leases have not run out yet, so the gateway admits it)
    gets its 503 once the fleet has been silent a lease and one more brought nobody back (not after the 30 s
    start timeout), naming the bus; once nats-server is back, requests are served."""
    lease = 2.0
    cluster.nats.stop()
    down = time.monotonic()
    late = asyncio.run(sent_after(cluster.base, down, [0.1, 0.5, 1.0, 1.5]))
    assert all(status == 503 and took < 2 * lease + 1.5 for _, status, took in late), late
    cluster.nats.start()
    deadline = time.monotonic() + 30
    while (r := httpx.post(cluster.base + "/generate", json=body(0, False), timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, (r.text, cluster.log_tails())
        assert "message bus" in r.json()["error"] or "no engine" in r.json()["error"], r.text
        time.sleep(0.5)


async def sent_after(base: str, since: float, offsets: list[float]) -> list[tuple[float, int, float]]:
    """A /generate sent at each of ``offsets`` seconds after ``since``: (offset, status, seconds to answer)."""
    async def one(offset: float) -> tuple[float, int, float]:
        await asyncio.sleep(max(0.0, since + offset - time.monotonic()))
        sent = time.monotonic()
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(base + "/generate", json=body(0, False))
        return offset, r.status_code, time.monotonic() - sent

    return list(await asyncio.gather(*(one(o) for o in offsets)))


def test_the_last_engine_late_loses_nothing_and_killed_errors_within_5s(tmp_path, tiny_model_dir):
    """The only engine frozen past its lease (an overloaded machine) and heard again within one more lease: its
    streams resume on it, exact. Killed: the streams it ran end in an error once its lease ran out and one more
    lease brought no engine; requests sent while its lease runs out (the gateway may still admit them) get their
    503 within two leases plus one second; after it, at once."""
    cluster = Cluster(tmp_path, tiny_model_dir, engines=1, tokenizers=1)
    lease = 2.0
    try:
        cluster.wait_ready()
        expected = reference(cluster, seeded=False)
        engine = cluster.procs["engine-0"].pid
        late = Streams(cluster.base, seeded=False)
        asyncio.run(late.run(fault=lambda: (os.kill(engine, signal.SIGSTOP),
                                            threading.Timer(lease + 0.6, os.kill, (engine, signal.SIGCONT)).start())))
        assert not any(late.errors), (late.errors, cluster.log_tails())
        assert late.tokens == expected, cluster.log_tails()
        streams = Streams(cluster.base, seeded=False)
        killed = []

        async def scenario() -> list[tuple[float, int, float]]:
            running = asyncio.create_task(streams.run(fault=lambda: (cluster.kill("engine-0"),
                                                                     killed.append(time.monotonic()))))
            while not killed and not running.done():
                await asyncio.sleep(0.01)
            late = await sent_after(cluster.base, killed[0], [0.25 * i for i in range(8)])
            await running
            return late

        late = asyncio.run(scenario())
        assert all(errors for errors in streams.errors), streams.errors
        assert all(e[-1]["error_type"] == "unavailable" for e in streams.errors), streams.errors
        assert max(streams.ended_at) - killed[0] < 2 * lease + 1.0, [t - killed[0] for t in streams.ended_at]
        assert all(status == 503 and took < 2 * lease + 1.0 for _, status, took in late), late
        with httpx.Client(timeout=10) as client:  # made first: a new client's TLS setup alone takes ~25 ms here
            started = time.monotonic()
            r = client.post(cluster.base + "/generate", json=body(0, False))
            took = time.monotonic() - started
        assert r.status_code == 503 and took < 0.5, (took, r.text)  # at once, not after a timeout
    finally:
        cluster.stop()


async def engines_idle_within(nats_url: str, model: str, seconds: float) -> float:
    """Seconds until every engine's heartbeat shows nothing running or waiting (fails after ``seconds``)."""
    import nats
    import msgspec

    from shared import subjects
    from shared.messages import EngineInfo

    latest: dict[str, EngineInfo] = {}
    nc = await nats.connect(nats_url)

    async def on_beat(msg) -> None:
        info = msgspec.msgpack.decode(msg.data, type=EngineInfo)
        latest[info.instance] = info

    await nc.subscribe(subjects.engine_heartbeat(model), cb=on_beat)
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            await asyncio.sleep(0.1)
            if latest and all(i.running == 0 and i.waiting == 0 for i in latest.values()):
                return time.monotonic() - started
        raise AssertionError(f"engines still busy {seconds} s after the gateway died: {latest}")
    finally:
        await nc.close()


def test_a_dead_gateways_requests_are_cancelled(tmp_path, tiny_model_dir):
    cluster = Cluster(tmp_path, tiny_model_dir, engines=1, tokenizers=1,
                      **{"BackendConfig.ScheduleConfig": {"maxIterTimes": 2500}})
    try:
        cluster.wait_ready()
        model = json.loads(cluster.config.read_text())["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0][
            "modelName"]

        async def scenario() -> float:
            long = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 20000}}

            async def one() -> None:
                async with httpx.AsyncClient(timeout=60) as client:
                    async with client.stream("POST", cluster.base + "/generate_stream", json=long) as r:
                        async for _ in r.aiter_lines():
                            pass

            streams = [asyncio.create_task(one()) for _ in range(4)]
            await asyncio.sleep(1.0)  # all four are generating
            cluster.kill("gateway")
            await asyncio.gather(*streams, return_exceptions=True)  # their connections are gone
            return await engines_idle_within(cluster.url, model, seconds=6.0)

        assert asyncio.run(scenario()) < 6.0
        # its four requests are counted ended, as errors, once its lease ran out: received minus finished is what
        # is in flight (they were received and never finished); a new gateway's /metrics says so
        cluster.start("gateway")
        cluster.wait_ready()
        port = json.loads(cluster.config.read_text())["ServerConfig"]["metricsPort"]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        counts = {s.name + s.labels.get("finished_reason", ""): s.value
                  for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("api") == "tgi"}
        assert (counts["request_received_total"], counts["request_failed_total"],
                counts["request_finished_totalerror"]) == (4, 4, 4), counts
    finally:
        cluster.stop()


def test_a_tokenizer_frozen_before_it_answers_does_not_hold_requests(tmp_path, tiny_model_dir):
    """SIGSTOP one of two tokenizers: the requests NATS hands it are asked again once its lease runs out,
    and every request is answered long before the 30 s start timeout."""
    cluster = Cluster(tmp_path, tiny_model_dir, engines=1, tokenizers=2)
    frozen = None
    try:
        cluster.wait_ready()
        frozen = cluster.procs["tokenizer-0"]
        os.kill(frozen.pid, signal.SIGSTOP)

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(cluster.base + "/generate", json={
                    "inputs": f"Request {i}", "parameters": {"max_new_tokens": 4}}) for i in range(6)))

        started = time.monotonic()
        replies = asyncio.run(scenario())
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        assert time.monotonic() - started < 15.0
    finally:
        if frozen is not None:
            os.kill(frozen.pid, signal.SIGKILL)
        cluster.stop()
