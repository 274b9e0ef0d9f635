"""Prefill/decode handoff between two engines in one process (the engine half of PD disaggregation): a
prefill engine computes the prompt and the first token and exports the prompt's K/V block by block; a
decode engine writes them into its own blocks and continues. Greedy and seeded outputs equal a
co-located run token for token, and the decode engine computes no prompt token (no silent re-prefill);
its prefix cache shortens what it writes; K/V that do not fit are refused and the prompt recomputed."""

from __future__ import annotations

import msgspec
import pytest

from services.engine.engine import Engine
from services.engine.kv_transfer import KvImport, KvLayout
from tests.unit.engine_helpers import Run, assert_pool_whole, limits, make_runner, prompt, request, run_until_idle

NEW = 24
PROMPTS = {"a": prompt(40), "b": prompt(17, start=300), "c": prompt(5, start=700)}


@pytest.fixture(scope="module")
def decode_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, 64)


def reqs(**sampling) -> list:
    return [request(rid, ids, max_new_tokens=NEW, ignore_eos=True, **sampling) for rid, ids in PROMPTS.items()]


def co_located(runner, **sampling) -> Run:
    engine = Engine(runner, limits(), set())
    for req in reqs(**sampling):
        engine.add_request(req)
    return run_until_idle(engine)


def handed_off(prefill_runner, decode_runner, decode_kw=None, tamper=lambda kv: kv, decode=None, **sampling):
    """Prefill on one engine, decode on the other (``decode``, or a new one with a prefix cache); (what the
    client saw per request, the decode engine)."""
    prefill = Engine(prefill_runner, limits(), set())
    for req in reqs(**sampling):
        prefill.add_request(msgspec.structs.replace(req, handoff=True))
    first = run_until_idle(prefill)
    assert_pool_whole(prefill)
    assert all(reason is None for reason in map(first.reason, PROMPTS))  # no finish: they go on elsewhere
    decode = decode or Engine(decode_runner, limits(**(decode_kw or {})), set(), prefix_cache=True)
    for handoff in prefill.take_handoffs():
        req = msgspec.structs.replace(handoff.request, generated_ids=handoff.generated_ids, handoff=False)
        decode.add_handoff(req, tamper(handoff.kv))
    rest = run_until_idle(decode, check_blocks=True)
    return {rid: first.tokens[rid] + rest.tokens[rid] for rid in PROMPTS}, decode


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_handoff_continues_exactly_and_computes_no_prompt_token(tiny_runner, decode_runner, sampling):
    expected = co_located(tiny_runner, **sampling).tokens
    tokens, decode = handed_off(tiny_runner, decode_runner, **sampling)
    assert tokens == expected
    assert decode.stats.prompt_tokens == 0
    assert decode.stats.generation_tokens == len(PROMPTS) * (NEW - 1)


def test_mix_decode_engine_and_its_prefix_cache(tiny_runner, decode_runner):
    expected = co_located(tiny_runner).tokens
    decode = Engine(decode_runner, limits(mix=True, prefill_chunk_size=16), set(), prefix_cache=True)
    for req in reqs():  # the decode engine computed these prompts before: its cache holds their full blocks
        decode.add_request(msgspec.structs.replace(req, id=f"warm-{req.id}"))
    run_until_idle(decode)
    computed = decode.stats.prompt_tokens
    tokens, decode = handed_off(tiny_runner, decode_runner, decode=decode)
    assert tokens == expected
    assert decode.stats.prompt_tokens == computed  # the handoffs computed no prompt token
    assert decode.blocks.prefix_hit_tokens >= 32 + 16  # "a" and "b" found their full blocks: not written again


def test_kv_that_do_not_fit_are_refused_and_the_prompt_recomputed(tiny_runner, decode_runner):
    expected = co_located(tiny_runner).tokens

    def other_dtype(kv: KvImport) -> KvImport:
        layout = KvLayout(kv.layout.layers, kv.layout.kv_heads, kv.layout.head_dim, kv.layout.block_size, "bfloat16")
        return KvImport(layout, kv.num_tokens, kv.chunks)

    tokens, decode = handed_off(tiny_runner, decode_runner, tamper=other_dtype)
    assert tokens == expected
    assert decode.stats.prompt_tokens == sum(len(ids) + 1 for ids in PROMPTS.values())  # recomputed with the first token


