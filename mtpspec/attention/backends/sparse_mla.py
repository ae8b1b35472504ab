"""Sparse MLA over the paged latent cache: DeepSeek Sparse Attention's attention half.

DeepSeek-V3.2-Exp report, sec. 2.1 (and ``transformers``' ``DeepseekV32Attention``, which folds
the indexer's top-k into the attention mask): every query token attends only the positions the
lightning indexer selected for it (``topk_pos``, :mod:`mtpspec.attention.backends.indexer`),
instead of its whole causal context. Cache layout (fp8 included), write and absorbed form are MLA's
(:class:`~mtpspec.attention.backends.mla.MLABackend`: one ``[kv_lora_rank + rope]`` latent entry per
token); the indexer's keys live in a second cache of their own (one ``index_head_dim`` entry per
token, same block tables).

Read path, sync-free with static shapes (CUDA-graph safe): the selected positions are clamped to
each row's causal range (``-1`` outside it and on padding rows), turned into cache slots
(:func:`~mtpspec.ops.sparse_mla_attention.positions_to_slots`) and attended
(:func:`~mtpspec.ops.sparse_mla_attention.sparse_mla_attention`). With every causal position
selected (context <= ``index_topk``) the result is dense MLA's.

:func:`dsa_layout` is the one varlen layout the indexer and the sparse attention share: the
paged cache's (metadata + block tables), or, without a cache, a virtual one over the forward's
own rows (block size 1, sequence ``i``'s position ``j`` = row ``query_start_loc[i] + j``), so
both halves address positions the same way in every mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Type

import torch

from mtpspec.attention.backends.abstract import AttentionLayerBase
from mtpspec.attention.backends.mla import MLABackend, MLAImpl
from mtpspec.attention.backends.paged_common import check_cache_metadata, check_metadata_rows
from mtpspec.ops.sparse_mla_attention import positions_to_slots, sparse_mla_attention

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata


class DSALayout(NamedTuple):
    """Where the rows of one forward and their context positions live (see :func:`dsa_layout`).

    ``query_start_loc [B + 1]``, ``seq_lens [B]``, ``block_tables [B, W]`` (int), ``block_size``,
    ``max_query_len`` / ``max_seq_len`` (host bounds): the paged layout the ops read.
    ``token_seq_idx [T]`` int64: each row's sequence (clamped into ``[0, B)`` on padding rows);
    ``real [T]`` bool: row before ``query_start_loc[B]``; ``row_pos [T]`` int64: the row's position
    in its sequence (meaningless on padding rows); ``cached``: positions address a real cache.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    token_seq_idx: torch.Tensor
    real: torch.Tensor
    row_pos: torch.Tensor
    cached: bool


def dsa_layout(meta: Optional["AttentionMetadata"], num_tokens: int, cache_block_size: Optional[int],
               device: torch.device) -> DSALayout:
    """The layout of a forward of ``num_tokens`` rows (sync-free; host ints from the metadata).

    * ``meta is None``: one causal sequence of all rows, virtual block table ``[0 .. T - 1]``.
    * ``cache_block_size is None`` (no cache): each sequence within its own new rows
      (``seq_len = q_len``), virtual block tables over the rows, block size 1.
    * else: the metadata's own ``query_start_loc``, ``seq_lens``, ``block_tables`` and the cache's
      block size.
    """
    t = num_tokens
    rows = torch.arange(t, device=device)
    if meta is None:
        qsl = torch.tensor([0, t], dtype=torch.int32, device=device)
        seq_lens = qsl[1:].clone()
        bt = rows.view(1, t) if t else torch.zeros(1, 1, dtype=torch.int64, device=device)
        bs, max_q, max_s = 1, t, t
    else:
        b = meta.num_seqs
        qsl = meta.query_start_loc[:b + 1]
        if cache_block_size is None:
            max_q = max_s = meta.max_query_len
            seq_lens = (qsl[1:] - qsl[:-1]).to(torch.int32)
            offs = torch.arange(max(max_q, 1), device=device)
            bt = (qsl[:-1].long()[:, None] + offs[None, :]).clamp(0, max(t - 1, 0))
            bs = 1
        else:
            seq_lens, bt = meta.seq_lens[:b], meta.block_tables[:b]
            bs, max_q, max_s = int(cache_block_size), meta.max_query_len, meta.max_seq_len
    b = seq_lens.shape[0]
    q_lens = (qsl[1:] - qsl[:-1]).long()
    seq = torch.searchsorted(qsl, rows.to(qsl.dtype), right=True) - 1  # = over qsl[1:] (qsl[0] = 0); paged_common
    real = seq < b
    seq = seq.clamp(max=max(b - 1, 0))
    row_pos = seq_lens.long()[seq] - q_lens[seq] + (rows - qsl.long()[seq])
    return DSALayout(qsl, seq_lens, bt, bs, max_q, max_s, seq, real, row_pos,
                     meta is not None and cache_block_size is not None)


