"""Deferred MTP KV writes: a step that drafts nothing runs no MTP pass at all (adaptive speculation).

Issue 18: under adaptive speculation length a step at ``k = 0`` must cost nothing beyond plain
decoding. The MTP layer's KV entry at position ``p`` depends only on the target's post-norm
hidden state ``h_p`` and the token ``p + 1`` (the MTP block is one decoder layer: its K/V, an MLA
latent or DSA indexer keys are functions of the layer's input row; DeepSeek-V3 report,
arXiv:2412.19437, sec. 2.2), so the entries of positions computed at ``k = 0`` can be written
later, from ``h_p`` kept aside, by the same KV-only pass a ``k = 0`` step would have run
(:meth:`~mtpspec.spec_decode.mtp_proposer.MTPProposer.write_kv_rows`).

* **Kept aside**: a step that proposes no drafts and defers (``StepInput.defer_mtp_kv``) writes
  its rows' ``h`` into :class:`MTPHiddenStateCache`, a paged cache of ``hidden_size`` values per
  token in the model dtype, addressed like every KV cache by the sequence's block table (so
  prefix caching's block copies, sharing and freeing need nothing new; every rank keeps the
  full, replicated ``h``).
* **Per request** the scheduler keeps ``Sequence.mtp_len``: leading positions whose MTP entries
  are written (final: written with the token after them). Positions ``[mtp_len,
  num_computed_tokens)`` were computed by deferring steps, so their ``h`` is in the cache.
* **Catch-up**: a step that drafts (``k >= 1``) first writes the MTP entries of every sequence's
  lag, positions ``[mtp_len, start_position)`` (``SeqInput.mtp_lag`` rows; their next tokens on
  the host, ``SeqInput.mtp_lag_token_ids``, except the last one, the step's own first input
  token, which may still be pending on the device), in chunks of at most :func:`catch_up_chunk_rows`
  rows, before its first pass reads them (:func:`catch_up`). The step's own rows then get their
  entries from its first pass, as without deferral.
* **Prefix caching**: each block records how many of its leading MTP entries some sequence wrote
  (:attr:`~mtpspec.engine.block_pool.BlockPool.mtp_upto`); after its first block not fully
  written (its unwritten tail was computed by deferring steps, so the block holds its ``h``) a hit
  goes on only through blocks with no entry written (computed wholly by deferring steps: all their
  ``h`` kept) and ends before any other (a later block may be another sequence's, written by
  drafting, without ``h``); the new sequence catches up from the first unwritten position. Those
  writes land in shared blocks: they are the values the owner would write (the same ``h``, the
  same next token, which the block's cache key holds), so a reader sees the same entry either way
  (at most the GEMM's row blocking apart).

The result is lossless by construction (drafts never change what verification emits) and the
drafts equal a non-deferring run's (tested token for token on the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Type, Union

import numpy as np
import torch

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.kv_cache_interface import AttentionSpec
from mtpspec.layers.attention import AttentionMetadata
from mtpspec.ops.slot_scatter import scatter_rows_to_slots
from mtpspec.step_io import host_to_device

if TYPE_CHECKING:
    from mtpspec.step_io import PreparedStep, StepInput


#: Rows of one catch-up chunk at least (:func:`catch_up_chunk_rows`). Each chunk is launched eagerly
#: with its own host preparation (~1 ms on the H100's host), so chunks of ``max_num_batched_tokens``
#: rows (1,024 at Air 3 layers, ``max_model_len`` 1,024) made the catch-up host-bound: 150 k rows in
#: 190 ms, 1.27 us a row (H100, 2026-12-05) where the pass's GEMMs need ~0.12 us a row. At 8,192 rows
#: a chunk's device time (~1 ms at Air width) covers its host preparation.
CATCH_UP_CHUNK_ROWS = 8192


def catch_up_chunk_rows(max_num_batched_tokens: int) -> int:
    """Rows of one catch-up chunk: ``max(max_num_batched_tokens, CATCH_UP_CHUNK_ROWS)``. The runner's
    memory profile runs a KV-only pass of that many rows (``ModelRunner.profile_and_count_blocks``),
    so the KV cache is sized with room for its activations."""
    return max(int(max_num_batched_tokens), CATCH_UP_CHUNK_ROWS)


class MTPHiddenStateBackend(AttentionBackend):
    """Layout ``[num_blocks, block_size, hidden_size]`` (one row per token)."""

    @staticmethod
    def get_name() -> str:
        return "MTP_HIDDEN_STATES"

    @staticmethod
    def get_impl_cls() -> Type["MTPHiddenStateImpl"]:
        return MTPHiddenStateImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``; ``head_size = hidden_size``, ``num_kv_heads`` must be 1."""
        if num_kv_heads != 1:
            raise ValueError(f"the hidden-state cache keeps one row per token (num_kv_heads=1), got {num_kv_heads}")
        return (num_blocks, block_size, head_size)


