"""Attention backends: :mod:`.abstract` (the interface), :mod:`.paged_gqa` (paged GQA, GLM-4.5),
:mod:`.mla` (MLA over a paged latent cache, DeepSeek-V3), :mod:`.sparse_mla` and :mod:`.indexer`
(DeepSeek Sparse Attention, DeepSeek-V3.2 / GLM-5: MLA over each token's selected positions; the
lightning indexer's key cache and top-k selection)."""

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.indexer import DeepseekV32IndexerBackend, DeepseekV32IndexerImpl
from mtpspec.attention.backends.mla import MLABackend, MLAImpl
from mtpspec.attention.backends.paged_gqa import PagedGQABackend, PagedGQAImpl
from mtpspec.attention.backends.sparse_mla import SparseMLABackend, SparseMLAImpl

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase", "DeepseekV32IndexerBackend",
           "DeepseekV32IndexerImpl", "MLABackend", "MLAImpl", "PagedGQABackend", "PagedGQAImpl", "SparseMLABackend",
           "SparseMLAImpl"]
