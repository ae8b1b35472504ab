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


# ------------------------------------------------------------------------------------ prefix caching
from mtpspec.engine.block_manager import CacheHit  # noqa: E402
from mtpspec.engine.block_pool import BlockKey, BlockPool, hash_block_tokens  # noqa: E402


def _tok_seq(tokens, logprobs=None) -> Sequence:
    return Sequence("r", None, list(tokens), SamplingParams(prompt_logprobs=logprobs), 0, 0.0)


def _computed(bm: BlockManager, seq: Sequence, num_computed: int, out=()) -> None:
    """Pretend the engine computed ``num_computed`` positions (and emitted ``out``), MTP entries included."""
    seq.output_token_ids.extend(out)
    seq.num_computed_tokens = seq.mtp_len = num_computed
    bm.cache_full_blocks(seq)


def test_block_hash_chains_over_every_earlier_token() -> None:
    a = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, (1, 2)) == a and hash_block_tokens(None, [1, 3]) != a
    b = hash_block_tokens(a, [5, 6])
    assert b != hash_block_tokens(hash_block_tokens(None, [1, 3]), [5, 6])  # same block, other prefix
    assert hash_block_tokens(a, [5, 6], ("salt",)) != b  # the extra-keys hook
    bm = BlockManager(8, 2, watermark=0.0, enable_caching=True)
    s, t = _tok_seq([1, 2, 5, 6, 7]), _tok_seq([1, 3, 5, 6, 7])
    assert bm.block_hashes(s, 2) == [a, b] and bm.block_hashes(t, 2)[1] != b


def test_only_final_blocks_are_cached_keyed_by_the_next_token() -> None:
    """A block is cached once all its positions are computed and the token after it is known:
    prompt blocks whose next token is in the prompt, and generated ones up to ``num_tokens - 1``."""
    bm = BlockManager(16, 4, watermark=0.0, enable_caching=True)
    s = _tok_seq(range(10, 21))  # 11 tokens: blocks [10..13] [14..17] [18..20 + ...]
    bm.allocate(s, 11)
    _computed(bm, s, 7)  # a chunk: block 0 final (next token 14 is in the prompt), block 1 not
    h = bm.block_hashes(s, 2)
    assert bm.pool.block_key[s.block_table[0]] == BlockKey(h[0], 14)
    assert bm.pool.block_key[s.block_table[1]] is None and s.num_cached_blocks == 1
    _computed(bm, s, 11, out=[99])  # prefill done, token 99 sampled: block 1 (next 18) final
    assert bm.pool.block_key[s.block_table[1]] == BlockKey(h[1], 18) and s.num_cached_blocks == 2
    bm.grow(s, 16)
    # a decode verified 1 + 3 rows at positions 11..14 (token 99 + 3 drafts) and accepted one
    # draft (100) plus a bonus (101): positions 11, 12 are final (num_computed 13, 14 tokens),
    # 13 and 14 hold unverified entries. Block 2 (8..11) is final with next token 100; block 3
    # (12..15) is not
    _computed(bm, s, 13, out=[100, 101])
    assert s.num_tokens == 14 and bm.pool.block_key[s.block_table[2]][1] == 100
    assert bm.pool.block_key[s.block_table[3]] is None and bm.pool.num_cached_blocks == 3


def test_hit_reuses_blocks_with_the_same_next_token_and_copies_otherwise() -> None:
    bm = BlockManager(32, 4, watermark=0.0, enable_caching=True)
    a = _tok_seq(list(range(1, 13)) + [50, 51])  # 14 tokens: 3 full blocks, next tokens 5, 9, 50
    bm.allocate(a, 14)
    _computed(bm, a, 14, out=[7])
    assert bm.pool.num_cached_blocks == 3
    # same three blocks, prefix ends mid-block (16 tokens): all three reused as they are
    hit = bm.find_cache_hit(_tok_seq(list(range(1, 13)) + [50, 60, 61, 62]))
    assert hit.blocks == a.block_table[:3] and hit.copy_src is None and hit.num_tokens == 12
    # differs right after block 2's boundary (token 12 -> 70): blocks 0, 1 as they are, block 2
    # copied with its last position (11) recomputed
    hit = bm.find_cache_hit(_tok_seq(list(range(1, 13)) + [70, 71]))
    assert hit.blocks == a.block_table[:2] and hit.copy_src == a.block_table[2] and hit.num_tokens == 11
    # ends exactly on the block boundary: the last position is always computed (copy, N - 1)
    hit = bm.find_cache_hit(_tok_seq(range(1, 13)))
    assert hit.blocks == a.block_table[:2] and hit.copy_src == a.block_table[2] and hit.num_tokens == 11
    hit = bm.find_cache_hit(_tok_seq(range(1, 5)))
    assert hit.blocks == [] and hit.copy_src == a.block_table[0] and hit.num_tokens == 3
    # differs inside block 1: block 0 only (its next token 5 matches)
    hit = bm.find_cache_hit(_tok_seq([1, 2, 3, 4, 5, 6, 0, 8, 9]))
    assert hit.blocks == a.block_table[:1] and hit.copy_src is None and hit.num_tokens == 4
    # nothing for a request asking for prompt logprobs, or with caching off
    assert bm.find_cache_hit(_tok_seq(range(1, 17), logprobs=1)).num_tokens == 0
    assert BlockManager(32, 4, enable_caching=False).find_cache_hit(_tok_seq(range(1, 17))).num_tokens == 0
    # plain decoding (no MTP layer): the next token does not matter
    bm0 = BlockManager(32, 4, watermark=0.0, enable_caching=True, key_next_token=False)
    b = _tok_seq(list(range(1, 13)) + [50])
    bm0.allocate(b, 13)
    _computed(bm0, b, 13, out=[7])
    hit = bm0.find_cache_hit(_tok_seq(list(range(1, 13)) + [70]))
    assert hit.blocks == b.block_table[:3] and hit.copy_src is None and hit.num_tokens == 12


