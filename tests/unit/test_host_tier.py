"""The prefix cache's host tier (services/engine/host_tier.py): evicted blocks keep their K/V and key in host
memory and come back on a hit, exactly; the fleet's view of the cache (journal, checksum, digest) spans both
tiers; a full tier drops its least recently stored block, announced as gone; pulls are served from it. On
these machines the tier runs over a cpu cache (the copies are the same ``copy_`` calls, without pinning); a
cpu engine refuses the setting, since its cache is host memory already."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.engine import Engine
from services.engine.host_tier import HostTier
from services.engine.kv_cache import KvCache
from services.engine.sequence import Sequence
from services.engine.build import check_host_tier, host_blocks
from shared.config import parse_config
from shared.messages import Sampling
from shared.prefix_hash import chain, checksum
from tests.conftest import DEFAULT_CONFIG
from tests.unit.engine_helpers import (
    BLOCK, TOP, alone, assert_same_outputs, limits, make_runner, prompt, request, run_until_idle,
)

LAYERS, HEADS, DIM = 2, 2, 8


def cache(num_blocks: int, kv_dtype: str = "auto") -> KvCache:
    kv = KvCache(LAYERS, HEADS, (num_blocks + 1) * BLOCK, DIM, torch.float32, kv_dtype, torch.device("cpu"))
    kv.k.copy_(torch.randn(kv.k.shape).to(kv.k.dtype) if kv_dtype == "auto" else torch.randint(-127, 127, kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape).to(kv.v.dtype) if kv_dtype == "auto" else torch.randint(-127, 127, kv.v.shape))
    if kv.quantized:
        kv.k_scale.copy_(torch.rand(kv.k_scale.shape))
        kv.v_scale.copy_(torch.rand(kv.v_scale.shape))
    return kv


def computed(blocks: BlockManager, kv: KvCache, ids: list[int], name: str) -> tuple[Sequence, dict[bytes, bytes]]:
    """A sequence admitted and computed (its fresh blocks given new K/V), and each full block's bytes by key."""
    seq = Sequence(name, ids, Sampling(max_new_tokens=4))
    blocks.allocate(seq, len(seq))
    for block in seq.block_table[seq.num_computed // BLOCK:]:
        span = slice(block * BLOCK, (block + 1) * BLOCK)
        kv.k[:, :, span] = torch.randn(kv.k[:, :, span].shape).to(kv.k.dtype)
    start, seq.num_computed = seq.num_computed, len(seq)
    blocks.cache_computed(seq, start)
    keys = chain(ids, BLOCK)
    return seq, {key: kv.block_bytes(seq.block_table[i], BLOCK) for i, key in enumerate(keys)}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_evicted_blocks_come_back_from_the_host_tier_with_their_kv(kv_dtype):
    kv = cache(8, kv_dtype)
    tier = HostTier(kv, BLOCK, capacity=4)
    blocks = BlockManager(8, BLOCK, enable_prefix_cache=True, tier=tier)
    first = prompt(3 * BLOCK + 5, start=100)
    seq, before = computed(blocks, kv, first, "a")
    blocks.free(seq)
    blocks.take_journal()
    other, _ = computed(blocks, kv, prompt(8 * BLOCK, start=900), "b")  # every device block: a's go to the tier
    stored, removed = blocks.take_journal()
    assert removed == [] and len(stored) == 8 and set(tier.keys()) == set(before)  # still cached, for the fleet
    assert checksum(blocks.cached_keys()) == blocks.checksum() and blocks.checksum()[0] == 11
    assert blocks.run_bytes(chain(first, BLOCK), lambda b: kv.block_bytes(b, BLOCK)) == list(before.values())
    blocks.free(other)
    again = Sequence("a2", first + [7], Sampling(max_new_tokens=4))
    assert blocks.cached_tokens(again) == 3 * BLOCK and blocks.can_allocate(again, len(again))
    blocks.allocate(again, len(again))
    assert again.num_computed == 3 * BLOCK and tier.loaded == 3
    assert [kv.block_bytes(b, BLOCK) for b in again.block_table[:3]] == list(before.values())
    assert blocks.take_journal() == ([], [])  # moving between the tiers changes nothing the fleet sees
    assert checksum(blocks.cached_keys()) == blocks.checksum()
    blocks.check([again])


def test_a_full_tier_drops_its_oldest_block_and_announces_it():
    kv = cache(4)
    tier = HostTier(kv, BLOCK, capacity=2)
    blocks = BlockManager(4, BLOCK, enable_prefix_cache=True, tier=tier)
    old = prompt(4 * BLOCK, start=100)
    blocks.free(computed(blocks, kv, old, "a")[0])
    blocks.take_journal()
    blocks.free(computed(blocks, kv, prompt(4 * BLOCK, start=500), "b")[0])  # a's 4 blocks out, 2 fit the tier
    stored, removed = blocks.take_journal()
    assert len(stored) == 4 and len(removed) == 2 and len(tier) == 2 and tier.dropped == 2
    assert set(removed) | set(tier.keys()) == set(chain(old, BLOCK))
    assert checksum(blocks.cached_keys()) == blocks.checksum() and blocks.checksum()[0] == 6
    blocks.check()


def test_a_block_computed_again_leaves_the_tier():
    kv = cache(4)
    tier = HostTier(kv, BLOCK, capacity=8)
    blocks = BlockManager(4, BLOCK, enable_prefix_cache=True, tier=tier)
    ids = prompt(2 * BLOCK + 1, start=100)
    blocks.free(computed(blocks, kv, ids, "a")[0])
    blocks.free(computed(blocks, kv, prompt(4 * BLOCK, start=500), "b")[0])
    assert len(tier) == 2
    blocks.take_journal()
    seq = Sequence("c", ids, Sampling(max_new_tokens=4))
    seq.wants_prompt_logprobs = True  # matches nothing: its blocks are computed again
    blocks.allocate(seq, len(seq))
    start, seq.num_computed = seq.num_computed, len(seq)
    blocks.cache_computed(seq, start)
    assert not set(chain(ids, BLOCK)) & set(tier.keys()) and len(tier) == 3  # b's blocks moved out for c
    assert blocks.take_journal() == ([], [])  # every key was cached all along
    assert checksum(blocks.cached_keys()) == blocks.checksum()
    blocks.check([seq])


def test_an_engine_with_a_host_tier_gives_the_tokens_of_one_without(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=6)
    first = prompt(3 * BLOCK + 5, start=600)
    prompts = {"a": first, "b": prompt(5 * BLOCK, start=40), "a2": first + prompt(4, start=300)}
    expected = alone(runner, prompts, 8)
    engine = Engine(runner, limits(), set(), prefix_cache=True, host_blocks=8)
    run, hits = None, []
    for rid, ids in prompts.items():
        engine.add_request(request(rid, ids, max_new_tokens=8, logprobs=TOP))
        run = run_until_idle(engine, run, check_blocks=True)
        hits.append(engine.blocks.prefix_hit_tokens)
    assert_same_outputs(run, expected)
    assert hits == [0, 0, 3 * BLOCK] and engine.blocks.tier.loaded == 3  # a2's prefix came back from the tier


def test_a_cpu_engine_refuses_a_host_tier():
    data = json.loads(DEFAULT_CONFIG.read_text())
    data["Switchboard"] = {**data.get("Switchboard", {}), "hostKvCacheMemoryMb": 512}
    cfg = parse_config(json.dumps(data).encode())
    with pytest.raises(ValueError, match="hostKvCacheMemoryMb: the engine runs on cpu"):
        check_host_tier(cfg, "cpu")
    check_host_tier(cfg, "cuda")
    data["BackendConfig"]["ScheduleConfig"]["enablePrefixCache"] = False
    with pytest.raises(ValueError, match="enablePrefixCache"):
        check_host_tier(parse_config(json.dumps(data).encode()), "cuda")


def test_a_host_budget_is_counted_in_whole_blocks_and_one_holding_none_is_refused():
    from types import SimpleNamespace

    data = json.loads(DEFAULT_CONFIG.read_text())
    data["Switchboard"] = {**data.get("Switchboard", {}), "hostKvCacheMemoryMb": 1}
    cfg = parse_config(json.dumps(data).encode())
    small = SimpleNamespace(block_bytes=2 * LAYERS * HEADS * BLOCK * DIM * 4)  # K and V of a block, float32
    assert host_blocks(small, cfg) == (1 << 20) // (2 * LAYERS * HEADS * BLOCK * DIM * 4)
    big = SimpleNamespace(block_bytes=8 << 20)  # e.g. 64 layers x 8 heads x 16 x 128 x 2 x 4 bytes
    with pytest.raises(ValueError, match=r"hostKvCacheMemoryMb: 1 MiB holds no K/V block of this model \(8388608"):
        host_blocks(big, cfg)
