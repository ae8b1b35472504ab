"""SparseMLAAttention: MLA's cache-owning layer, attending only each row's selected positions.

DeepSeek Sparse Attention (DeepSeek-V3.2-Exp report, sec. 2.1; ``transformers``'
``DeepseekV32Attention`` / ``GlmMoeDsaAttention``, which mask every unselected key): the model
does MLA's projections and absorption exactly as for DeepSeek-V3
(:class:`~mtpspec.layers.mla_attention.MLAAttention`) and passes the indexer's selection; this
layer owns the same paged latent cache and reads it through
:class:`~mtpspec.attention.backends.sparse_mla.SparseMLABackend`. The contract of
:class:`~mtpspec.layers.mla_attention.MLAAttention` holds (no metadata: one causal sequence; no
cache: each sequence within its own new tokens; slot -1 never written; padding rows zero;
CUDA-graph safe).
"""

from __future__ import annotations

from typing import Type

import torch

from mtpspec.attention.backends.abstract import AttentionBackend
from mtpspec.attention.backends.sparse_mla import SparseMLABackend
from mtpspec.layers.attention import get_forward_context
from mtpspec.layers.mla_attention import MLAAttention


class SparseMLAAttention(MLAAttention):
    """Absorbed MLA over each row's selected latent entries (arguments as :class:`MLAAttention`).

    Attributes:
        kv_cache: ``None`` or ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.
        impl: :class:`~mtpspec.attention.backends.sparse_mla.SparseMLAImpl`.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, scale)
        self.impl = SparseMLABackend.get_impl_cls()(num_heads, kv_lora_rank, qk_rope_head_dim, scale)

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return SparseMLABackend

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                topk_pos: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Attend with the forward context's metadata.

        Args:
            q_latent, q_pe, c_kv, k_pe: as :meth:`MLAAttention.forward`.
            topk_pos: ``[num_tokens, K]`` int positions in each row's sequence (``-1`` = none),
                e.g. the :class:`~mtpspec.layers.indexer.Indexer`'s selection.

        Returns:
            ``o_latent [num_tokens, num_heads, kv_lora_rank]`` in ``q_latent``'s dtype: MLA's
            ``softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv`` over the selected
            positions that lie in the row's causal context (all of them when the selection holds
            the whole context: then equal to :class:`MLAAttention`).

        Raises:
            ValueError: as :meth:`~mtpspec.attention.backends.sparse_mla.SparseMLAImpl.forward`.
        """
        return self.impl.forward(self, q_latent, c_kv, k_pe, self.kv_cache, get_forward_context().attn_metadata,
                                 q_pe=q_pe, topk_pos=topk_pos)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, backend={SparseMLABackend.get_name()}")


__all__ = ["SparseMLAAttention"]
