"""The attention-backend interface: a backend owns its KV-cache layout, dtype, write and read.

Three parts, with vLLM's names:

- :class:`AttentionBackend` (a class of static methods): ``get_name``, ``get_impl_cls``,
  ``get_kv_cache_shape`` (the cache tensor's layout for ``num_blocks``), ``allocate_kv_cache``
  and ``copy_blocks`` (prefix caching's private copies; ``block_dim`` names the block axis).
- :class:`AttentionImpl`: one layer's attention; ``do_kv_cache_update`` writes this step's cache
  entries (K/V, a latent, indexer keys), ``forward`` writes and attends over the paged cache.
- :class:`AttentionLayerBase`: what the KV-cache sizing and allocation
  (:mod:`mtpspec.engine.kv_cache`) see of a layer: ``get_kv_cache_spec`` (bytes per block via
  :class:`~mtpspec.attention.kv_cache_interface.KVCacheSpec`), ``get_attn_backend`` and the bound
  ``kv_cache``. Sizing and the model runner never look inside a spec beyond ``page_size_bytes``.

Every backend reads the same :class:`~mtpspec.layers.attention.AttentionMetadata` (block tables,
slot mapping; slot ``-1`` = padding row, never written) and must stay CUDA-graph safe: no host
syncs and no data-dependent shapes in ``do_kv_cache_update`` / ``forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional, Tuple, Type, Union

import torch

from mtpspec.attention.kv_cache_interface import AttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata


class AttentionImpl(ABC):
    """One layer's attention computation over its paged cache (stateless apart from shapes)."""

    @abstractmethod
    def do_kv_cache_update(self, layer: "AttentionLayerBase", key: torch.Tensor, value: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's cache entries of rows ``0 .. n - 1`` at ``slot_mapping [n]`` (int64,
        ``block_id * block_size + offset``; ``-1``: skip the row) in ``kv_cache`` (the backend's
        layout, :meth:`AttentionBackend.get_kv_cache_shape`). ``key`` / ``value``: what the
        backend caches per token (GQA: ``[n, num_kv_heads, head_size]`` keys and values; a
        one-entry cache such as an MLA latent passes ``value=None`` or its second part).
        Converts to the cache dtype (with the layer's scale where the backend quantises)."""

    @abstractmethod
    def forward(self, layer: "AttentionLayerBase", query: torch.Tensor, key: torch.Tensor,
                value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                attn_metadata: Optional["AttentionMetadata"]) -> torch.Tensor:
        """Write this step's entries (rows with slot >= 0), then attend over the paged cache.

        Args:
            layer: the calling layer (per-layer state such as scales).
            query: ``[num_tokens, num_heads * head_size]``; key / value: the backend's inputs.
            kv_cache: the layer's cache or ``None`` (no cache: each sequence attends within its
                own new tokens).
            attn_metadata: the forward context's metadata, or ``None`` (one causal sequence).

        Returns:
            ``[num_tokens, num_heads * v_head_size]`` in ``query``'s dtype; padding rows zero.
        """


class AttentionBackend(ABC):
    """A cache layout + the attention that reads it. Subclasses are used as classes (vLLM)."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """Short name, e.g. ``"PAGED_GQA"``."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        """The :class:`AttentionImpl` of this backend."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        """Shape of one layer's cache tensor for ``num_blocks`` blocks; its element count must
        equal ``num_blocks * page_size_bytes / itemsize`` of the layer's spec (checked by
        :meth:`AttentionLayerBase.allocate_kv_cache`)."""

    #: the block axis of :meth:`get_kv_cache_shape`'s layout
    block_dim: int = 0

    @classmethod
    def copy_blocks(cls, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``kv_cache``'s block ``dst[i]`` becomes a copy of block ``src[i]`` (``src`` / ``dst``:
        ``[n]`` int64 on the cache's device; every source is read before any destination is
        written). Layouts whose block axis is not 0 set :attr:`block_dim`."""
        raw = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache  # fp8: copy the bytes
        raw.index_copy_(cls.block_dim, dst, raw.index_select(cls.block_dim, src))

    @classmethod
    def allocate_kv_cache(cls, spec: AttentionSpec, num_blocks: int,
                          device: Union[str, torch.device]) -> torch.Tensor:
        """A zeroed cache ``get_kv_cache_shape(num_blocks, ...)`` of ``spec.dtype`` on ``device``."""
        shape = cls.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        return torch.zeros(shape, dtype=spec.dtype, device=device)


class AttentionLayerBase(ABC):
    """A module that owns one paged cache. The engine finds these modules in a model
    (:func:`~mtpspec.layers.attention.collect_attention_layers`), sums their
    ``get_kv_cache_spec(...).page_size_bytes`` to size the cache, and calls
    :meth:`allocate_kv_cache` on each.

    Attributes:
        kv_cache: ``None`` or the tensor bound by :meth:`allocate_kv_cache` (or by a test).
        k_scale, v_scale: the layer's fp8 cache scales (vLLM's names; a float per layer, 1.0 when
            the checkpoint gives none, as vLLM does): an fp8 cache stores ``x / scale`` and is
            read as ``x * scale`` (:mod:`mtpspec.ops.kv_quant`). ``k_scale`` scales a one-part
            cache (an MLA latent, indexer keys); ignored by caches of any other dtype.
    """

    kv_cache: Optional[torch.Tensor]
    k_scale: float = 1.0
    v_scale: float = 1.0

    @abstractmethod
    def get_attn_backend(self) -> Type[AttentionBackend]:
        """The backend that lays out, writes and reads this layer's cache."""

    @abstractmethod
    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This layer's cache per block of ``block_size`` tokens, when the engine's cache dtype
        is ``dtype`` (the model dtype, or ``torch.float8_e4m3fn`` under ``--kv-cache-dtype fp8``).
        The layer / backend decides the stored dtype and shape."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """Allocate this layer's zeroed cache for ``num_blocks`` blocks, bind it to ``kv_cache``
        and return it.

        Raises:
            ValueError: the backend's tensor does not take ``num_blocks * page_size_bytes``
                bytes (its layout disagrees with the spec the sizing used).
        """
        spec = self.get_kv_cache_spec(block_size, dtype)
        cache = self.get_attn_backend().allocate_kv_cache(spec, num_blocks, device)
        if cache.numel() * cache.element_size() != num_blocks * spec.page_size_bytes:
            raise ValueError(f"{self.get_attn_backend().get_name()}: cache {tuple(cache.shape)} {cache.dtype} takes "
                             f"{cache.numel() * cache.element_size()} bytes, its spec says {num_blocks} x "
                             f"{spec.page_size_bytes}")
        self.kv_cache = cache
        return cache


__all__ = ["AttentionBackend", "AttentionImpl", "AttentionLayerBase"]
