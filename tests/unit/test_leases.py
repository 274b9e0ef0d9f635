"""shared/leases.py on a fake clock: an instance lives while heard within its lease, for every watcher alike."""

from __future__ import annotations

import pytest

from shared.leases import Leases


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def leases(clock) -> Leases[str]:
    return Leases(2.0, clock)


def test_a_beat_makes_an_instance_live_until_its_lease_runs_out(leases, clock):
    assert leases.beat("a", "first") is True
    assert leases.is_live("a") and leases.get("a") == "first"
    clock.now += 2.0  # exactly one lease: still live
    assert leases.is_live("a")
    clock.now += 0.001
    assert not leases.is_live("a") and leases.get("a") is None and leases.live() == {}


def test_each_beat_renews_the_lease_and_keeps_the_last_word(leases, clock):
    leases.beat("a", "first")
    for word in ("second", "third"):
        clock.now += 1.5
        assert leases.beat("a", word) is False  # already live: not news
    clock.now += 1.9
    assert leases.get("a") == "third"


def test_an_instance_back_after_its_lease_ran_out_is_news_again(leases, clock):
    leases.beat("a", "first")
    clock.now += 5
    assert leases.beat("a", "back") is True
    assert leases.get("a") == "back"


def test_live_lists_only_instances_within_their_lease(leases, clock):
    leases.beat("old", 1)
    clock.now += 1.5
    leases.beat("new", 2)
    assert leases.live() == {"old": 1, "new": 2}
    clock.now += 1.0
    assert leases.live() == {"new": 2}


def test_expire_forgets_the_dead_and_names_each_once(leases, clock):
    leases.beat("a", 1)
    leases.beat("b", 2)
    clock.now += 1.5
    leases.beat("b", 3)
    clock.now += 1.0
    assert leases.expire() == ["a"]
    assert leases.expire() == []
    assert leases.live() == {"b": 3}



def test_an_instance_not_heard_yet_is_gone_only_a_lease_after_it_was_named(leases, clock):
    """An engine a tokenizer routed to (or a prefill engine handed to) may be new to this watcher: its first
    heartbeat may still be on its way, so it is given a lease from when it was named."""
    named = clock.now
    clock.now += 2.0
    assert not leases.is_gone("new", named)
    clock.now += 0.001
    assert leases.is_gone("new", named)
    leases.beat("new", "first")  # heard: its own lease counts from then, whenever it was named
    clock.now += 2.0
    assert not leases.is_gone("new", named)
    clock.now += 0.001
    assert leases.is_gone("new", named) and leases.is_gone("new", clock.now)


def test_heard_since_says_whether_any_instance_spoke_after_a_moment(leases, clock):
    assert not leases.heard_since(50.0)  # nobody heard yet
    leases.beat("a", "x")
    back = clock.now
    assert not leases.heard_since(back)  # heard at that moment, not after it
    clock.now += 0.5
    leases.beat("b", "y")
    assert leases.heard_since(back) and not leases.heard_since(clock.now)


def test_a_deployments_stop_waits_for_every_gateways_requests():
    """/stopService's drain: another live gateway's heartbeat must say it stops and has nothing in flight (the
    engines' figures alone lagged a heartbeat: a stream of the other gateway was cut once in CI)."""
    from types import SimpleNamespace

    from services.gateway.admin.stop import drained, unaware
    from shared.messages import Heartbeat

    gateways = Leases(2.0)
    me = SimpleNamespace(instance="a", inflight=[], engine_info=lambda: None, roles=SimpleNamespace(gateways=gateways))
    gateways.beat("a", Heartbeat(service="gateway", instance="a", stopping=True))
    gateways.beat("b", Heartbeat(service="gateway", instance="b"))
    assert not drained(me) and unaware(me)  # b has not heard of the stop yet
    gateways.beat("b", Heartbeat(service="gateway", instance="b", stopping=True, in_flight=1))
    assert not drained(me) and not unaware(me)  # b stops, one request of its own still running
    gateways.beat("b", Heartbeat(service="gateway", instance="b", stopping=True))
    assert drained(me)
