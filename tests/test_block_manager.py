"""Block manager: allocation arithmetic, growth, watermark, freeing, exhaustion."""

from __future__ import annotations

import pytest

from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.sequence import Sequence
from mtpspec.sampling_params import SamplingParams


def _seq(n: int = 3) -> Sequence:
    return Sequence("r", None, list(range(1, n + 1)), SamplingParams(), 0, 0.0)


def test_blocks_for_rounds_up() -> None:
    bm = BlockManager(10, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_free_and_no_double_ownership() -> None:
    bm = BlockManager(8, 4, watermark=0.0)
    a, b = _seq(), _seq()
    bm.grow(a, 5)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 6
    bm.grow(a, 8)  # still 2 blocks
    assert len(a.block_table) == 2
    bm.grow(b, 13)
    assert len(b.block_table) == 4 and not set(a.block_table) & set(b.block_table)
    bm.grow(a, 3)  # never shrinks
    assert len(a.block_table) == 2
    assert not bm.can_grow(a, 4 * 5)  # needs 3 more, 2 free
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(a, 4 * 5)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    bm.free(b)
    assert sorted(bm.free_blocks) == list(range(8))


def test_watermark_only_limits_new_sequences() -> None:
    bm = BlockManager(100, 2, watermark=0.05)
    s = _seq()
    assert bm.can_allocate(s, 2 * 95) and not bm.can_allocate(s, 2 * 96)
    bm.grow(s, 2 * 95)
    assert bm.can_grow(s, 2 * 100) and not bm.can_grow(s, 2 * 101)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
