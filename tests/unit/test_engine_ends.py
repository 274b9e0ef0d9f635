"""Every way a request can end in the engine releases everything it held exactly once and says so once.

The ends: length, EOS, cancel, a deadline passing, a step failing for it (isolation), a handoff to a decode
engine (its first token reported, no end here: it goes on elsewhere), every request failed at once, and a
refusal at admission. Each request runs with a LoRA adapter and a grammar where the end allows, so the
checks cover the KV blocks, the adapter slot, the grammar matcher, the handoff state and the registry."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.engine.engine import Engine
from services.engine.model_runner import ModelRunner
from shared.grammar import json_schema
from shared.lora import Outcome
from shared.messages import Sampling
from tests.lora_adapters import make_adapter
from tests.unit.engine_helpers import BLOCK, CPU, block_bytes, limits, prompt, request

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory):
    r = ModelRunner(str(tiny_model_dir), CPU, block_size=BLOCK, kv_budget_bytes=48 * block_bytes(tiny_model_dir),
                    max_blocks=10_000, max_loras=1, max_lora_rank=8)
    adapter = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=5, r=4, alpha=8)
    assert r.lora.load("a", str(adapter)).outcome is Outcome.ADDED
    return r


def with_adapter(req):
    req.adapter = "a"
    return req


def drive(engine: Engine, act=lambda step, engine: None, max_steps: int = 200):
    """Step until idle, calling ``act`` before each step; every event, and every sequence ever registered."""
    events, seen = [], {}
    for step in range(max_steps):
        act(step, engine)
        if not engine.has_work:
            break
        events += engine.step()
        seen.update(engine.seqs)
    return events, seen


def assert_released(engine: Engine, runner: ModelRunner, seen: dict) -> None:
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.blocks.num_free == runner.num_blocks
    engine.blocks.check([])
    assert runner.lora.slots["a"].users == 0
    for seq in seen.values():
        assert seq.matcher is None and seq.request is None and seq.kv_import is None, seq.id


def ends(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        if e.finish_reason is not None:
            out.setdefault(e.id, []).append(e)
    return out


def test_every_end_releases_once_and_reports_once(runner):
    probe = with_adapter(request("probe", prompt(9), max_new_tokens=1))
    first = drive(Engine(runner, limits(), set()), lambda s, e: s or e.add_request(probe))[0]
    eos = first[0].token_ids[0]  # the greedy first token for this prompt and adapter: made an end-of-sequence token
    engine = Engine(runner, limits(max_batch_size=8), {eos})
    reqs = [
        with_adapter(request("length", prompt(12, 300), max_new_tokens=4, ignore_eos=True)),
        with_adapter(request("eos", prompt(9), max_new_tokens=30)),
        with_adapter(request("cancel", prompt(20, 50), max_new_tokens=50, ignore_eos=True, grammar=json_schema(SCHEMA))),
        with_adapter(request("deadline", prompt(8, 70), max_new_tokens=50, ignore_eos=True, deadline=time.time() + 600)),
        with_adapter(request("poison", prompt(10, 90), max_new_tokens=50, ignore_eos=True, grammar=json_schema(SCHEMA))),
        msgspec.structs.replace(request("handoff", prompt(17, 400), max_new_tokens=20, ignore_eos=True,
                                        grammar=json_schema(SCHEMA)), handoff=True),
    ]

    def act(step, engine):
        if step == 0:
            for req in reqs:
                engine.add_request(req)
        if step == 3:
            engine.abort("cancel")
            engine.seqs["deadline"].deadline = time.time() - 1
            engine.seqs["poison"].sampling = Sampling(do_sample=True, top_p=float("nan"), max_new_tokens=50)

    events, seen = drive(engine, act)
    got = ends(events)
    assert {rid: [e.finish_reason for e in evs] for rid, evs in got.items()} == {
        "length": ["length"], "eos": ["eos_token"], "cancel": ["cancelled"], "deadline": ["error"], "poison": ["error"]}
    assert "timeout" in got["deadline"][0].error.message and "NaN" in got["poison"][0].error.message
    handed = engine.take_handoffs()
    assert [h.request.id for h in handed] == ["handoff"]
    assert [e.token_ids for e in events if e.id == "handoff"] == [handed[0].generated_ids]  # its first token, no end
    for rid in got:  # nothing after the end
        last = max(i for i, e in enumerate(events) if e.id == rid)
        assert events[last].finish_reason is not None
    assert_released(engine, runner, seen)


def test_fail_all_and_refusals_release_once(runner):
    engine = Engine(runner, limits(), set())
    for i in range(3):
        engine.add_request(with_adapter(request(f"r{i}", prompt(10 + i, 20 * i), max_new_tokens=40, ignore_eos=True,
                                                grammar=json_schema(SCHEMA) if i else None)))
    engine.add_request(request("too-long", prompt(8), max_new_tokens=48 * BLOCK * 2, ignore_eos=True))
    engine.add_request(with_adapter(msgspec.structs.replace(request("missing", prompt(8)), adapter="nope")))
    events = engine.step() + engine.step()
    seen = dict(engine.seqs)
    events += engine.fail_all("engine failure: the device is gone")
    got = ends(events)
    assert {rid: len(evs) for rid, evs in got.items()} == {"r0": 1, "r1": 1, "r2": 1, "too-long": 1, "missing": 1}
    assert all(e.finish_reason == "error" for evs in got.values() for e in evs)
    assert engine.fail_all("again") == []  # nothing is ended twice
    assert_released(engine, runner, seen)