@pytest.fixture(scope="module")
def int8_runners(tiny_model_dir):
    """A prefill and a decode runner with int8 K/V (Switchboard.kvCacheDtype "int8")."""
    from services.engine.model_runner import ModelRunner
    from tests.unit.engine_helpers import BLOCK, CPU

    def runner():
        return ModelRunner(str(tiny_model_dir), CPU, block_size=BLOCK, kv_budget_bytes=8 << 20, max_blocks=64,
                           kv_cache_dtype="int8")
    return runner(), runner()


def test_int8_kv_hands_off_exactly(int8_runners):
    prefill_runner, decode_runner = int8_runners
    expected = co_located(prefill_runner).tokens
    tokens, decode = handed_off(prefill_runner, decode_runner)
    assert tokens == expected
    assert decode.stats.prompt_tokens == 0


def test_kv_of_another_kv_dtype_is_refused_and_the_prompt_recomputed(tiny_runner, int8_runners):
    """A float32 prefill engine and an int8 decode engine: the chunks do not fit; the decode engine recomputes."""
    expected = co_located(int8_runners[1]).tokens
    tokens, decode = handed_off(tiny_runner, int8_runners[1])
    assert tokens == expected
    assert decode.stats.prompt_tokens == sum(len(ids) + 1 for ids in PROMPTS.values())


def _warm(runner) -> Engine:
    """A decode engine that computed these prompts before: its prefix cache holds their full blocks."""
    decode = Engine(runner, limits(), set(), prefix_cache=True)
    for req in reqs():
        decode.add_request(msgspec.structs.replace(req, id=f"warm-{req.id}"))
    run_until_idle(decode)
    return decode


def _send_uncached(prefill_runner, decode: Engine, probe: Engine) -> tuple[dict, int]:
    """Hand each request to ``decode`` with only the chunks past the blocks ``probe`` holds (what the bus
    transfer sends after asking); (the tokens the client saw, blocks not sent)."""
    prefill = Engine(prefill_runner, limits(), set())
    for req in reqs():
        prefill.add_request(msgspec.structs.replace(req, handoff=True))
    first = run_until_idle(prefill)
    skipped = 0
    for handoff in prefill.take_handoffs():
        req = msgspec.structs.replace(handoff.request, generated_ids=handoff.generated_ids, handoff=False)
        cached, kv = probe.cached_blocks(req), handoff.kv
        skipped += cached
        decode.add_handoff(req, KvImport(kv.layout, kv.num_tokens, kv.chunks[cached:], first=cached))
    rest = run_until_idle(decode, check_blocks=True)
    return {rid: first.tokens[rid] + rest.tokens[rid] for rid in PROMPTS}, skipped


def test_only_the_blocks_the_decode_engine_lacks_travel(tiny_runner, decode_runner):
    expected = co_located(tiny_runner).tokens
    decode = _warm(decode_runner)
    computed = decode.stats.prompt_tokens
    tokens, skipped = _send_uncached(tiny_runner, decode, decode)
    assert skipped == 2 + 1  # "a" (40 tokens) has 2 full blocks cached there, "b" (17) 1, "c" (5) none
    assert tokens == expected
    assert decode.stats.prompt_tokens == computed  # nothing recomputed


def test_blocks_evicted_since_the_transfer_began_are_recomputed(tiny_runner, decode_runner):
    expected = co_located(tiny_runner).tokens
    probe = _warm(decode_runner)  # said it held them; the engine that admits them does not
    decode = Engine(decode_runner, limits(), set(), prefix_cache=True)
    tokens, skipped = _send_uncached(tiny_runner, decode, probe)
    assert skipped == 3 and tokens == expected
    assert decode.stats.prompt_tokens >= len(PROMPTS["a"]) + len(PROMPTS["b"])  # those two were recomputed
