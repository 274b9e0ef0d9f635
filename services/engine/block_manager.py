"""KV-cache blocks: a pool of fixed-size blocks and one block table per sequence."""

from __future__ import annotations

from collections import deque

from services.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_free >= blocks_for(num_tokens, self.block_size)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` positions: the prompt, or its whole reserved length."""
        assert not seq.block_table, "sequence already holds blocks"
        seq.block_table = [self.free_blocks.popleft() for _ in range(blocks_for(num_tokens, self.block_size))]

    def can_append(self, seq: Sequence) -> bool:
        return self._needs_block(seq) <= self.num_free

    def may_append(self, seq: Sequence) -> None:
        """Make room for the token the next decode step writes (position len-1)."""
        if self._needs_block(seq):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def _needs_block(self, seq: Sequence) -> int:
        return int(len(seq.block_table) < blocks_for(len(seq), self.block_size))
