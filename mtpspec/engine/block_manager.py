"""Paged KV-cache bookkeeping: one block table per sequence, shared blocks, automatic prefix caching.

Block ``b`` holds positions ``[i * block_size, (i + 1) * block_size)`` of the sequence whose
table has ``b`` at index ``i``; the KV slot of position ``t`` is
``table[t // block_size] * block_size + t % block_size``. The same table addresses the target
layers' caches, the MTP layers' caches and the DSA indexers' key caches.

Prefix caching (vLLM's design, by block content; ``enable_caching``): a block is *cached* (put
in the :class:`~mtpspec.engine.block_pool.BlockPool`'s index) once every entry in it is final
for every cache: all its positions are computed (``num_computed_tokens``) and the token after
it is known (``num_tokens - 1``), because the block's last MTP entry was computed with that
token. Speculative entries (rejected drafts, draft steps) sit at positions ``>=
num_computed_tokens`` and are never in a cached block; a sequence never writes below its
``num_computed_tokens``, so a shared block is read-only.

A new (or preempted) sequence of ``N`` tokens looks up its full blocks in order
(:meth:`BlockManager.find_cache_hit`), at most ``N - 1`` tokens, so the last token is always
computed (its logits are needed):

* block ``j`` whose next token (``tokens[(j + 1) * block_size]``) is in the prompt is reused as
  is when a cached block has the same hash *and* the same next token;
* when cached blocks have the hash but another next token (two prompts that share blocks and
  differ right after a block boundary), or when the block ends exactly at the prompt's end
  (the next token is the one to be sampled), the block's target entries are right and only its
  last MTP entry is not. The sequence gets a private copy of one such block (``block_copies``:
  every cache of every layer on every rank, run before the step's forward) and recomputes
  position ``(j + 1) * block_size - 1`` alone into the copy: the target row (the MTP layer
  needs its hidden state) and the MTP entry with the sequence's own next token. The hit counts
  ``block_size - 1`` tokens of that block. The shared block is never written. (vLLM drops the
  whole last block for the drafter instead, which lost hit rate: vllm#38182.)

Adaptive speculation may defer MTP entries (:mod:`mtpspec.spec_decode.deferred_mtp`): each
block records how many of its leading MTP entries were written (``BlockPool.mtp_upto``, noted by
:meth:`BlockManager.cache_full_blocks` from ``Sequence.mtp_len``). The positions after them were
computed by steps that deferred their MTP entries, so the block holds their hidden states. After
its first block not fully written, a hit goes on only through blocks with no entry written (each
computed wholly by deferring steps, so all of its hidden states are kept: a sequence's written
entries are a prefix of its positions, noted every step); it ends before any other (a block of
another sequence that drafted keeps no hidden states). Its ``mtp_tokens`` stop inside that first
block; the sequence writes the rest itself (its catch-up), into the shared blocks too: the values
the owner would write (same hidden states, same next token), the only writes a shared block
ever sees. (An adaptive engine held at k = 0 hit one block of a cached prompt before: H100,
2026-12-05, 304 prefill steps where plain decoding hit the whole prompts.)

Reference counts let sequences share blocks; freeing a cached block keeps it hit-able until an
allocation evicts it (least recently freed first, after the never-cached free blocks). The
children of a request with ``n > 1`` share their prompt's blocks the same way, with caching on
or off (:meth:`BlockManager.fork_hit`: a running sibling's blocks instead of cached ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from mtpspec.engine.block_pool import BlockKey, BlockPool, hash_block_tokens
from mtpspec.engine.sequence import Sequence

WATERMARK = 0.01  # the default share of blocks a new sequence may not take


def blocks_with_watermark(useful: int, watermark: float = WATERMARK) -> int:
    """The fewest blocks ``n`` with ``n - int(watermark * n) >= useful``: a cache of ``useful`` blocks
    beside :class:`BlockManager`'s watermark.

    Raises:
        ValueError: ``watermark`` outside ``[0, 1)`` (no cache size would leave ``useful`` blocks).
    """
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
    n = useful + int(watermark * useful)
    while n - int(watermark * n) < useful:
        n += 1
    return n


@dataclass
class CacheHit:
    """A sequence's reused prefix: cached (:meth:`BlockManager.find_cache_hit`) or a sibling's
    (:meth:`BlockManager.fork_hit`).

    Attributes:
        blocks: leading blocks reused as they are (shared, read-only).
        copy_src: a block to copy into a new private block that follows ``blocks``; its
            positions from ``num_tokens`` on are recomputed (``None``: no copy).
        num_tokens: positions the sequence need not compute: ``len(blocks) * block_size``, plus
            the copied block's leading positions (``block_size - 1`` for a prefix-cache hit).
        mtp_tokens: leading positions whose MTP entries the hit holds written (``num_tokens``
            unless adaptive speculation deferred some; module docstring).
    """

    blocks: List[int] = field(default_factory=list)
    copy_src: Optional[int] = None
    num_tokens: int = 0
    mtp_tokens: int = 0


class BlockManager:
    """Allocates, shares, caches and frees KV blocks.

    Args:
        num_blocks: blocks per layer cache (>= 1).
        block_size: tokens per block (>= 1).
        watermark: fraction of blocks a *new* sequence may not take (kept for running ones to
            grow into, so admitting a prefill does not immediately force a preemption).
        enable_caching: automatic prefix caching (module docstring).
        key_next_token: a cached block's key includes the token after it (an MTP layer caches
            entries that depend on it: ``k > 0``). ``False`` (plain decoding): blocks match by
            hash alone.

    Attributes:
        pool: the :class:`~mtpspec.engine.block_pool.BlockPool`.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = WATERMARK, enable_caching: bool = False,
                 key_next_token: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        self.key_next_token = key_next_token
        self.pool = BlockPool(num_blocks)
        self._pinned: List[int] = []  # copy sources referenced until the step that copies them ran

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks (cached ones included: they are evicted on demand)."""
        return self.pool.num_free_blocks

    @property
    def free_blocks(self) -> List[int]:
        """Ids of the unreferenced blocks (allocation order)."""
        return self.pool.free_block_ids()

    def blocks_for(self, num_slots: int) -> int:
        """Blocks needed to hold positions ``0 .. num_slots - 1``."""
        return -(-num_slots // self.block_size)

    def _missing(self, seq: Sequence, num_slots: int) -> int:
        return max(0, self.blocks_for(num_slots) - len(seq.block_table))

    # ------------------------------------------------------------------ prefix cache lookup
    def _next_key(self, token: int) -> int:
        return token if self.key_next_token else -1

    def block_hashes(self, seq: Sequence, num_blocks: int) -> List[int]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks (kept on the sequence)."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            toks, bs = seq.all_token_ids, self.block_size
            for j in range(len(hashes), num_blocks):
                hashes.append(hash_block_tokens(hashes[-1] if hashes else None, toks[j * bs:(j + 1) * bs]))
        return hashes[:num_blocks]

    def lookup_enabled(self, seq: Sequence) -> bool:
        """Whether ``seq`` may read the prefix cache: caching is on and it asks for no prompt
        log-probabilities (their rows must be computed; vLLM skips the lookup for them too)."""
        return self.enable_caching and seq.params.prompt_logprobs is None

    def find_cache_hit(self, seq: Sequence) -> CacheHit:
        """The longest usable cached prefix of a sequence without blocks (module docstring).

        Empty when caching is off or the request asks for prompt log-probabilities (those rows
        must be computed, as in vLLM).
        """
        hit = CacheHit()
        if not self.lookup_enabled(seq) or seq.block_table:
            return hit
        bs, n = self.block_size, seq.num_tokens
        toks = seq.all_token_ids
        hashes = self.block_hashes(seq, n // bs)
        for j, h in enumerate(hashes):
            entries = self.pool.lookup(h)
            if not entries:
                break
            end = (j + 1) * bs
            # a block that ends the sequence is never reused as is: its last position is computed
            block = entries.get(self._next_key(toks[end])) if end < n else None
            if block is None:  # other next token, or the block ends the sequence: copy, recompute its last row
                hit.copy_src = next(iter(entries.values()))
                break
            hit.blocks.append(block)
        upto = self.pool.mtp_upto
        for j, b in enumerate(hit.blocks):
            if upto[b] < bs:  # deferred MTP entries: the hit goes on only through blocks without any written
                end = j + 1  # (computed wholly by deferring steps: their hidden states are kept; module docstring)
                while end < len(hit.blocks) and upto[hit.blocks[end]] == 0:
                    end += 1
                keep_copy = end == len(hit.blocks) and hit.copy_src is not None and upto[hit.copy_src] == 0
                hit.blocks, hit.copy_src = hit.blocks[:end], (hit.copy_src if keep_copy else None)
                break
        hit.num_tokens = len(hit.blocks) * bs + (bs - 1 if hit.copy_src is not None else 0)
        full = sum(1 for b in hit.blocks if upto[b] == bs)
        last = hit.blocks[full] if full < len(hit.blocks) else hit.copy_src
        hit.mtp_tokens = full * bs + (min(upto[last], bs - 1) if last is not None else 0)
        return hit

    def fork_hit(self, src: Sequence, num_tokens: int) -> CacheHit:
        """The :class:`CacheHit` of a sequence whose first ``num_tokens`` tokens are those of
        ``src``, a running sequence that computed them (a sibling of a request with ``n > 1``:
        :mod:`mtpspec.engine.parallel_sampling`). Works with caching on or off.

        Positions ``< num_tokens - 1`` are shared: the full blocks holding them by reference,
        the partial one as a copy (its later positions are overwritten). Position ``num_tokens -
        1`` is left to compute: its logits give the sequence's own sample and its MTP entry reads
        its own next token. ``src`` never writes below its ``num_computed_tokens``, so the shared
        blocks stay read-only.
        """
        n = max(min(num_tokens, src.num_computed_tokens + 1) - 1, 0)
        full, rest = divmod(n, self.block_size)
        return CacheHit(src.block_table[:full], src.block_table[full] if rest else None, n, min(n, src.mtp_len))

    # ------------------------------------------------------------------ allocation
    def _free_blocks_needed(self, num_slots: int, hit: Optional[CacheHit]) -> int:
        """Free blocks an allocation takes: new blocks, plus the hit's free (evictable) blocks it
        references again (its copy source included)."""
        if hit is None:
            return self.blocks_for(num_slots)
        reused = [b for b in hit.blocks + ([hit.copy_src] if hit.copy_src is not None else [])
                  if self.pool.ref_cnt[b] == 0]
        return max(0, self.blocks_for(num_slots) - len(hit.blocks)) + len(reused)

    def can_allocate(self, seq: Sequence, num_slots: int, hit: Optional[CacheHit] = None) -> bool:
        """Whether a sequence without blocks can get ``num_slots`` slots (reusing ``hit``),
        keeping the watermark."""
        return self._free_blocks_needed(num_slots, hit) <= self.num_free_blocks - self.watermark_blocks

    def allocate(self, seq: Sequence, num_slots: int, hit: Optional[CacheHit] = None) -> Optional[Tuple[int, int]]:
        """Give a sequence without blocks its table for ``num_slots`` slots: ``hit``'s blocks
        (shared), then new ones; sets ``num_computed_tokens`` to the hit's tokens.

        Returns:
            ``(src, dst)`` block ids to copy before the step's forward (the hit's copy), or ``None``.

        Raises:
            RuntimeError: the sequence has blocks already, or not enough free blocks (check
                :meth:`can_allocate` first).
        """
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already has blocks")
        need = self._free_blocks_needed(num_slots, hit)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        copy = None
        if hit is not None:
            for b in hit.blocks:
                self.pool.touch(b)
            seq.block_table = list(hit.blocks)
            if hit.copy_src is not None:
                self.pool.touch(hit.copy_src)  # pinned: not evicted before the copy ran
                self._pinned.append(hit.copy_src)
                dst = self.pool.allocate()
                seq.block_table.append(dst)
                copy = (hit.copy_src, dst)
            seq.num_cached_blocks = len(hit.blocks)
            seq.num_computed_tokens = hit.num_tokens
            seq.mtp_len = seq.mtp_noted = hit.mtp_tokens
        self.grow(seq, num_slots)
        return copy

    def release_pinned(self) -> None:
        """Unpin the copy sources of the previous step (its copies ran); call before scheduling."""
        pinned, self._pinned = self._pinned, []
        self.pool.free(pinned)

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
            seq.block_table.append(self.pool.allocate())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first (cached blocks stay hit-able, the tail
        ones evicted first)."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.mtp_noted = 0

    # ------------------------------------------------------------------ caching computed blocks
    def cache_full_blocks(self, seq: Sequence) -> int:
        """Index ``seq``'s blocks whose entries became final (module docstring); returns how many
        were added. Blocks whose key another block holds stay private (freed as uncached)."""
        if not self.enable_caching:
            return 0
        bs = self.block_size
        self._note_mtp(seq)
        final = min(seq.num_computed_tokens, seq.num_tokens - 1) // bs
        final = min(final, len(seq.block_table))
        if final <= seq.num_cached_blocks:
            return 0
        hashes = self.block_hashes(seq, final)
        toks = seq.all_token_ids
        added = 0
        for j in range(seq.num_cached_blocks, final):
            added += self.pool.cache(seq.block_table[j], BlockKey(hashes[j], self._next_key(toks[(j + 1) * bs])))
        seq.num_cached_blocks = final
        return added

    def _note_mtp(self, seq: Sequence) -> None:
        """Record on ``seq``'s blocks the MTP entries it holds written (``seq.mtp_len``; module docstring)."""
        bs, upto = self.block_size, self.pool.mtp_upto
        n = min(seq.mtp_len, len(seq.block_table) * bs)
        for j in range(seq.mtp_noted // bs, -(-n // bs)):
            b = seq.block_table[j]
            upto[b] = max(upto[b], min(n - j * bs, bs))
        seq.mtp_noted = max(seq.mtp_noted, n)

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many."""
        return self.pool.reset()
