"""KV-cache blocks: a pool of fixed-size blocks, one block table per sequence, and a prefix cache.

With the prefix cache on, every full block a sequence has computed is keyed by a hash of its
tokens chained to the hash of the block before it, so one key names a whole prefix. A new sequence
starts from the longest chain of cached blocks matching its first tokens and shares those blocks
(reference-counted) instead of computing them again. A block nobody holds keeps its content and
its key until its space is needed: such *evictable* blocks are reused least recently used first,
after the blocks that never held a cached prefix.

A shared block is never written: matches are whole blocks and a sequence writes only positions at
or past ``seq.num_computed``, which lie in blocks it took fresh.

On an accelerator with a host tier (``host_tier.py``), an evicted block's K/V moves to host memory with its
key, and a match found there is copied back into a fresh block at admission. The cache's keys, as the fleet
sees them (journal, checksum, digest), are those of both tiers: moving between them changes nothing there.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext as _nothing
from typing import TYPE_CHECKING

from services.engine.sequence import Sequence
from shared.prefix_hash import block_hash, matchable_blocks

if TYPE_CHECKING:
    from services.engine.host_tier import HostTier


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False,
                 tier: HostTier | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._pool: deque[int] = deque(range(num_blocks))  # free, holding no cached prefix
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached; oldest use first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # block -> key, for blocks in the cache
        self._cached: dict[bytes, int] = {}  # key -> block
        self.prefix_queried_tokens = 0  # tokens of admitted sequences that were looked up
        self.prefix_hit_tokens = 0  # of those, tokens found cached
        self._journal: dict[bytes, bool] = {}  # keys that entered (True) or left (False) the cache since taken
        self._key_xor = 0  # the XOR of every cached key: with their count, what a router's view must match
        self.tier = tier  # evicted blocks' K/V in host memory (with the prefix cache on)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are taken when needed)."""
        return len(self._pool) + len(self._evictable)

    @property
    def free_blocks(self) -> list[int]:
        """Ids of the blocks no sequence holds."""
        return [*self._pool, *self._evictable]

    # ---- admission --------------------------------------------------------------------------

    def cached_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the cache holds now: what ``allocate`` would skip."""
        return len(self._match(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``allocate(seq, num_tokens)`` would find its blocks. Matched blocks that are
        evictable count as free now but stop being free once taken, so they are spent too; a match in the
        host tier needs a fresh block to come back into."""
        on_device = [block for _, block in self._match(seq) if block is not None]
        revived = sum(1 for block in on_device if self._refs[block] == 0)
        return self.num_free - revived >= blocks_for(num_tokens, self.block_size) - len(on_device)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` positions (the prompt, or its whole reserved length): the
        cached prefix shared (brought back from the host tier where it lies there), the rest fresh. Sets
        ``seq.num_computed`` to the cached tokens."""
        assert not seq.block_table, "sequence already holds blocks"
        matched = self._match(seq)
        for _, block in matched:
            if block is not None:
                self._take(block)
        hits = self._bring_back(matched)
        fresh = [self._take(self._pop_free()) for _ in range(blocks_for(num_tokens, self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_computed = len(hits) * self.block_size
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
        if self.enable_prefix_cache:
            self.prefix_queried_tokens += len(seq)
            self.prefix_hit_tokens += seq.num_computed

    def _match(self, seq: Sequence) -> list[tuple[bytes, int | None]]:
        """The keys and cached blocks (None: in the host tier) of the longest cached prefix of ``seq``, at most
        ``len(seq) - 1`` tokens: the last token is always computed, since sampling needs its logits."""
        if not self.enable_prefix_cache or seq.wants_prompt_logprobs:  # its prompt's logits are needed
            return []
        return self._run(self._hashes(seq, matchable_blocks(len(seq), self.block_size)))

    def _run(self, keys: list[bytes]) -> list[tuple[bytes, int | None]]:
        """The leading ``keys`` either tier holds, with their device blocks (None: in the host tier)."""
        run = []
        for key in keys:
            block = self._cached.get(key)
            if block is None and (self.tier is None or key not in self.tier):
                break
            run.append((key, block))
        return run

    def _bring_back(self, matched: list[tuple[bytes, int | None]]) -> list[int]:
        """The device blocks of a matched run, copying its host-tier blocks into fresh ones (taken). The run's
        host keys are held meanwhile: the evictions that free those blocks move other keys to the tier."""
        waiting = [key for key, block in matched if block is None]
        if not waiting:
            return [block for _, block in matched]
        blocks = []
        with self.tier.holding(waiting):
            for key, block in matched:
                if block is None:
                    block = self._take(self._pop_free())
                    self.tier.load(key, block)
                    self._cached[key], self._hash_of[block] = block, key
                blocks.append(block)
        return blocks

    def _hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """Keys of the first ``count`` (full) blocks of ``seq``, computed once per sequence."""
        size = self.block_size
        for i in range(len(seq.block_hashes), count):
            parent = (seq.block_hashes[i - 1] if i else seq.cache_salt) + (seq.media_salt if i == seq.media_from else b"")
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * size:(i + 1) * size]))
        return seq.block_hashes[:count]

    # ---- growth -----------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        return self._needs_block(seq) <= self.num_free

    def may_append(self, seq: Sequence) -> None:
        """Make room for the token the next decode step writes (position len-1)."""
        if self._needs_block(seq):
            seq.block_table.append(self._take(self._pop_free()))

    def _needs_block(self, seq: Sequence) -> int:
        return int(len(seq.block_table) < blocks_for(len(seq), self.block_size))

    def cache_computed(self, seq: Sequence, start: int) -> None:
        """``seq.num_computed`` grew from ``start``: put the blocks that became full into the
        cache. A block whose key another block already holds stays out (and is freed uncached)."""
        if not self.enable_prefix_cache:
            return
        first, end = start // self.block_size, seq.num_computed // self.block_size
        if first == end:
            return  # no block became full (most decode steps)
        keys = self._hashes(seq, end)
        for i in range(first, end):
            block = seq.block_table[i]
            if keys[i] not in self._cached and block not in self._hash_of:
                self._cache(keys[i], block)

    def _cache(self, key: bytes, block: int) -> None:
        self._cached[key] = block
        self._hash_of[block] = key
        if self.tier is not None and key in self.tier:  # computed again past a miss: the device copy wins
            self.tier.discard(key)
            return
        self._journal[key] = True
        self._key_xor ^= int.from_bytes(key, "big")

    def _forget(self, key: bytes) -> None:
        """``key`` left the cache (both tiers)."""
        self._journal[key] = False
        self._key_xor ^= int.from_bytes(key, "big")

    # ---- release ----------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Give back the sequence's blocks; its K/V now lives at most in the cache.

        Last block first, so a prefix's later blocks (shared less often) are evicted earlier."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed = 0

    def _take(self, block: int) -> int:
        self._refs[block] += 1
        self._evictable.pop(block, None)
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            self._pool.append(block)

    def _pop_free(self) -> int:
        """A free block: one holding no cached prefix if any, else the least recently used cached one."""
        if self._pool:
            return self._pool.popleft()
        block, _ = self._evictable.popitem(last=False)
        key = self._hash_of.pop(block)
        del self._cached[key]
        lost = key if self.tier is None else self.tier.store(key, block)
        if lost is not None:
            self._forget(lost)
        return block

    # ---- the cache across engines (fleet routing, prefix pulls) --------------------------------

    def take_journal(self) -> tuple[list[bytes], list[bytes]]:
        """The keys that entered and that left the cache since the last call (a key's last change wins)."""
        journal, self._journal = self._journal, {}
        return [k for k, stored in journal.items() if stored], [k for k, stored in journal.items() if not stored]

    def checksum(self) -> tuple[int, bytes]:
        """How many keys the cache holds and their XOR (shared.prefix_hash.checksum of ``cached_keys()``)."""
        return len(self._cached) + len(self.tier or ()), self._key_xor.to_bytes(16, "big")

    def cached_keys(self) -> list[bytes]:
        """Every key the cache holds now, in either tier (an engine's digest)."""
        return [*self._cached, *(self.tier.keys() if self.tier is not None else ())]

    def cached_run(self, keys: list[bytes]) -> int:
        """How many of the leading ``keys`` the cache holds (either tier), up to the first it lacks."""
        return len(self._run(keys))

    def run_bytes(self, keys: list[bytes], read: Callable[[int], bytes]) -> list[bytes]:
        """The K/V of the leading ``keys`` the cache holds: a device block's by ``read(block)``, a host one's
        from the tier."""
        return [self.tier.block_bytes(key) if block is None else read(block) for key, block in self._run(keys)]

    def import_prefix(self, keys: list[bytes], chunks: list[bytes], write, reserve: int = 0) -> int:
        """Cache K/V received for the blocks keyed ``keys`` (a prefix chain: ``chunks[i]`` is block ``keys[i]``'s,
        written into a free block by ``write(block, chunk)``), keeping ``reserve`` blocks free for the request
        that follows. Keys cached already are skipped; the rest go in as evictable blocks, used last. The
        number of leading keys now cached."""
        head = self._run(keys)  # the chain's head stays while its tail comes (host keys: in the tier, held)
        held = [self._take(block) for _, block in head if block is not None]
        room = max(0, self.num_free - reserve)
        count = len(head)
        with self.tier.holding([key for key in keys if key in self.tier]) if self.tier else _nothing():
            for key, chunk in list(zip(keys, chunks))[count:]:
                block = self._cached.get(key)  # a later block may be cached while an earlier one was evicted
                if block is None and self.tier is not None and key in self.tier:
                    count += 1  # stays in the tier until a request brings it back
                    continue
                if block is None:
                    if room == 0 or chunk is None:  # None: a block this engine held when the pull began
                        break
                    block, room = self._pop_free(), room - 1
                    write(block, chunk)
                    self._cache(key, block)
                held.append(self._take(block))
                count += 1
        for block in reversed(held):
            self._release(block)
        return count

    # ---- for tests --------------------------------------------------------------------------

    def check(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the invariants: every block is exactly one of held, free or evictable; cached
        keys and blocks map one to one; with ``seqs`` (every sequence holding blocks), each block's
        count is the number of their block tables it appears in."""
        pool, evictable = set(self._pool), set(self._evictable)
        held = {b for b, refs in enumerate(self._refs) if refs > 0}
        assert min(self._refs, default=0) >= 0, "negative reference count"
        assert len(pool) == len(self._pool), "a block is twice in the free pool"
        assert len(pool) + len(evictable) + len(held) == self.num_blocks, "a block is in two states"
        assert pool | evictable | held == set(range(self.num_blocks)), "a block is lost"
        assert not pool & self._hash_of.keys(), "a pool block is still cached"
        assert evictable <= self._hash_of.keys(), "an evictable block is not cached"
        assert {b: k for k, b in self._cached.items()} == self._hash_of, "cache maps disagree"
        if self.tier is not None:
            assert not set(self.tier.keys()) & self._cached.keys(), "a key is in both tiers"
        if seqs is not None:
            counts = Counter(b for seq in seqs for b in seq.block_table)
            assert all(counts[b] == refs for b, refs in enumerate(self._refs)), "reference counts are off"