def causal_selection(topk_pos: torch.Tensor, layout: DSALayout) -> torch.Tensor:
    """``topk_pos [T, K]`` with every entry outside ``[0, row_pos]`` and every padding row set to
    ``-1`` (a precomputed selection can never reach a row's future or another sequence)."""
    pos = topk_pos.long()
    ok = (pos >= 0) & (pos <= layout.row_pos[:, None]) & layout.real[:, None]
    return torch.where(ok, pos, -1)


class SparseMLABackend(MLABackend):
    """MLA's latent cache layout (:class:`~mtpspec.attention.backends.mla.MLABackend`), read sparsely."""

    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA"

    @staticmethod
    def get_impl_cls() -> Type["SparseMLAImpl"]:
        return SparseMLAImpl


class SparseMLAImpl(MLAImpl):
    """Absorbed MLA of ``num_heads`` heads over each row's selected latent entries (module docstring).

    Raises:
        ValueError: a size < 1.
    """

    def forward(self, layer: AttentionLayerBase, query: torch.Tensor, key: torch.Tensor,
                value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                attn_metadata: Optional["AttentionMetadata"], q_pe: Optional[torch.Tensor] = None,
                topk_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write this step's latent entries, then attend each row's selection.

        Args:
            layer: the calling layer (its fp8 ``k_scale``).
            query: ``q_latent [T, num_heads, kv_lora_rank]``; key: ``c_kv [T, kv_lora_rank]``;
                value: ``k_pe [T, rope]``; q_pe: ``[T, num_heads, rope]`` (MLA's inputs).
            kv_cache: ``None`` (each sequence within its own new rows) or ``[num_blocks,
                block_size, kv_lora_rank + rope]``.
            attn_metadata: the forward context's metadata or ``None`` (one causal sequence).
            topk_pos: ``[T, K]`` int positions in the row's sequence (``-1`` = none; distinct per
                row), any ``K``; entries past the row's position are ignored.

        Returns:
            ``o_latent [T, num_heads, kv_lora_rank]`` in ``query``'s dtype; padding rows zero.

        Raises:
            ValueError: a missing input, ``topk_pos`` not ``[T, K]``, a cache without metadata or
                block tables, short ``slot_mapping``, a cache of the wrong shape.
        """
        if q_pe is None or value is None or topk_pos is None:
            raise ValueError("sparse MLA: forward needs q_pe, k_pe and topk_pos")
        t = query.shape[0]
        nh, r, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        if topk_pos.dim() != 2 or topk_pos.shape[0] != t:
            raise ValueError(f"sparse MLA: topk_pos must be [num_tokens={t}, K], got {list(topk_pos.shape)}")
        ql = query.reshape(t, nh, r)
        qp = q_pe.reshape(t, nh, rope).to(ql.dtype)
        c_kv, k_pe = key.reshape(t, r), value.reshape(t, rope)
        meta = attn_metadata
        if meta is not None:
            check_metadata_rows(meta, t)
        if kv_cache is not None:
            if meta is None:
                raise ValueError("sparse MLA: a latent cache is attached but there is no attention metadata")
            cache = self._check_cache(kv_cache)
            check_cache_metadata(meta, t)
            self.do_kv_cache_update(layer, c_kv, k_pe, cache, meta.slot_mapping[:t])
            layout = dsa_layout(meta, t, cache.shape[1], ql.device)
        else:
            cache = torch.cat([c_kv, k_pe], dim=-1).to(ql.dtype)[:, None, :]  # [T, 1, r + rope]
            layout = dsa_layout(meta, t, None, ql.device)
        slots = positions_to_slots(causal_selection(topk_pos, layout), layout.token_seq_idx, layout.block_tables,
                                   layout.block_size)
        out = sparse_mla_attention(ql, qp, cache, slots, self.scale, k_scale=layer.k_scale)
        return torch.where(layout.real[:, None, None], out, torch.zeros_like(out))


__all__ = ["DSALayout", "SparseMLABackend", "SparseMLAImpl", "causal_selection", "dsa_layout"]
