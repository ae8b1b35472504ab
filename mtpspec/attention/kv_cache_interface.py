"""What a layer keeps per KV-cache block: the spec the sizing reads (vLLM v1's names).

A *cache-owning layer* (:class:`~mtpspec.attention.backends.abstract.AttentionLayerBase`) answers
``get_kv_cache_spec(block_size, dtype)`` with a :class:`KVCacheSpec`. The engine sizes the cache
from ``page_size_bytes`` alone (summed over layers) and every layer's cache has the same number of
blocks of the same ``block_size``, so one block table addresses all of them (target, MTP, and any
second cache a layer owns, e.g. an indexer's keys). A layer that needs two caches owns one
cache-owning sub-module per cache. Per-layer scalars such as an fp8 scale are layer state, not
cache memory, and do not appear here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """One layer's cache, per block.

    Attributes:
        block_size: tokens per block (>= 1).
    """

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer's cache takes."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A cache of ``per_token_shape`` values of ``dtype`` per token.

    Attributes:
        num_kv_heads: heads stored per token on this rank (1 for a cache shared by all heads,
            e.g. an MLA latent or indexer keys).
        head_size: values per head.
        dtype: the stored dtype (e.g. ``torch.bfloat16``; ``torch.float8_e4m3fn`` for an fp8
            cache whose scale the layer keeps).
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def per_token_shape(self) -> Tuple[int, ...]:
        """Values stored per token, as a shape: ``(num_kv_heads, head_size)`` (one entry per
        token); subclasses that store more (keys and values) say so."""
        return (self.num_kv_heads, self.head_size)

    @property
    def page_size_bytes(self) -> int:
        """``block_size * prod(per_token_shape) * itemsize(dtype)``."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * math.prod(self.per_token_shape) * item


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Keys and values of every kv head: ``per_token_shape = (2, num_kv_heads, head_size)``, so
    ``page_size_bytes = 2 * block_size * num_kv_heads * head_size * itemsize``."""

    @property
    def per_token_shape(self) -> Tuple[int, ...]:
        return (2, self.num_kv_heads, self.head_size)


__all__ = ["AttentionSpec", "FullAttentionSpec", "KVCacheSpec"]
