"""MLAAttention: the cache-owning attention layer of DeepSeek-V3's multi-head latent attention.

The model does the projections (``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, rope on the rope parts, the absorption of ``kv_b_proj``'s key half into the
query and of its value half into the output); this layer owns the paged latent cache and the
attention between them, through :class:`~mtpspec.attention.backends.mla.MLABackend`. It reads
the same :class:`~mtpspec.layers.attention.AttentionMetadata` as the GQA
:class:`~mtpspec.layers.attention.Attention` and keeps its contract (no metadata: one causal
sequence; no cache: each sequence within its own new tokens; slot -1 never written; padding
rows zero; CUDA-graph safe).
"""

from __future__ import annotations

from typing import Optional, Type

import torch
from torch import nn

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionLayerBase
from mtpspec.attention.backends.mla import MLABackend
from mtpspec.attention.kv_cache_interface import AttentionSpec
from mtpspec.layers.attention import get_forward_context, write_cache_rows


class MLAAttention(nn.Module, AttentionLayerBase):
    """Absorbed multi-head latent attention of this rank's heads over a paged latent cache.

    Args:
        num_heads: query heads on this rank.
        kv_lora_rank: latent channels (512 in DeepSeek-V3).
        qk_rope_head_dim: channels of the shared rope key (64 in DeepSeek-V3).
        scale: softmax scale, e.g. ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` (times
            YaRN's ``mscale ** 2`` where the config asks for it).

    Attributes:
        kv_cache: ``None`` or ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
            (``c_kv`` then ``k_pe`` of each token), bound by the engine (:meth:`allocate_kv_cache`)
            or a test.
        impl: the backend's :class:`~mtpspec.attention.backends.mla.MLAImpl`.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        super().__init__()
        self.impl = MLABackend.get_impl_cls()(num_heads, kv_lora_rank, qk_rope_head_dim, scale)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.scale = float(scale)
        self.kv_cache: Optional[torch.Tensor] = None

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return MLABackend

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        """One latent entry per token shared by all heads: ``block_size * (kv_lora_rank +
        qk_rope_head_dim)`` values of ``dtype`` per block (not per-head K and V)."""
        return AttentionSpec(block_size=block_size, num_kv_heads=1,
                             head_size=self.kv_lora_rank + self.qk_rope_head_dim, dtype=dtype)

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        """Attend with the forward context's metadata.

        Args:
            q_latent: ``[num_tokens, num_heads, kv_lora_rank]``, ``q_nope`` already absorbed
                through ``kv_b_proj``'s key half (``q_nope @ W_UK`` per head).
            q_pe: ``[num_tokens, num_heads, qk_rope_head_dim]``, rope applied.
            c_kv: ``[num_tokens, kv_lora_rank]``, after ``kv_a_layernorm``.
            k_pe: ``[num_tokens, qk_rope_head_dim]``, rope applied.

        Returns:
            ``o_latent [num_tokens, num_heads, kv_lora_rank]`` in q_latent's dtype:
            ``softmax(scale * (q_latent . c_kv^T + q_pe . k_pe^T)) @ c_kv`` over each query's
            causal context (apply ``kv_b_proj``'s value half afterwards). With a cache, rows
            with slot >= 0 are written first and query ``j`` of sequence ``i`` attends to
            positions ``0 .. seq_len_i - q_len_i + j``; padding rows (past
            ``query_start_loc[-1]``) are zeros.

        Raises:
            ValueError: as :meth:`~mtpspec.attention.backends.mla.MLAImpl.forward`.
        """
        return self.impl.forward(self, q_latent, c_kv, k_pe, self.kv_cache, get_forward_context().attn_metadata,
                                 q_pe=q_pe)

    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Only write the latent entries ``[c_kv | k_pe]`` :meth:`forward` would write (a KV-cache-only
        pass; also :class:`~mtpspec.layers.sparse_mla_attention.SparseMLAAttention`'s): rows with
        slot >= 0 of the forward context's metadata, through the backend's ``do_kv_cache_update``
        (an fp8 cache quantised with ``k_scale``); nothing without a cache or metadata. No host sync.

        Args:
            c_kv: ``[num_tokens, kv_lora_rank]`` (after ``kv_a_layernorm``).
            k_pe: ``[num_tokens, qk_rope_head_dim]`` (rope applied).

        Raises:
            ValueError: metadata longer than the batch, short ``slot_mapping``, no block tables, a
                cache of the wrong shape.
        """
        t = c_kv.shape[0]
        write_cache_rows(self, c_kv.reshape(t, self.kv_lora_rank), k_pe.reshape(t, self.qk_rope_head_dim))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, backend={MLABackend.get_name()}")


__all__ = ["MLAAttention"]
