"""Prefix caching in the BlockManager: shared full blocks, reference counts, LRU eviction."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduled
from services.engine.sequence import Sequence
from shared.messages import Sampling

BLOCK = 16


def seq(token_ids: list[int], name: str = "s") -> Sequence:
    return Sequence(name, token_ids, Sampling(max_new_tokens=4))


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def admit(blocks: BlockManager, s: Sequence, num_tokens: int | None = None) -> Sequence:
    num_tokens = len(s) if num_tokens is None else num_tokens
    assert blocks.can_allocate(s, num_tokens)
    blocks.allocate(s, num_tokens)
    return s


def compute_all(blocks: BlockManager, s: Sequence) -> None:
    """What the engine does after a step that computed the rest of the sequence."""
    start, s.num_computed = s.num_computed, len(s)
    blocks.cache_computed(s, start)


def test_a_shared_prefix_is_computed_once_and_its_blocks_are_shared():
    blocks = BlockManager(16, BLOCK, enable_prefix_cache=True)
    prefix = tokens(3 * BLOCK)
    a = admit(blocks, seq(prefix + tokens(10, start=1), "a"))
    assert a.num_computed == 0
    compute_all(blocks, a)
    b = admit(blocks, seq(prefix + tokens(7, start=500), "b"))
    assert b.num_computed == 48
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] not in a.block_table
    assert (blocks.prefix_queried_tokens, blocks.prefix_hit_tokens) == (58 + 55, 48)
    assert blocks.num_free == 16 - 4 - 1
    blocks.check([a, b])


def test_a_prompt_of_whole_cached_blocks_still_computes_its_last_token():
    blocks = BlockManager(16, BLOCK, enable_prefix_cache=True)
    a = admit(blocks, seq(tokens(4 * BLOCK), "a"))
    compute_all(blocks, a)
    b = admit(blocks, seq(tokens(4 * BLOCK), "b"))
    assert b.num_computed == 3 * BLOCK
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert Scheduled(b, len(b) - b.num_computed).samples
    blocks.check([a, b])


def test_generated_tokens_fill_blocks_that_are_cached_too():
    blocks = BlockManager(16, BLOCK, enable_prefix_cache=True)
    a = admit(blocks, seq(tokens(BLOCK - 1), "a"), 2 * BLOCK)
    compute_all(blocks, a)
    a.append(7)  # sampled: position 15 is computed by the next (decode) step
    compute_all(blocks, a)
    b = admit(blocks, seq(tokens(BLOCK - 1) + [7, 8], "b"))
    assert b.num_computed == BLOCK and b.block_table[0] == a.block_table[0]


def test_an_earlier_block_that_differs_changes_every_later_key():
    blocks = BlockManager(16, BLOCK, enable_prefix_cache=True)
    a = admit(blocks, seq(tokens(3 * BLOCK + 1), "a"))
    compute_all(blocks, a)
    first_differs = seq([0] + tokens(3 * BLOCK)[1:] + [5], "b")
    second_differs = seq(tokens(BLOCK) + [0] + tokens(2 * BLOCK + 1)[BLOCK + 1:], "c")
    assert blocks.cached_tokens(first_differs) == 0
    assert blocks.cached_tokens(second_differs) == BLOCK
    assert first_differs.block_hashes[1:] and all(
        h not in a.block_hashes for h in first_differs.block_hashes)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    blocks = BlockManager(6, BLOCK, enable_prefix_cache=True)
    prompts = {name: tokens(BLOCK + 1, start=100 * i) for i, name in enumerate("pqr", 1)}
    for name, ids in prompts.items():  # each: one full cached block and one uncached
        s = admit(blocks, seq(ids, name))
        compute_all(blocks, s)
        blocks.free(s)
    assert blocks.num_free == 6
    again = admit(blocks, seq(prompts["p"], "p2"))  # p is the most recently used now
    assert again.num_computed == BLOCK
    blocks.free(again)
    big = admit(blocks, seq(tokens(4 * BLOCK, start=5000), "big"))  # 3 uncached blocks + 1 evicted
    assert [blocks.cached_tokens(seq(ids)) for ids in prompts.values()] == [BLOCK, 0, BLOCK]
    blocks.free(big)
    admit(blocks, seq(tokens(5 * BLOCK, start=7000), "bigger"))
    assert [blocks.cached_tokens(seq(ids)) for ids in prompts.values()] == [BLOCK, 0, 0]
    blocks.check()


def test_can_allocate_counts_revived_cached_blocks_as_spent():
    blocks = BlockManager(4, BLOCK, enable_prefix_cache=True)
    a = admit(blocks, seq(tokens(3 * BLOCK + 1), "a"))
    compute_all(blocks, a)
    blocks.free(a)  # 3 cached blocks evictable, 1 in the pool: all 4 free
    b = seq(tokens(3 * BLOCK) + [1], "b")
    assert blocks.can_allocate(b, len(b))  # 3 hits + 1 fresh
    assert not blocks.can_allocate(b, len(b) + BLOCK)  # 3 hits + 2 fresh: one too many
    admit(blocks, b)
    assert b.num_computed == 3 * BLOCK and blocks.num_free == 0
    blocks.check([b])


def test_a_prefix_computed_twice_at_once_is_cached_once():
    blocks = BlockManager(8, BLOCK, enable_prefix_cache=True)
    a = admit(blocks, seq(tokens(2 * BLOCK + 1), "a"))
    b = admit(blocks, seq(tokens(2 * BLOCK + 1), "b"))
    assert b.num_computed == 0  # a is not computed yet
    compute_all(blocks, a)
    compute_all(blocks, b)
    blocks.check([a, b])
    blocks.free(a)
    blocks.free(b)
    assert blocks.cached_tokens(seq(tokens(3 * BLOCK))) == 2 * BLOCK
    assert len(blocks.free_blocks) == 8
    blocks.check([])


def test_everything_freed_leaves_the_pool_whole_and_no_references():
    blocks = BlockManager(12, BLOCK, enable_prefix_cache=True)
    seqs = []
    for i in range(4):
        s = admit(blocks, seq(tokens(2 * BLOCK) + tokens(i + 1, start=50 * i), f"s{i}"), 3 * BLOCK)
        compute_all(blocks, s)
        seqs.append(s)
    blocks.check(seqs)
    assert [s.num_computed for s in seqs] == [len(s) for s in seqs]
    for s in seqs:
        blocks.free(s)
        assert s.block_table == [] and s.num_computed == 0
    assert blocks.num_free == 12
    assert sorted(blocks.free_blocks) == list(range(12))
    blocks.check([])


def test_disabled_shares_nothing_and_caches_nothing():
    blocks = BlockManager(16, BLOCK)
    prefix = tokens(3 * BLOCK)
    a = admit(blocks, seq(prefix + [1], "a"))
    compute_all(blocks, a)
    b = admit(blocks, seq(prefix + [2], "b"))
    assert b.num_computed == 0 and not set(a.block_table) & set(b.block_table)
    assert blocks.cached_tokens(seq(prefix + [3])) == 0
    assert (blocks.prefix_queried_tokens, blocks.prefix_hit_tokens) == (0, 0)
    blocks.free(a)
    blocks.free(b)
    assert sorted(blocks.free_blocks) == list(range(16))
    blocks.check([])


def test_blocks_before_a_prompts_first_media_token_are_the_texts_and_routers_key_them_alike():
    """K/V before an image attend to none of it: a text prompt's cached blocks serve an image prompt that begins
    with the same text, up to the block holding its first media token (from there the image's digest keys them),
    and the tokenizer's router keys the prompt as the engine's cache does."""
    from services.engine.multimodal import salts
    from services.tokenizer.routing import EngineRouter
    from shared.switchboard_config import RoutingConfig
    from shared.messages import EngineRequest, MediaInputs
    from shared.prefix_hash import chain, media_salt

    image_token = 7
    prompt = tokens(2 * BLOCK + 5) + [image_token] * 20 + tokens(12, start=50)
    blocks = BlockManager(32, BLOCK, enable_prefix_cache=True)
    text = admit(blocks, seq(prompt[:3 * BLOCK] + tokens(4, start=90), "text"))
    compute_all(blocks, text)
    req = EngineRequest(id="img", prompt_ids=prompt, sampling=Sampling(max_new_tokens=4), reply_to="x",
                        media=MediaInputs(tensors={}, digest="cat"))
    found = salts(req, frozenset({image_token}), BLOCK)
    assert (found.media_from, found.media) == (2, media_salt("cat"))
    image = seq(prompt, "img")
    image.media_from, image.media_salt = found.media_from, found.media
    admit(blocks, image)
    assert image.num_computed == 2 * BLOCK  # the two text blocks; the third holds the first image token
    router = EngineRouter(2.0, RoutingConfig(policy="cache"), BLOCK)
    routed = router.prefix_keys("", prompt, "cat", media_at=2 * BLOCK + 5)
    assert routed and routed == image.block_hashes[:len(routed)]
    assert chain(prompt, BLOCK)[:2] == image.block_hashes[:2] != chain(prompt, BLOCK)[2:3] + image.block_hashes[2:3]
