"""Routing by load: the least loaded live engine that is not stopping; a burst is spread."""

from __future__ import annotations

from collections import Counter

from services.tokenizer.routing import EngineRouter
from shared.messages import Adapter, EngineInfo


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(instance: str, running: int = 0, waiting: int = 0, free: int = 100, stopping: bool = False,
         adapters: tuple[str, ...] = (), unloading: tuple[str, ...] = ()) -> EngineInfo:
    return EngineInfo(model="m", loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=100,
                      free_blocks=free, running=running, waiting=waiting, instance=instance, stopping=stopping,
                      adapters=[Adapter(a, f"/lora/{a}") for a in adapters], unloading=list(unloading))


def pick(router: EngineRouter, adapter: str = "") -> str | None:
    choice = router.choose(adapter)
    return None if choice is None else choice.engine


def test_the_least_loaded_engine_gets_the_request():
    router = EngineRouter(2.0)
    router.heartbeat(info("a", running=6))
    router.heartbeat(info("b", running=1))
    assert pick(router) == "b"


def test_a_burst_between_heartbeats_is_spread_evenly():
    router = EngineRouter(2.0)
    router.heartbeat(info("a"))
    router.heartbeat(info("b"))
    assert Counter(pick(router) for _ in range(8)) == {"a": 4, "b": 4}


def test_ties_on_requests_go_to_the_engine_with_more_free_blocks():
    router = EngineRouter(2.0)
    router.heartbeat(info("a", free=10))
    router.heartbeat(info("b", free=90))
    assert pick(router) == "b"


def test_stopping_and_dead_engines_get_nothing():
    clock = Clock()
    router = EngineRouter(2.0, clock=clock)
    router.heartbeat(info("a", stopping=True))
    assert pick(router) is None
    router.heartbeat(info("b"))
    assert pick(router) == "b"
    clock.now += 2.5  # b's lease runs out
    assert pick(router) is None
    router.heartbeat(info("c"))  # a new engine takes load from its first heartbeat
    assert pick(router) == "c"


def test_a_lora_request_goes_only_to_engines_that_list_its_adapter():
    router = EngineRouter(2.0)
    router.heartbeat(info("a", adapters=("x",), running=6))
    router.heartbeat(info("b", running=0))
    router.heartbeat(info("c", adapters=("x", "y"), running=3))
    assert pick(router, "x") == "c"  # the least loaded of those with it
    assert pick(router, "y") == "c"
    assert pick(router) == "b"  # the base model runs anywhere


def test_an_adapter_nobody_lists_or_still_unloading_gets_no_engine():
    router = EngineRouter(2.0)
    router.heartbeat(info("a", unloading=("x",)))
    assert pick(router, "x") is None
    assert pick(router, "z") is None
    assert list(router.serving()) == ["a"]  # engines serve: the tokenizer answers "not loaded" at once
