"""A sequence's KV cache as bytes, out of one engine and into another (prefill/decode disaggregation).

A prefill engine computes a prompt's K/V and its first token; a decode engine continues from there. What
moves is the prompt's K/V, block by block, in the cache's own layout: for each block, K then V of every
layer, ``[2, layers, kv_heads, block_size, head_dim]`` in the cache's dtype (720 KiB for a 16-token
block of SmolLM2-135M in float32), followed for an int8 cache by the positions' scales (``kv_cache.py``). A block is the unit because both caches are paged by it: the
receiver writes each chunk into one of its own blocks with one copy, and skips the blocks its prefix
cache already holds.

Both engines must run the same model with the same KV dtype and block size (``KvLayout``); a chunk that
does not fit is refused, and the receiver then recomputes the prompt instead (the request's tokens
are all it needs for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.kv_cache import token_bytes


@dataclass(frozen=True)
class KvLayout:
    """What a KV chunk's bytes mean; the sender's and the receiver's must be equal."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the cache's: the model's dtype, or int8

    @classmethod
    def of(cls, runner) -> KvLayout:
        k = runner.kv.k
        return cls(k.shape[0], k.shape[1], k.shape[3], runner.block_size, runner.kv.dtype_name)

    @property
    def fields(self) -> list:
        """As a message carries it (``KvPart.layout``, ``KvFetch.layout``): ``KvLayout(*fields)`` rebuilds it."""
        return [self.layers, self.kv_heads, self.head_dim, self.block_size, self.dtype]

    @property
    def chunk_bytes(self) -> int:
        dtype = getattr(torch, self.dtype)
        return self.block_size * token_bytes(self.layers, self.kv_heads, self.head_dim, dtype,
                                             "int8" if dtype == torch.int8 else "auto")


@dataclass
class KvImport:
    """K/V received for a sequence's first ``num_tokens`` positions, one chunk per block from block ``first``
    on (the receiver's prefix cache held the blocks before it when the transfer began), not yet written."""

    layout: KvLayout
    num_tokens: int
    chunks: list[bytes]
    first: int = 0


def export_blocks(runner, block_table: list[int], num_tokens: int) -> list[bytes]:
    """The K/V of positions [0, num_tokens) of the sequence holding ``block_table``, one chunk per block
    (the last block's positions past ``num_tokens`` travel too, and are overwritten at the receiver)."""
    count = -(-num_tokens // runner.block_size)
    return [runner.kv.block_bytes(block, runner.block_size) for block in block_table[:count]]


def import_blocks(runner, block_table: list[int], kv: KvImport, first: int = 0) -> int:
    """Write ``kv``'s chunks from block ``first`` on (earlier blocks hold a cached prefix already) into the
    sequence's blocks; the number of positions whose K/V are now in place. ValueError when the chunks do
    not fit this engine's cache (another model, dtype or block size) or the sequence's blocks, or when
    the blocks before ``kv.first`` (cached when the transfer began) are no longer cached."""
    layout = KvLayout.of(runner)
    if kv.layout != layout:
        raise ValueError(f"KV layout {kv.layout} does not match this engine's {layout}")
    if kv.first + len(kv.chunks) > len(block_table) or any(len(chunk) != layout.chunk_bytes for chunk in kv.chunks):
        raise ValueError("KV chunks do not fit the sequence's blocks")
    if first < kv.first:
        raise ValueError(f"blocks {first}..{kv.first - 1} were not sent and are no longer cached here")
    for chunk, block in list(zip(kv.chunks, block_table[kv.first:]))[first - kv.first:]:
        runner.kv.write_block(block, runner.block_size, chunk)
    return kv.num_tokens


PART_BYTES = 8 << 20  # K/V bytes per message at most: a few blocks at a time (the shipped bus takes 64 MiB)
HEADROOM = 64 << 10  # a message's bytes besides its chunks (ids, the layout, framing)


def chunks_per_part(chunk_bytes: int, max_payload: int | None) -> int:
    """How many K/V chunks (blocks) one message carries: within ``PART_BYTES`` and the bus's ``max_payload``
    (a nats-server without the shipped config takes 1 MiB); at least one."""
    limit = min(PART_BYTES, (max_payload or PART_BYTES) - HEADROOM)
    return max(1, limit // max(1, chunk_bytes))


def block_fits(chunk_bytes: int, max_payload: int | None) -> str:
    """"" when one K/V block fits in a message of the bus, else why not (said once, at start)."""
    if not max_payload or chunk_bytes + HEADROOM <= max_payload:
        return ""
    return (f"one K/V block is {chunk_bytes} bytes but the bus takes messages of {max_payload} bytes: prefill/decode "
            "handoffs and prefix pulls will be recomputed instead; run nats-server with max_payload: 64MB (as "
            "config/nats.conf does)")

