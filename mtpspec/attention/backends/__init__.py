"""Attention backends: :mod:`.abstract` (the interface), :mod:`.paged_gqa` (paged GQA, today's)."""

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.paged_gqa import PagedGQABackend, PagedGQAImpl

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase", "PagedGQABackend", "PagedGQAImpl"]
