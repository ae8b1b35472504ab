"""Attention backends: :mod:`.abstract` (the interface), :mod:`.paged_gqa` (paged GQA, GLM-4.5),
:mod:`.mla` (MLA over a paged latent cache, DeepSeek-V3)."""

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.mla import MLABackend, MLAImpl
from mtpspec.attention.backends.paged_gqa import PagedGQABackend, PagedGQAImpl

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase", "MLABackend", "MLAImpl", "PagedGQABackend",
           "PagedGQAImpl"]