class MTPHiddenStateImpl(AttentionImpl):
    """Writes rows at slots and reads them back (there is no attention over this cache)."""

    def do_kv_cache_update(self, layer: "AttentionLayerBase", key: torch.Tensor, value: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``key [n, H]`` into ``kv_cache`` at ``slot_mapping [n]``. Every slot must be a real one
        (``>= 0``: the real layout of a step, which has no padding rows); an index out of range
        raises (CPU) or trips a device assert. No host sync."""
        rows = key if key.dtype == kv_cache.dtype else key.to(kv_cache.dtype)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, rows)

    def forward(self, layer: "AttentionLayerBase", query: torch.Tensor, key: torch.Tensor,
                value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                attn_metadata: Optional[AttentionMetadata]) -> torch.Tensor:
        """The cached rows at ``attn_metadata.slot_mapping`` (``[n, H]``; ``query`` / ``key`` /
        ``value`` unused).

        Raises:
            ValueError: no cache or no metadata.
        """
        if kv_cache is None or attn_metadata is None:
            raise ValueError("reading the hidden-state cache needs the cache and the rows' slot_mapping")
        return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, attn_metadata.slot_mapping)


class MTPHiddenStateCache(AttentionLayerBase):
    """The target's post-norm hidden states of positions whose MTP KV entries are deferred.

    Args:
        hidden_size: ``H``.
        dtype: the model dtype (kept as is also under an fp8 KV cache).

    Sizing: ``block_size * H * itemsize`` bytes per block (e.g. GLM-4.5-Air, ``H = 4096`` bf16:
    8 KiB a token), summed into the KV sizing like any cache: an engine configured to defer
    (``adaptive_defer_mtp_kv``, the default under adaptive speculation) holds that many fewer
    tokens of KV cache, whether or not its steps defer.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.kv_cache: Optional[torch.Tensor] = None
        self.impl = MTPHiddenStateImpl()

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return MTPHiddenStateBackend

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(block_size=block_size, num_kv_heads=1, head_size=self.hidden_size, dtype=self.dtype)

    def write(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``hidden [n, H]`` (any float dtype; stored in :attr:`dtype`) at the first ``n`` entries of
        ``slot_mapping`` (int64 slots, every one real; see the impl). No host sync.

        Raises:
            RuntimeError: the cache is not allocated.
        """
        if self.kv_cache is None:
            raise RuntimeError("the hidden-state cache is not allocated")
        n = hidden.shape[0]
        self.impl.do_kv_cache_update(self, hidden, None, self.kv_cache, slot_mapping[:n])

    def write_padded(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """:meth:`write` for a graph unit's padded rows: ``hidden [n, H]`` (any float dtype; stored in
        :attr:`dtype`) at ``slot_mapping [n]`` (int64), whose padding rows have slot ``-1`` and whose
        row 0 is real: the result is that of :meth:`write` over the real rows alone, in one kernel
        (:func:`~mtpspec.ops.slot_scatter.scatter_rows_to_slots`); no host sync (fit for CUDA-graph
        capture).

        Raises:
            RuntimeError: the cache is not allocated.
        """
        if self.kv_cache is None:
            raise RuntimeError("the hidden-state cache is not allocated")
        scatter_rows_to_slots(self.kv_cache.view(-1, self.kv_cache.shape[-1]), hidden, slot_mapping[:hidden.shape[0]])

    def read(self, meta: AttentionMetadata) -> torch.Tensor:
        """The rows at ``meta.slot_mapping [n]``: ``[n, H]`` in :attr:`dtype`. No host sync.

        Raises:
            RuntimeError: the cache is not allocated.
        """
        if self.kv_cache is None:
            raise RuntimeError("the hidden-state cache is not allocated")
        return self.impl.forward(self, None, None, None, self.kv_cache, meta)


def lag_rows(step: "StepInput", max_rows: int) -> List[List[Tuple[int, int, int]]]:
    """The catch-up of ``step``: chunks of at most ``max_rows`` rows, each a list of ``(sequence
    index, first position, last position + 1)`` parts covering every sequence's lag
    ``[start_position - mtp_lag, start_position)`` in batch order.

    Raises:
        ValueError: a lag longer than the positions before the sequence's first row, a token
            list that is not ``mtp_lag - 1`` long, or ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    chunks: List[List[Tuple[int, int, int]]] = [[]]
    room = max_rows
    for i, s in enumerate(step.seqs):
        lag = s.mtp_lag
        if not lag:
            continue
        if not 0 < lag <= s.start_position or len(s.mtp_lag_token_ids) != lag - 1:
            raise ValueError(f"sequence {i} ({s.request_id!r}): mtp_lag={lag} needs 0 < mtp_lag <= start_position="
                             f"{s.start_position} and mtp_lag - 1 host tokens, got {len(s.mtp_lag_token_ids)} (the "
                             "scheduler's tokens must reach position start_position - 1)")
        a = s.start_position - lag
        while a < s.start_position:
            if room == 0:
                chunks.append([])
                room = max_rows
            b = min(s.start_position, a + room)
            chunks[-1].append((i, a, b))
            room -= b - a
            a = b
    return [c for c in chunks if c]


def _chunk_inputs(step: "StepInput", parts: Sequence[Tuple[int, int, int]], block_size: int,
                  first_row: np.ndarray, device: torch.device):
    """Host arrays of one catch-up chunk -> ``(ids, positions, metadata, last_rows, step_rows)``:
    ``last_rows`` are the chunk rows whose id is the step's own first input token of sequence
    ``i`` (row ``step_rows`` of the step), filled on the device."""
    q = np.array([b - a for _, a, b in parts], dtype=np.int64)
    seg = np.concatenate([[0], np.cumsum(q)])
    pos = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in parts])
    width = max(len(step.seqs[i].block_table) for i, _, _ in parts)
    bt = np.full((len(parts), width), -1, dtype=np.int64)
    ids = np.zeros(int(seg[-1]), dtype=np.int64)
    last_rows, step_rows = [], []
    for j, (i, a, b) in enumerate(parts):
        s = step.seqs[i]
        bt[j, :len(s.block_table)] = s.block_table
        lo = s.start_position - s.mtp_lag  # token p + 1 of position p: mtp_lag_token_ids[p - lo]
        known = min(b, s.start_position - 1)
        if known > a:
            ids[seg[j]:seg[j] + known - a] = s.mtp_lag_token_ids[a - lo:known - lo]
        if b == s.start_position:  # the lag's last position: its next token is the step's first input
            last_rows.append(int(seg[j + 1]) - 1)
            step_rows.append(int(first_row[i]))
    blocks = bt[np.repeat(np.arange(len(parts)), q), pos // block_size]
    slots = blocks * block_size + pos % block_size
    seq_lens = [b for _, _, b in parts]
    slots_d, ids_d, pos_d = host_to_device([slots, ids, pos], torch.int64, device)
    qsl, lens, bt_d = host_to_device([seg, seq_lens, bt], torch.int32, device)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=lens, slot_mapping=slots_d, block_tables=bt_d,
                             num_seqs=len(parts), max_query_len=int(q.max()), max_seq_len=max(seq_lens),
                             query_lens=q.tolist(), seq_lens_list=seq_lens)
    return ids_d, pos_d, meta, last_rows, step_rows


