"""The static-buffer decode path (services/engine/graphs.py) gives exactly the ordinary step's tokens.

What a CUDA graph replays is this path: decode rows written into fixed buffers and padded to a size
of the ladder, padding rows reading and writing only the scratch block. Here it runs eagerly on the
CPU (``capture=False``) beside a runner without it, on mixed batches (prompt chunks beside decodes,
which run the ordinary way), LoRA rows (run the ordinary way), grammar masks and seeded sampling."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.engine.graphs import GraphPlan, sizes_for
from services.engine.model_runner import ModelRunner
from shared.grammar import json_schema
from shared.lora import Outcome
from tests.lora_adapters import make_adapter
from tests.unit.engine_helpers import (
    BLOCK,
    CPU,
    LOGPROB_ATOL,
    block_bytes,
    limits,
    outputs,
    prompt,
    request,
    run_until_idle,
)

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["id", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=3, r=4, alpha=8)


def runner(model_dir, adapter, graphs: GraphPlan | None) -> ModelRunner:
    r = ModelRunner(str(model_dir), CPU, block_size=BLOCK, kv_budget_bytes=64 * block_bytes(model_dir),
                    max_blocks=10_000, max_loras=2, max_lora_rank=8, graphs=graphs)
    assert r.lora.load("a", str(adapter)).outcome is Outcome.ADDED
    return r


@pytest.fixture(scope="module")
def runners(tiny_model_dir, adapter):
    plain = runner(tiny_model_dir, adapter, None)
    padded = runner(tiny_model_dir, adapter, GraphPlan(max_rows=8, max_seq_len=512, capture=False))
    return plain, padded


def requests():
    reqs = [
        request("greedy", prompt(5), max_new_tokens=30, logprobs=5, ignore_eos=True),
        request("seeded", prompt(23, start=200), max_new_tokens=26, do_sample=True, temperature=0.9, top_p=0.9,
                top_k=40, seed=5, logprobs=5, ignore_eos=True),
        request("penalised", prompt(40, start=50), max_new_tokens=21, repetition_penalty=1.3, logprobs=5,
                ignore_eos=True),
        request("json", prompt(11, start=400), max_new_tokens=40, do_sample=True, seed=9, logprobs=5,
                grammar=json_schema(SCHEMA)),
        request("adapter", prompt(17, start=120), max_new_tokens=12, logprobs=5, ignore_eos=True),
        request("late", prompt(70, start=10), max_new_tokens=8, logprobs=5, ignore_eos=True),
    ]
    reqs[4].adapter = "a"
    return reqs


def run(r: ModelRunner, reqs, **kw):
    engine = Engine(r, limits(**kw), {2})
    for req in reqs:
        engine.add_request(req)
    return run_until_idle(engine, check_blocks=True)


def assert_same(ours, theirs):
    a, b = outputs(ours), outputs(theirs)
    assert a.keys() == b.keys()
    for rid in a:
        assert [t for t, _, _ in a[rid]] == [t for t, _, _ in b[rid]], rid
        for (_, lp, top), (_, lp2, top2) in zip(a[rid], b[rid]):
            assert lp == pytest.approx(lp2, abs=LOGPROB_ATOL)
            assert top == pytest.approx(top2, abs=LOGPROB_ATOL)
    assert {rid: e.finish_reason for rid, e in ours.finish.items()} == {rid: e.finish_reason for rid, e in theirs.finish.items()}


@pytest.mark.parametrize("mix", [True, False])
def test_padded_decode_steps_give_the_ordinary_steps_tokens(runners, mix):
    plain, padded = runners
    kw = dict(mix=True, prefill_chunk_size=16) if mix else {}
    before = padded.graphs.steps
    theirs, ours = run(plain, requests(), **kw), run(padded, requests(), **kw)
    assert_same(ours, theirs)
    assert padded.graphs.steps - before >= 10  # most decode steps ran from the buffers, padded (6 rows -> 8, 5 -> 8, 3 -> 4)
    assert plain.graphs is None


def test_padding_rows_write_only_the_scratch_block(runners):
    """Three decode rows padded to 4: the padding row writes the scratch block, which no sequence owns, and
    no position outside the three requests' own blocks changes."""
    _, padded = runners
    assert padded.scratch_block == padded.num_blocks
    assert padded.k_cache.shape[2] == (padded.num_blocks + 1) * BLOCK
    padded.k_cache.zero_()
    engine = Engine(padded, limits(), {2})
    for i in range(3):
        engine.add_request(request(f"r{i}", prompt(6, start=100 * i), max_new_tokens=4, ignore_eos=True))
    steps, owned = padded.graphs.steps, set()
    while engine.has_work:
        engine.step()
        owned.update(b for seq in engine.seqs.values() for b in seq.block_table)
    assert padded.graphs.steps == steps + 3  # three decode steps, each 3 rows -> the size 4
    written = (padded.k_cache != 0).any(dim=-1).any(dim=1).any(dim=0).view(-1, BLOCK).any(dim=1)  # per block
    assert set(written.nonzero().flatten().tolist()) == owned | {padded.scratch_block}


def test_batches_larger_than_the_ladder_run_the_ordinary_way(tiny_model_dir, adapter):
    r = runner(tiny_model_dir, adapter, GraphPlan(max_rows=2, max_seq_len=512, capture=False))
    assert r.graphs.sizes == [1, 2]
    reqs = [request(f"r{i}", prompt(30, start=10 * i), max_new_tokens=14, ignore_eos=True) for i in range(3)]
    result = run(r, reqs)
    assert all(len(result.tokens[f"r{i}"]) == 14 for i in range(3))
    assert r.graphs.steps == 0  # three rows in every decode step


def test_positions_past_the_tables_run_the_ordinary_way(tiny_model_dir, adapter):
    r = runner(tiny_model_dir, adapter, GraphPlan(max_rows=2, max_seq_len=40, capture=False))
    assert r.graphs.max_position == 48  # three blocks of 16
    result = run(r, [request("r", prompt(40), max_new_tokens=14, ignore_eos=True)])
    assert len(result.tokens["r"]) == 14
    assert r.graphs.steps == 8  # decode steps at positions 40..47 from the buffers; 48..52 the ordinary way


def test_the_ladder():
    assert sizes_for(1) == [1]
    assert sizes_for(20) == [1, 2, 4, 8, 16, 20]
    assert sizes_for(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert sizes_for(5000)[-1] == 256