def test_allocate_with_a_hit_shares_blocks_copies_one_and_pins_its_source() -> None:
    bm = BlockManager(12, 4, watermark=0.0, enable_caching=True)
    a = _tok_seq(list(range(1, 9)) + [50])
    bm.allocate(a, 9)
    _computed(bm, a, 9, out=[7])
    bm.free(a)  # blocks 0, 1 cached and evictable, block 2 uncached
    assert bm.num_free_blocks == 12 and bm.pool.num_cached_blocks == 2
    b = _tok_seq(list(range(1, 9)) + [60, 61])  # block 1's next token differs: copy it
    hit = bm.find_cache_hit(b)
    assert hit.blocks == [0] and hit.copy_src == 1 and hit.num_tokens == 7
    assert bm._free_blocks_needed(10, hit) == 1 + 1 + 1 + 1  # blocks 0 and 1 (pinned) leave the queue, 2 new
    copy = bm.allocate(b, 10, hit)
    assert copy == (1, b.block_table[1]) and b.block_table[0] == 0 and b.num_computed_tokens == 7
    assert bm.pool.ref_cnt[0] == 1 and bm.pool.ref_cnt[1] == 1 and bm.num_free_blocks == 12 - 4
    bm.release_pinned()  # the step ran its copy: block 1 is evictable again, still cached
    assert bm.pool.ref_cnt[1] == 0 and bm.pool.is_evictable(1) and bm.num_free_blocks == 9
    # the copy is b's own block and becomes cached under b's next token once computed
    _computed(bm, b, 10, out=[3])
    assert bm.pool.block_key[b.block_table[1]] == BlockKey(bm.block_hashes(b, 2)[1], 60)
    assert set(bm.pool.lookup(bm.block_hashes(b, 2)[1]).values()) == {1, b.block_table[1]}


def test_reference_counts_lru_eviction_and_uncached_first() -> None:
    """Freed cached blocks stay hit-able; allocation takes never-cached blocks first, then evicts
    the least recently freed cached block (a table's tail before its head)."""
    bm = BlockManager(6, 2, watermark=0.0, enable_caching=True)
    a, b = _tok_seq([1, 2, 3, 4, 5]), _tok_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    _computed(bm, a, 5, out=[6])
    hit = bm.find_cache_hit(b)
    assert hit.blocks == a.block_table[:2] and hit.num_tokens == 4
    bm.allocate(b, 5, hit)
    assert [bm.pool.ref_cnt[x] for x in a.block_table] == [2, 2, 1] and b.block_table[:2] == a.block_table[:2]
    bm.free(a)
    assert [bm.pool.ref_cnt[x] for x in b.block_table[:2]] == [1, 1] and bm.num_free_blocks == 6 - 3
    head, tail = b.block_table[:2]
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.free_blocks[-2:] == [tail, head]  # tail evicted first
    c = _tok_seq([9, 9, 9, 9, 9, 9, 9, 9])
    bm.grow(c, 8)  # 4 blocks: the 4 never-cached free blocks (a's and b's third blocks included)
    assert head not in c.block_table and tail not in c.block_table and bm.pool.num_cached_blocks == 2
    bm.grow(c, 10)  # the 5th evicts the least recently freed: the tail
    assert c.block_table[-1] == tail and bm.pool.num_cached_blocks == 1
    assert bm.find_cache_hit(_tok_seq([1, 2, 3, 4, 5])).blocks == [head]
    bm.free(c)
    assert bm.reset_prefix_cache() == 1 and bm.pool.num_cached_blocks == 0 and bm.num_free_blocks == 6


def test_watermark_and_capacity_count_reused_free_blocks() -> None:
    bm = BlockManager(10, 2, watermark=0.2, enable_caching=True)  # 2 blocks of watermark
    a = _tok_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    _computed(bm, a, 5, out=[6])
    bm.free(a)
    s = _tok_seq([1, 2, 3, 4, 5] + [7] * 11)  # 16 tokens = 8 blocks; 2 of them cached and free
    hit = bm.find_cache_hit(s)
    assert hit.num_tokens == 4
    assert bm.can_allocate(s, 16, hit)  # 6 new + 2 reused = 8 = 10 - watermark
    assert not bm.can_allocate(s, 18, hit)
    bm.allocate(s, 16, hit)
    assert bm.num_free_blocks == 2 and s.num_computed_tokens == 4
    with pytest.raises(RuntimeError, match="already has blocks"):
        bm.allocate(s, 16)


def test_block_pool_errors_and_duplicate_keys() -> None:
    pool = BlockPool(3)
    b = pool.allocate()
    assert pool.cache(b, BlockKey(7, 1)) and not pool.cache(b, BlockKey(8, 1))  # cached once
    c = pool.allocate()
    assert not pool.cache(c, BlockKey(7, 1))  # the key has a block already: c stays private
    pool.free([c, b])
    assert pool.free_block_ids() == [2, c, b]  # c uncached, b cached (evictable)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="not referenced"):
        pool.cache(c, BlockKey(9, 9))
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch(c)
    for _ in range(3):
        pool.allocate()
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate()
    assert CacheHit().num_tokens == 0