def catch_up(step: "StepInput", inp: "PreparedStep", cache: MTPHiddenStateCache, write_kv_rows,
             block_size: int, max_rows: int) -> int:
    """Write the MTP KV entries of every sequence's lag (module docstring) before ``step``'s first
    pass: per chunk of :func:`lag_rows` (``T <= max_rows`` rows), ``write_kv_rows(ids [T] int64
    (each position's next token), positions [T] int64, hidden [T, H] (read from ``cache``, model
    dtype), metadata)`` (the proposer's KV-only pass,
    :meth:`~mtpspec.spec_decode.proposer.Proposer.write_kv_rows`). ``inp``: the step's prepared
    inputs (its first input token of each sequence, filled on the device when it was pending).
    Returns the rows written (an int). No host sync.

    Raises:
        ValueError: see :func:`lag_rows`.
    """
    chunks = lag_rows(step, max_rows)
    if not chunks:
        return 0
    first_row = np.concatenate([[0], np.cumsum(inp.host_query_lens)])
    dev, n = inp.input_ids.device, 0
    for parts in chunks:
        ids, pos, meta, last_rows, step_rows = _chunk_inputs(step, parts, block_size, first_row, dev)
        if last_rows:  # the step's first input token (filled on the device when it was pending)
            step_rows_d, last_rows_d = host_to_device([step_rows, last_rows], torch.int64, dev)
            ids.index_copy_(0, last_rows_d, inp.input_ids.index_select(0, step_rows_d))
        write_kv_rows(ids, pos, cache.read(meta), meta)
        n += ids.shape[0]
    return n


def sequence_lag(seq_mtp_len: int, start_position: int,
                 all_token_ids: Union[List[int], Sequence[int]]) -> Tuple[int, List[int]]:
    """``(mtp_lag, mtp_lag_token_ids)`` of a sequence scheduled at ``start_position`` whose MTP
    entries are written below ``seq_mtp_len``: the next tokens of positions ``mtp_len .. start -
    2`` (the last lag position's next token is the step's first input)."""
    lag = max(0, start_position - seq_mtp_len)
    return lag, (list(all_token_ids[seq_mtp_len + 1:start_position]) if lag else [])


__all__ = ["CATCH_UP_CHUNK_ROWS", "MTPHiddenStateBackend", "MTPHiddenStateCache", "MTPHiddenStateImpl", "catch_up",
           "catch_up_chunk_rows", "lag_rows", "sequence_lag"]
