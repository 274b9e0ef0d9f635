"""The prefix cache's second tier on accelerators: K/V blocks evicted from device memory go to a bounded LRU
in pinned host memory (``Switchboard.hostKvCacheMemoryMb``) and come back on a hit instead of being computed
again. A CPU engine's cache is host memory already: it has one tier, and the setting is refused there.

The tiers are exclusive: a key is on the device or here, never both. The copies are queued on the device's
current stream (``non_blocking`` from and to pinned memory), the stream every step runs on, so they are
ordered with the steps that write and read the same blocks without a wait: an evicted block's copy out runs
before the step that reuses the block writes it; a hit's copy in runs before the step that reads it. Only a
read of the host copy by the CPU (a fleet pull served from this tier) waits for the stream.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

import torch

from services.engine.kv_cache import SCALE_DTYPE, KvCache, pack_block


class HostTier:
    def __init__(self, kv: KvCache, block_size: int, capacity: int):
        device = kv.k.device
        self.kv, self.block_size, self.capacity = kv, block_size, capacity
        self.pinned = device.type != "cpu"  # page-locked: copies to and from the device run asynchronously
        layers, heads, _, dim = kv.k.shape
        shape = (capacity, layers, heads, block_size, dim)
        self.k = torch.empty(shape, dtype=kv.k.dtype, pin_memory=self.pinned)
        self.v = torch.empty(shape, dtype=kv.k.dtype, pin_memory=self.pinned)
        scales = (capacity, layers, heads, block_size) if kv.quantized else (0,)
        self.k_scale = torch.empty(scales, dtype=SCALE_DTYPE, pin_memory=self.pinned)
        self.v_scale = torch.empty(scales, dtype=SCALE_DTYPE, pin_memory=self.pinned)
        self._free = list(range(capacity))
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> host slot, least recently stored first
        self._held: set[bytes] = set()  # keys that must not be dropped now (being brought back)
        self.loaded = self.dropped = 0  # blocks brought back, and lost for room

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[bytes]:
        return list(self._slots)

    @contextmanager
    def holding(self, keys: list[bytes]) -> Iterator[None]:
        """While the block runs, ``keys`` stay here whatever is stored meanwhile."""
        self._held.update(keys)
        try:
            yield
        finally:
            self._held.difference_update(keys)

    def store(self, key: bytes, block: int) -> bytes | None:
        """Copy device block ``block`` (keyed ``key``) here, before the block is reused. Returns the key that
        left the cache for it: the least recently stored one when the tier is full, ``key`` itself when no
        slot can be had; None when nothing was lost."""
        lost = None
        if not self._free:
            victim = next((k for k in self._slots if k not in self._held), None)
            if victim is None:
                return key
            self._free.append(self._slots.pop(victim))
            lost, self.dropped = victim, self.dropped + 1
        slot = self._free.pop()
        for host, device in self._pairs(slot, block):
            host.copy_(device, non_blocking=self.pinned)
        self._slots[key] = slot
        return lost

    def load(self, key: bytes, block: int) -> None:
        """Copy ``key``'s K/V back into device block ``block``; the key leaves this tier."""
        slot = self._slots.pop(key)
        for host, device in self._pairs(slot, block):
            device.copy_(host, non_blocking=self.pinned)
        self._free.append(slot)
        self.loaded += 1

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (the device computed the block again)."""
        self._free.append(self._slots.pop(key))

    def block_bytes(self, key: bytes) -> bytes:
        """``key``'s block as ``KvCache.block_bytes`` writes a device block (a fleet pull served from here)."""
        self._sync()
        slot = self._slots[key]
        scales = (self.k_scale[slot], self.v_scale[slot]) if self.kv.quantized else None
        return pack_block(self.k[slot], self.v[slot], scales)

    def _pairs(self, slot: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host slot ``slot``'s tensors with device block ``block``'s views: K, V and (int8) their scales."""
        span = slice(block * self.block_size, (block + 1) * self.block_size)
        pairs = [(self.k[slot], self.kv.k[:, :, span]), (self.v[slot], self.kv.v[:, :, span])]
        if self.kv.quantized:
            pairs += [(self.k_scale[slot], self.kv.k_scale[:, :, span]), (self.v_scale[slot], self.kv.v_scale[:, :, span])]
        return pairs

    def _sync(self) -> None:
        if self.pinned:  # copies to pinned memory may still be queued on the device's stream
            getattr(torch, self.kv.k.device.type).current_stream().synchronize()
