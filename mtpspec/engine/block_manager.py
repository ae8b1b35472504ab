"""Paged KV-cache bookkeeping: a free list of blocks and one block table per sequence.

Block ``b`` holds positions ``[i * block_size, (i + 1) * block_size)`` of the sequence whose
table has ``b`` at index ``i``; the KV slot of position ``t`` is
``table[t // block_size] * block_size + t % block_size``. The same table addresses the target
layers' caches and the MTP layers' caches (both cache the same positions).
"""

from __future__ import annotations

from collections import deque
from typing import Deque

from mtpspec.engine.sequence import Sequence


class BlockManager:
    """Allocates and frees KV blocks.

    Args:
        num_blocks: blocks per layer cache (>= 1).
        block_size: tokens per block (>= 1).
        watermark: fraction of blocks a *new* sequence may not take (kept for running ones to
            grow into, so admitting a prefill does not immediately force a preemption).
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_blocks: Deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_slots: int) -> int:
        """Blocks needed to hold positions ``0 .. num_slots - 1``."""
        return -(-num_slots // self.block_size)

    def _missing(self, seq: Sequence, num_slots: int) -> int:
        return max(0, self.blocks_for(num_slots) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_slots: int) -> bool:
        """Whether a sequence without blocks can get ``num_slots`` slots, keeping the watermark."""
        return self.blocks_for(num_slots) <= self.num_free_blocks - self.watermark_blocks

    def can_grow(self, seq: Sequence, num_slots: int) -> bool:
        """Whether ``seq``'s table can be extended to cover ``num_slots`` slots."""
        return self._missing(seq, num_slots) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_slots: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_slots`` slots (never shrinks).

        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_grow` first).
        """
        missing = self._missing(seq, num_slots)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list."""
        for b in reversed(seq.block_table):
            self.free_blocks.appendleft(b)
        seq.block_table = []
