"""A dead gateway's open requests (services/metrics/orphans.py), on a fake clock: ended as errors once its lease
runs out, each once; a gateway heard in time keeps its own; a stalled gateway's late ends are not counted again."""

from __future__ import annotations

from shared.ends import FinishReason
from shared.metrics_messages import Finished, Received
from services.metrics.orphans import Orphans


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def received(i: int, gateway: str) -> Received:
    return Received(id=f"r{i}", model="m", adapter="a" if i % 2 else "", api="tgi", gateway=gateway)


def end(i: int) -> Finished:
    return Finished(id=f"r{i}", model="m", arrival=0.0, e2e_s=1.0, ttft_s=0.1, prompt_tokens=3, generated_tokens=2,
                    finish_reason=FinishReason.EOS_TOKEN)


def test_a_dead_gateways_open_requests_end_as_errors_once():
    orphans = Orphans(2.0, clock := Clock())
    for i in range(3):
        orphans.received(received(i, "dead"))
    orphans.received(received(3, "alive"))
    assert orphans.finished(end(0))  # it ended itself
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        orphans.beat("alive")
    ends = orphans.expire()
    assert sorted((e.id, e.finish_reason, e.adapter, e.api) for e in ends) == [
        ("r1", FinishReason.ERROR, "a", "tgi"), ("r2", FinishReason.ERROR, "", "tgi")]
    assert orphans.expire() == []  # each once
    assert not orphans.finished(end(1))  # the gateway was only stalled: its late end is not counted again
    assert orphans.finished(end(3))  # the live gateway's own end
    clock.now = 10.0
    assert orphans.expire() == []  # the live one's lease ran out too, with nothing open


def test_a_heartbeat_keeps_a_gateways_requests_its_own():
    orphans = Orphans(2.0, clock := Clock())
    orphans.received(received(0, "g"))
    for t in range(1, 20):
        clock.now = float(t)
        orphans.beat("g")
        assert orphans.expire() == []
    assert orphans.finished(end(0)) and orphans.open["g"] == {} and orphans.owner == {}


def test_a_request_naming_no_gateway_is_not_watched():
    orphans = Orphans(2.0, clock := Clock())
    orphans.received(received(0, ""))
    clock.now = 5.0
    assert orphans.expire() == [] and orphans.finished(end(0))
