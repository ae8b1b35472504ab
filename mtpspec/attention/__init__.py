"""Attention backends and the KV-cache specs they answer the engine's sizing with.

A backend (:class:`~mtpspec.attention.backends.abstract.AttentionBackend`) owns a cache layout
and dtype (``get_kv_cache_shape``, ``allocate_kv_cache``), its write (``do_kv_cache_update``) and
its read (``forward``); a cache-owning layer
(:class:`~mtpspec.attention.backends.abstract.AttentionLayerBase`) reports
``get_kv_cache_spec(block_size, dtype)``, whose ``page_size_bytes`` is all the sizing reads.
The layer the models build, the metadata and the forward context live in
:mod:`mtpspec.layers.attention`.
"""

from mtpspec.attention.backends import (AttentionBackend, AttentionImpl, AttentionLayerBase, MLABackend, MLAImpl,
                                        PagedGQABackend, PagedGQAImpl)
from mtpspec.attention.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase", "AttentionSpec", "FullAttentionSpec",
           "KVCacheSpec", "MLABackend", "MLAImpl", "PagedGQABackend", "PagedGQAImpl"]
