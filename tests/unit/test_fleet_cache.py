"""The prefix cache across engines: the keys a BlockManager announces (its journal and digest), the same
keys computed outside the engine (shared.prefix_hash), and K/V blocks imported from another engine."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence
from shared.messages import Sampling
from shared.prefix_hash import chain, matchable_blocks

BLOCK = 16


def run(blocks: BlockManager, ids: list[int], name: str) -> Sequence:
    s = Sequence(name, ids, Sampling(max_new_tokens=4))
    blocks.allocate(s, len(s))
    start, s.num_computed = s.num_computed, len(s)
    blocks.cache_computed(s, start)
    return s


def test_the_journal_announces_the_keys_the_router_computes():
    blocks = BlockManager(8, BLOCK, enable_prefix_cache=True)
    ids = list(range(100, 100 + 3 * BLOCK + 5))
    s = run(blocks, ids, "a")
    stored, removed = blocks.take_journal()
    assert stored == chain(ids, BLOCK) and removed == [] and len(stored) == 3
    assert blocks.take_journal() == ([], [])
    assert sorted(blocks.cached_keys()) == sorted(stored)
    blocks.free(s)
    run(blocks, list(range(900, 900 + 8 * BLOCK)), "b")  # needs every block: the cached ones are evicted
    stored2, removed2 = blocks.take_journal()
    assert sorted(removed2) == sorted(stored) and len(stored2) == 8
    assert set(blocks.cached_keys()) == set(stored2)
    blocks.check()


def test_matchable_blocks_leave_the_last_token_to_compute():
    assert matchable_blocks(2 * BLOCK, BLOCK) == 1 and matchable_blocks(2 * BLOCK + 1, BLOCK) == 2
    assert matchable_blocks(0, BLOCK) == 0


def test_imported_blocks_are_matched_by_the_next_request():
    source = BlockManager(8, BLOCK, enable_prefix_cache=True)
    ids = list(range(7, 7 + 4 * BLOCK + 3))
    run(source, ids, "a")
    keys = chain(ids, BLOCK)
    assert source.cached_run(keys) == 4
    target = BlockManager(8, BLOCK, enable_prefix_cache=True)
    written = {}
    count = target.import_prefix(keys, [b"k%d" % i for i in range(4)], written.__setitem__, reserve=2)
    assert count == 4 and sorted(written.values()) == [b"k0", b"k1", b"k2", b"k3"]
    assert target.take_journal()[0] == keys and target.num_free == 8  # cached, held by nobody
    again = Sequence("b", ids + [1, 2], Sampling(max_new_tokens=4))
    target.allocate(again, len(again))
    assert again.num_computed == 4 * BLOCK and target.cached_run(keys) == 4
    assert sorted(written) == sorted(again.block_table[:4])  # the imported blocks, shared
    target.check([again])


def test_an_import_keeps_its_reserve_and_skips_what_is_cached():
    target = BlockManager(6, BLOCK, enable_prefix_cache=True)
    ids = list(range(50, 50 + 5 * BLOCK))
    keys = chain(ids, BLOCK)
    target.free(run(target, ids[:2 * BLOCK + 1], "head"))  # the first two blocks are cached here already
    target.take_journal()
    written = {}
    count = target.import_prefix(keys, [b"x"] * 5, written.__setitem__, reserve=3)
    assert count == 3 and len(written) == 1  # 4 free past the two cached, 3 kept for the request
    assert target.cached_run(keys) == 3
    target.check()


# ---- the router's views and decisions -------------------------------------------------------------

from services.tokenizer.cache_views import CacheViews  # noqa: E402
from services.tokenizer.routing import EngineRouter  # noqa: E402
from shared.fleet_messages import CacheEvents  # noqa: E402
from shared.messages import EngineInfo  # noqa: E402
from shared.prefix_hash import checksum  # noqa: E402
from shared.switchboard_config import RoutingConfig  # noqa: E402


def beat(instance: str, running: int = 0, seq: int = 0, keys: list[bytes] = ()) -> EngineInfo:
    count, xor = checksum(keys)
    return EngineInfo(model="m", loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=100,
                      free_blocks=100, running=running, waiting=0, instance=instance, block_size=BLOCK,
                      cache_seq=seq, cache_count=count, cache_xor=xor)


def router(policy: str = "mix", gap: int = 4, pull: int = 2 * BLOCK) -> EngineRouter:
    return EngineRouter(2.0, RoutingConfig(policy=policy, max_load_gap=gap, pull_min_tokens=pull), BLOCK)


CONVERSATION = list(range(3000, 3000 + 6 * BLOCK + 1))
KEYS = chain(CONVERSATION, BLOCK, count=matchable_blocks(len(CONVERSATION), BLOCK))


def holding(r: EngineRouter, instance: str, keys: list[bytes], running: int = 0) -> None:
    r.heartbeat(beat(instance, running))
    assert not r.caches.apply(CacheEvents(instance, 1, stored=keys))


def test_the_next_turn_goes_to_the_engine_holding_the_history():
    r = router()
    holding(r, "a", KEYS, running=2)
    r.heartbeat(beat("b"))
    choice = r.choose("", KEYS)
    assert choice.engine == "a" and choice.hit_blocks == len(KEYS) == choice.best_blocks and not choice.pull_from
    by_load = router("load")
    holding(by_load, "a", KEYS, running=2)
    by_load.heartbeat(beat("b"))
    assert by_load.choose("", KEYS).engine == "b"


def test_a_shared_prefix_does_not_pile_onto_one_engine_past_the_load_gap():
    r = router(gap=3)
    holding(r, "a", KEYS)
    r.heartbeat(beat("b"))
    engines = [r.choose("", KEYS).engine for _ in range(12)]
    assert engines[:5] == ["a"] * 4 + ["b"]  # a full hit outweighs the load up to the gap, never past it
    weighed = EngineRouter(2.0, RoutingConfig(load_weight=1.0, max_load_gap=3), BLOCK)
    holding(weighed, "a", KEYS)
    weighed.heartbeat(beat("b"))
    assert [weighed.choose("", KEYS).engine for _ in range(4)] == ["a"] * 3 + ["b"]  # weight 1: a tie at the gap
    queued = {e: engines.count(e) for e in "ab"}
    assert abs(queued["a"] - queued["b"]) <= 3 + 1 and queued["b"] >= 4  # the gap is checked before each request


def test_the_chosen_engine_pulls_a_long_prefix_from_a_busy_holder():
    r = router(gap=2)
    holding(r, "a", KEYS, running=6)  # holds it all, but 6 requests over b
    r.heartbeat(beat("b"))
    choice = r.choose("", KEYS)
    assert choice.engine == "b" and choice.pull_from == "a" and choice.best_blocks == len(KEYS)
    short = router(gap=2, pull=10 * BLOCK)  # a prefix shorter than pullMinTokens is computed
    holding(short, "a", KEYS, running=6)
    short.heartbeat(beat("b"))
    assert short.choose("", KEYS).pull_from == ""


def test_views_ask_for_a_digest_when_an_event_is_lost_or_they_disagree():
    views = CacheViews()
    assert not views.check(beat("a"))  # fresh engine: an empty view
    assert not views.apply(CacheEvents("a", 1, stored=KEYS[:2]))
    assert views.apply(CacheEvents("a", 3, stored=KEYS[2:4]))  # number 2 was lost
    assert views.check(beat("a", seq=3, keys=KEYS[:5]))  # and the heartbeat disagrees at the same number
    views.apply(CacheEvents("a", 3, stored=KEYS[:5], digest=True))
    assert not views.check(beat("a", seq=3, keys=KEYS[:5])) and views.hit_blocks("a", KEYS) == 5
    assert not views.apply(CacheEvents("a", 2, stored=KEYS))  # older than the digest: ignored
    assert views.hit_blocks("a", KEYS) == 5
    assert not views.check(beat("a", seq=4, keys=KEYS))  # behind once: events may be in flight
    assert views.check(beat("a", seq=4, keys=KEYS))  # behind a whole heartbeat: lost
    assert views.check(beat("late", seq=9, keys=KEYS))  # a router that started late asks at once


def test_a_dead_or_restarted_engine_is_not_credited():
    clock_now = [100.0]
    r = EngineRouter(2.0, RoutingConfig(), BLOCK, clock=lambda: clock_now[0])
    holding(r, "a", KEYS)
    r.heartbeat(beat("b"))
    clock_now[0] += 2.5  # a's lease runs out (b beats again)
    r.heartbeat(beat("b"))
    assert "a" not in r.caches.views and r.choose("", KEYS).engine == "b"
    r.heartbeat(beat("a2"))  # a restarted engine is a new instance with an empty view
    assert r.caches.hit_blocks("a2", KEYS) == 0


# ---- a block's bytes, in every cache dtype ----------------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402

from services.engine.kv_cache import KvCache  # noqa: E402


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                             (torch.bfloat16, "int8")])
def test_a_blocks_bytes_write_back_exactly(dtype, kv_dtype):
    """What a holder sends (block_bytes) and a puller writes (write_block): bfloat16 has no numpy dtype."""
    source = KvCache(2, 3, 4 * BLOCK, 8, dtype, kv_dtype, torch.device("cpu"))
    target = KvCache(2, 3, 4 * BLOCK, 8, dtype, kv_dtype, torch.device("cpu"))
    torch.manual_seed(0)
    for t in (source.k, source.v):
        t.copy_(torch.randn(t.shape).to(t.dtype) if kv_dtype == "auto" else torch.randint(-127, 128, t.shape))
    if kv_dtype == "int8":
        source.k_scale.copy_(torch.rand(source.k_scale.shape))
        source.v_scale.copy_(torch.rand(source.v_scale.shape))
    target.write_block(2, BLOCK, source.block_bytes(1, BLOCK))
    span, into = slice(BLOCK, 2 * BLOCK), slice(2 * BLOCK, 3 * BLOCK)
    assert torch.equal(target.k[:, :, into], source.k[:, :, span]) and torch.equal(target.v[:, :, into], source.v[:, :, span])
    if kv_dtype == "int8":
        assert torch.equal(target.k_scale[:, :, into], source.k_scale[:, :, span])


def test_an_adapters_salt_is_its_weights_digest_the_same_on_every_engine():
    from services.engine.lora import weights_digest
    from services.engine.lora_files import AdapterWeights
    from shared.messages import Adapter

    torch.manual_seed(1)
    matrices = {(0, "q_proj"): (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16))}
    same = AdapterWeights("/a", 4, {k: (a.clone(), b.clone()) for k, (a, b) in matrices.items()})
    other = AdapterWeights("/b", 4, {k: (a.clone(), b * 2) for k, (a, b) in matrices.items()})
    salt = weights_digest(AdapterWeights("/a", 4, matrices))
    assert weights_digest(same) == salt != weights_digest(other) and len(salt) == 16
    r = router()
    for instance in ("a", "b"):
        info = beat(instance)
        info.adapters = [Adapter("x", "/a", salt), Adapter("y", f"/{instance}", weights_digest(same if instance == "a"
                                                                                               else other))]
        r.heartbeat(info)
    assert r.adapter_salt("x") == salt and r.adapter_salt("y") is None and r.adapter_salt("z") is None
