"""Rotary position embedding (RoPE) on a leading fraction of each head.

RoPE: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", eq. 34:
channel pair ``(a, b)`` at position ``p`` with frequency ``w_i = base ** (-2 i / rotary_dim)``
becomes ``(a cos(p w_i) - b sin(p w_i), b cos(p w_i) + a sin(p w_i))``.

Only the first ``rotary_dim`` channels of each head rotate (GLM-4.5's ``partial_rotary_factor``
of 0.5); the rest pass through. Two pairings exist:

* neox style (``is_neox_style=True``, what Hugging Face's GLM-4-MoE does with ``rotate_half``):
  channel ``i`` pairs with channel ``i + rotary_dim / 2``;
* interleaved (GPT-J / dense GLM-4 style): channel ``2 i`` pairs with ``2 i + 1``.

Angles are computed in fp32 exactly as Hugging Face does (``position.float() * inv_freq``);
``cos``/``sin`` are cast to the query dtype before the rotation, as Hugging Face does. The
rotation itself is :func:`mtpspec.ops.rotary.rotary_embedding` (one Triton launch for the query
and the key in bf16, bit-identical to its torch reference).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from mtpspec.ops.rotary import rotary_embedding


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the rotary part of every query and key head.

    Args:
        head_size: channels per head.
        rotary_dim: rotated channels per head (even, ``<= head_size``).
        max_position_embeddings: positions must lie in ``[0, max_position_embeddings)``.
        base: the RoPE base (``rope_theta``).
        is_neox_style: pairing, see the module docstring.
        inv_freq: ``[rotary_dim / 2]`` fp32 inverse frequencies replacing ``base ** (-2 i /
            rotary_dim)`` (scaled rope such as YaRN, computed by the caller).
        attention_factor: multiplies cos and sin (in fp32, as Hugging Face's scaled ropes do).

    Raises:
        ValueError: rotary_dim odd, non-positive or larger than head_size.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool = True, inv_freq: Optional[torch.Tensor] = None,
                 attention_factor: float = 1.0) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        if inv_freq is None:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        elif tuple(inv_freq.shape) != (rotary_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({rotary_dim // 2},), got {tuple(inv_freq.shape)}")
        inv_freq = inv_freq.float()
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim / 2], fp32
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_sin_cache", torch.cat([cos, sin], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys.

        Args:
            positions: ``[num_tokens]`` int32 / int64, each in ``[0, max_position_embeddings)`` (not
                checked on the device: an index past the cache is an indexing error on CPU).
            query: ``[num_tokens, num_heads * head_size]``.
            key: ``[num_tokens, num_kv_heads * head_size]``.

        Returns:
            ``(query, key)``: new tensors of the input shapes and dtypes.

        Raises:
            ValueError: shapes that do not fit together (:func:`~mtpspec.ops.rotary.rotary_embedding`).
        """
        return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim,
                                self.is_neox_style)

    def forward_key(self, positions: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Rotate keys only (a KV-cache-only pass): :meth:`forward`'s key output, by the same ops,
        for a query of ``key``'s dtype.

        Args:
            positions: ``[num_tokens]`` int64 (as :meth:`forward`).
            key: ``[num_tokens, num_kv_heads * head_size]``.

        Returns:
            a new tensor of ``key``'s shape and dtype.

        Raises:
            ValueError: ``positions`` not 1-D or not one per key row.
        """
        if positions.dim() != 1 or positions.shape[0] != key.shape[0]:
            raise ValueError(f"positions {tuple(positions.shape)} and key {tuple(key.shape)} must share the token "
                             "dimension (positions 1-D)")
        # an empty query ([T, 0]): the op's key half alone
        return rotary_embedding(positions, key[:, :0], key, self.cos_sin_cache, self.head_size, self.rotary_dim,
                                self.is_neox_style)[1]

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, base={self.base}, "
                f"neox={self.is_neox_style}")


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             is_neox_style: bool = True) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` (vLLM's factory name; only default RoPE is supported)."""
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
