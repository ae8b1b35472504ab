"""KV blocks with reference counts, the prefix cache's content index, and the free queues.

A *cached* block holds final KV entries (target, MTP and indexer caches alike) of one full
block of tokens and is indexed by a :class:`BlockKey`: the chained hash of the tokens up to
and including the block (:func:`hash_block_tokens`) and the token right after the block. The
second part exists because the MTP layer's entry at position ``t`` is computed from the target's
hidden state at ``t`` and the embedding of token ``t + 1``: the block's last MTP entry is only
right for a request whose token after the block is the same one. Several blocks may share a
hash with different next tokens.

Free blocks wait in two queues: blocks that hold nothing reusable (taken first), and cached
blocks nobody references, in least-recently-freed order (evicted oldest first; they stay
hit-able until then). A hit on a free cached block takes it out of the queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Deque, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple


class BlockKey(NamedTuple):
    """Index of a cached block: ``block_hash`` (:func:`hash_block_tokens` chain up to the block)
    and ``next_token`` (the token after the block, the input of the block's last MTP entry)."""

    block_hash: int
    next_token: int


def hash_block_tokens(parent_hash: Optional[int], token_ids: Sequence[int],
                      extra_keys: Optional[Tuple] = None) -> int:
    """Hash of one full block, chained: ``hash((parent_hash, tuple(token_ids), extra_keys))``.

    Args:
        parent_hash: the previous block's hash (``None`` for the first block).
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the block's KV entries (vLLM's extra keys: LoRA,
            multimodal inputs, a cache salt); ``None`` today.

    Python's ``hash`` of a tuple of ints is deterministic across processes; only the scheduling
    process (rank 0) hashes.
    """
    return hash((parent_hash, tuple(token_ids), extra_keys))


class BlockPool:
    """``num_blocks`` blocks: reference counts, the cache index and the free queues.

    Args:
        num_blocks: blocks per layer cache (>= 1).

    Attributes:
        num_evictions: cached blocks taken for new data so far.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_evictions = 0
        self.ref_cnt: List[int] = [0] * num_blocks
        self.block_key: List[Optional[BlockKey]] = [None] * num_blocks
        # leading MTP KV entries of each block some sequence wrote (all of them unless adaptive
        # speculation deferred some: spec_decode/deferred_mtp.py); 0 for a newly allocated block
        self.mtp_upto: List[int] = [0] * num_blocks
        self._uncached: Deque[int] = deque(range(num_blocks))
        self._evictable: "OrderedDict[int, None]" = OrderedDict()  # least recently freed first
        self._index: Dict[int, Dict[int, int]] = {}  # block_hash -> {next_token: block}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (never cached, or cached and evictable)."""
        return len(self._uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the cache index (referenced or not)."""
        return sum(len(d) for d in self._index.values())

    def free_block_ids(self) -> List[int]:
        """Every free block: never-cached ones in allocation order, then the evictable ones, LRU first."""
        return list(self._uncached) + list(self._evictable)

    def lookup(self, block_hash: int) -> Dict[int, int]:
        """``{next_token: block}`` of the cached blocks with this hash (empty when none)."""
        return self._index.get(block_hash, {})

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """A free block with reference count 1: a never-cached one, else the least recently freed
        cached one (removed from the index).

        Raises:
            RuntimeError: no free block.
        """
        if self._uncached:
            b = self._uncached.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            self.num_evictions += 1
        else:
            raise RuntimeError("out of KV blocks: none free")
        self.ref_cnt[b] = 1
        self.mtp_upto[b] = 0
        return b

    def touch(self, block: int) -> None:
        """One more reference to a block (a cache hit); a free one leaves the eviction queue."""
        if self.ref_cnt[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"block {block} is free but not cached: it cannot be shared")
            del self._evictable[block]
        self.ref_cnt[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order: a block whose count reaches 0
        becomes free; a cached one joins the eviction queue's tail (so blocks freed first are
        evicted first: pass a table's blocks last to first to keep prefixes longest).

        Raises:
            RuntimeError: a block that is not referenced.
        """
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._uncached.append(b)

    # ------------------------------------------------------------------ the cache index
    def cache(self, block: int, key: BlockKey) -> bool:
        """Index a referenced block under ``key``; ``False`` (nothing changes) when another block
        already holds that key or this block is cached already.

        Raises:
            RuntimeError: the block is not referenced (only a sequence's own final block is cached).
        """
        if self.ref_cnt[block] <= 0:
            raise RuntimeError(f"block {block} is not referenced; only a sequence's blocks can be cached")
        entries = self._index.setdefault(key.block_hash, {})
        if key.next_token in entries or self.block_key[block] is not None:
            return False
        entries[key.next_token] = block
        self.block_key[block] = key
        return True

    def _uncache(self, block: int) -> None:
        key = self.block_key[block]
        if key is None:
            return
        entries = self._index[key.block_hash]
        del entries[key.next_token]
        if not entries:
            del self._index[key.block_hash]
        self.block_key[block] = None

    def reset(self) -> int:
        """Drop every evictable block from the index (vLLM's ``reset_prefix_cache``); returns how
        many. Referenced cached blocks stay indexed."""
        n = len(self._evictable)
        for b in list(self._evictable):
            self._uncache(b)
            self._uncached.append(b)
        self._evictable.clear()
        return n
