"""The lightning indexer's paged key cache and selection: DeepSeek Sparse Attention's first half.

DeepSeek-V3.2-Exp report, sec. 2.1, eq. 1 (``transformers``' ``DeepseekV32Indexer``): per token,
one key of ``index_head_dim`` values (after ``wk``, ``k_norm`` and rope) is cached; a query row
scores every position of its causal context as ``sum_h w[t, h] * ReLU(q[t, h] . k[s])`` and keeps
the ``index_topk`` best (ties to the lower position).

Cache layout (:meth:`DeepseekV32IndexerBackend.get_kv_cache_shape`): ``[num_blocks, block_size,
index_head_dim]`` per layer with an indexer, addressed by the same block tables and slots as the
layer's latent cache (:class:`~mtpspec.attention.kv_cache_interface.AttentionSpec` with
``num_kv_heads=1``: ``block_size * index_head_dim`` values per block, summed into the KV sizing
like any cache; model dtype or E4M3 under ``--kv-cache-dtype fp8``, written as ``x /
layer.k_scale`` and dequantised tile by tile in the logits kernel). The ops
(:mod:`mtpspec.ops.indexer`: ``indexer_k_cache_write``, ``indexer_logits``, ``indexer_topk``) are
sync-free with static shapes, so the selection is CUDA-graph safe. Positions follow :func:`~mtpspec.attention.backends.sparse_mla.dsa_layout`
(the sparse attention reads the same layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, Type

import torch

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.paged_common import check_cache_metadata, check_metadata_rows
from mtpspec.attention.backends.sparse_mla import DSALayout, dsa_layout
from mtpspec.ops.indexer import indexer_k_cache_write, indexer_logits, indexer_topk

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata


class DeepseekV32IndexerBackend(AttentionBackend):
    """One indexer key ``[index_head_dim]`` per token in ``[num_blocks, block_size, index_head_dim]``."""

    @staticmethod
    def get_name() -> str:
        return "DSA_INDEXER"

    @staticmethod
    def get_impl_cls() -> Type["DeepseekV32IndexerImpl"]:
        return DeepseekV32IndexerImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``; ``head_size = index_head_dim``, ``num_kv_heads`` must be 1."""
        if num_kv_heads != 1:
            raise ValueError(f"the indexer caches one key per token (num_kv_heads=1), got num_kv_heads={num_kv_heads}")
        return (num_blocks, block_size, head_size)


class DeepseekV32IndexerImpl(AttentionImpl):
    """Key write and top-k selection of one indexer (``index_n_heads`` query heads of
    ``index_head_dim`` channels, ``index_topk`` positions kept).

    Its :meth:`forward` returns the selection, not an attention output (the indexer's "attention"
    is which positions the layer's sparse MLA reads).

    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, index_n_heads: int, index_head_dim: int, index_topk: int) -> None:
        for name, v in (("index_n_heads", index_n_heads), ("index_head_dim", index_head_dim),
                        ("index_topk", index_topk)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"indexer: {name} must be an int >= 1, got {v!r}")
        self.index_n_heads, self.index_head_dim, self.index_topk = index_n_heads, index_head_dim, index_topk

    def _check_cache(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() != 3 or c.shape[2] != self.index_head_dim:
            raise ValueError(f"indexer k_cache must be [num_blocks, block_size, index_head_dim = {self.index_head_dim}],"
                             f" got {list(c.shape)}")
        return c

    def do_kv_cache_update(self, layer: AttentionLayerBase, key: torch.Tensor, value: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key [n, index_head_dim]`` at ``slot_mapping [n]`` (-1 skipped; ``value`` unused)
        with :func:`~mtpspec.ops.indexer.indexer_k_cache_write` (an fp8 cache quantised with
        ``layer.k_scale``)."""
        indexer_k_cache_write(key, self._check_cache(kv_cache), slot_mapping, layer.k_scale)

    def update(self, layer: AttentionLayerBase, key: torch.Tensor, kv_cache: Optional[torch.Tensor],
               attn_metadata: Optional["AttentionMetadata"]) -> Tuple[torch.Tensor, DSALayout]:
        """Write this forward's keys (rows with slot >= 0) when a cache is attached; returns the
        cache to score against (the real one, or ``key`` itself as a virtual ``[T, 1, D]`` cache)
        and the :class:`~mtpspec.attention.backends.sparse_mla.DSALayout` that addresses it.

        Raises:
            ValueError: a cache without metadata or block tables, a short ``slot_mapping``, a
                cache of the wrong shape, metadata covering more rows than ``key``.
        """
        t = key.shape[0]
        meta = attn_metadata
        if meta is not None:
            check_metadata_rows(meta, t)
        if kv_cache is None:
            return key[:, None, :], dsa_layout(meta, t, None, key.device)
        if meta is None:
            raise ValueError("indexer: a key cache is attached but there is no attention metadata")
        cache = self._check_cache(kv_cache)
        check_cache_metadata(meta, t)
        self.do_kv_cache_update(layer, key, None, cache, meta.slot_mapping[:t])
        return cache, dsa_layout(meta, t, cache.shape[1], key.device)

    def forward(self, layer: AttentionLayerBase, query: torch.Tensor, key: torch.Tensor,
                value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                attn_metadata: Optional["AttentionMetadata"]) -> torch.Tensor:
        """Write the keys, score every row's causal context, keep the top ``index_topk``.

        Args:
            layer: the calling layer (its fp8 ``k_scale``).
            query: ``q [T, index_n_heads, index_head_dim]`` (rope applied).
            key: ``k [T, index_head_dim]`` (after ``k_norm`` and rope).
            value: ``weights [T, index_n_heads]`` fp32 (``weights_proj`` output with every scale
                folded in).
            kv_cache: ``None`` (each sequence within its own new rows) or ``[num_blocks,
                block_size, index_head_dim]``.
            attn_metadata: the forward context's metadata or ``None`` (one causal sequence).

        Returns:
            ``topk_pos [T, index_topk]`` int32 positions in each row's sequence (ascending; ties at
            the top-k boundary to the lower position, :func:`~mtpspec.ops.indexer.indexer_topk`),
            ``-1`` where a row has fewer selectable positions and on padding rows.

        Raises:
            ValueError: as :meth:`update`, or ``weights`` missing / of the wrong shape.
        """
        if value is None or value.shape != query.shape[:2]:
            raise ValueError(f"indexer: weights must be [T, index_n_heads] = {list(query.shape[:2])}, got "
                             f"{None if value is None else list(value.shape)}")
        cache, layout = self.update(layer, key, kv_cache, attn_metadata)
        logits = indexer_logits(query, value.float(), cache, layout.query_start_loc, layout.seq_lens,
                                layout.block_tables, layout.max_query_len, layout.max_seq_len,
                                k_scale=layer.k_scale)
        pos = indexer_topk(logits, self.index_topk)
        return torch.where(layout.real[:, None], pos, torch.full_like(pos, -1))


__all__ = ["DeepseekV32IndexerBackend", "DeepseekV32IndexerImpl"]
