"""The prefix cache's block keys, the same in every process: an engine keys its cached K/V blocks by them,
announces them (``CacheEvents``), and the tokenizer's router hashes a request's prompt the same way to
find which engine holds the longest prefix of it.

A key names a whole prefix: block i's key hashes its tokens chained to block i-1's key, and the first
block's parent is the request's salt: its LoRA adapter's weights digest (``services/engine/lora.py``, listed
in the engines' heartbeats) followed by its client's ``cache_salt``; its media's digest joins the parent of
the block that holds its first media token. A cryptographic hash: Python's ``hash()``
collides on purpose-made inputs, and a collision would hand one request another's cached K/V.
"""

from __future__ import annotations

import hashlib


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block after the block keyed ``parent`` (the salt, b"" by default, for the first)."""
    return hashlib.blake2b(parent + repr(token_ids).encode(), digest_size=16).digest()


def chain(token_ids: list[int], block_size: int, salt: bytes = b"", count: int | None = None,
          media: tuple[int, bytes] = (-1, b"")) -> list[bytes]:
    """Keys of the first ``count`` full blocks of ``token_ids`` (all of them by default). ``media``: the block
    holding a prompt's first media token and its media's salt, which joins that block's parent (the blocks
    before it are the text's alone: the same K/V as a prompt without the media)."""
    full = len(token_ids) // block_size if count is None else min(count, len(token_ids) // block_size)
    keys: list[bytes] = []
    for i in range(full):
        parent = (keys[-1] if keys else salt) + (media[1] if i == media[0] else b"")
        keys.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return keys


def matchable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt a cache hit may cover: the last token is always computed (its
    logits are sampled), so at most ``num_tokens - 1`` tokens."""
    return max(0, num_tokens - 1) // block_size


def media_salt(digest: str) -> bytes:
    """What joins the parent of the block holding a request's first media token (their preprocessed tensors'
    digest): K/V from an image on are that image's own, though its placeholder tokens are the same for any
    image. The blocks before it are the text's alone, shared with every prompt that begins so."""
    return hashlib.blake2b(digest.encode(), digest_size=16).digest()


def client_salt(cache_salt: str) -> bytes:
    """The first block's parent's part for a client's ``cache_salt`` (vLLM's field): requests share cached K/V
    only with requests giving the same salt, so one tenant cannot time another's prompts through the cache."""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode(), digest_size=16).digest() if cache_salt else b""


def checksum(keys) -> tuple[int, bytes]:
    """How many keys and their XOR: an engine's cache and a router's view of it agree when these do."""
    xor, count = 0, 0
    for key in keys:
        xor ^= int.from_bytes(key, "big")
        count += 1
    return count, xor.to_bytes(16, "big")
