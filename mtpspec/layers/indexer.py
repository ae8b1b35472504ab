"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5), with its paged key cache.

DeepSeek-V3.2-Exp report, sec. 2.1, eq. 1; computed as ``transformers``' ``DeepseekV32Indexer``
(half-split rope) and ``GlmMoeDsaIndexer`` (interleaved rope) do, for each token ``t``::

    q[t]  = wq_b(q_resid[t])                 [index_n_heads, index_head_dim]; q_resid = MLA's q_a_layernorm output
    k[t]  = k_norm(wk(x[t]))                 [index_head_dim]; k_norm: LayerNorm with bias, eps 1e-6
    rope on the first qk_rope_head_dim channels of q[t, h] and k[t] (MLA's frequencies and YaRN factor)
    w[t]  = weights_proj(x[t]) * index_n_heads ** -0.5 * index_head_dim ** -0.5    fp32
    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])          fp32, for s <= position of t
    topk_pos[t] = the index_topk positions s of largest I[t, s] (ties to the lower position)

``transformers`` scales ``q . k`` by ``index_head_dim ** -0.5`` before the ReLU; folding it into
``w`` is the same number in exact arithmetic (``ReLU(c x) = c ReLU(x)``, ``c > 0``). All
projections are replicated: every tensor-parallel rank computes the whole selection (the same
on every rank up to the summation order of its inputs). The keys are cached per token in the
layer's own paged cache (:class:`DeepseekV32IndexerCache`, same block tables as the latent cache),
written on every forward.

:class:`IndexSelection` carries a selection from the layer that computed it to the layers that
reuse it (GLM-5's ``"shared"`` layers) within one forward, and keeps an MTP layer's latest
selection readable (:meth:`mtpspec.models.deepseek_v32_mtp.DeepseekV32MTP.index_selection`).
"""

from __future__ import annotations

from typing import Optional, Type

import torch
from torch import nn

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionLayerBase
from mtpspec.attention.backends.indexer import DeepseekV32IndexerBackend
from mtpspec.attention.kv_cache_interface import AttentionSpec
from mtpspec.layers.attention import get_forward_context
from mtpspec.layers.layernorm import LayerNorm
from mtpspec.layers.linear import ReplicatedLinear

#: eps of the indexer's k_norm (transformers builds nn.LayerNorm(index_head_dim, eps=1e-6))
K_NORM_EPS = 1e-6


class IndexSelection:
    """A selection handed between DSA layers: ``topk_pos`` is ``None`` or ``[T, K]`` int positions.

    The layers of one target model share one instance (a ``"full"`` layer writes it, the
    ``"shared"`` layers after it read it; the model clears it after its forward); each MTP layer
    owns one, which keeps its latest selection.
    """

    __slots__ = ("topk_pos",)

    def __init__(self) -> None:
        self.topk_pos: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        shape = None if self.topk_pos is None else list(self.topk_pos.shape)
        return f"IndexSelection(topk_pos={shape})"


def apply_indexer_rope(x: torch.Tensor, cos_sin: torch.Tensor, rope_dim: int, interleave: bool) -> torch.Tensor:
    """Rope on the first ``rope_dim`` channels of ``x [T, n, D]``, as ``transformers``' indexers do.

    ``cos_sin [T, rope_dim]`` holds each row's ``cos`` then ``sin`` halves (a
    :class:`~mtpspec.layers.rotary_embedding.RotaryEmbedding`'s ``cos_sin_cache`` rows, YaRN factor
    included), cast to ``x``'s dtype. Pairs are ``(i, i + rope_dim / 2)`` (half-split,
    ``apply_rotary_pos_emb``) or ``(2i, 2i + 1)`` (``apply_rotary_pos_emb_interleave``, whose
    output is laid out de-interleaved: rotated even channels, then odd ones). Queries and keys use
    the same layout, so their dot products are those of ``transformers``.
    """
    half = rope_dim // 2
    cos = cos_sin[:, None, :half].to(x.dtype)
    sin = cos_sin[:, None, half:].to(x.dtype)
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleave else (rot[..., :half], rot[..., half:])
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class DeepseekV32IndexerCache(nn.Module, AttentionLayerBase):
    """The indexer's cache-owning layer (vLLM's name): one key of ``index_head_dim`` values per
    token, through :class:`~mtpspec.attention.backends.indexer.DeepseekV32IndexerBackend`.

    Args:
        index_n_heads, index_head_dim, index_topk: the indexer's sizes.

    Attributes:
        kv_cache: ``None`` or ``[num_blocks, block_size, index_head_dim]``, bound by the engine
            (:meth:`allocate_kv_cache`) or a test.
    """

    def __init__(self, index_n_heads: int, index_head_dim: int, index_topk: int) -> None:
        super().__init__()
        self.impl = DeepseekV32IndexerBackend.get_impl_cls()(index_n_heads, index_head_dim, index_topk)
        self.index_head_dim = index_head_dim
        self.kv_cache: Optional[torch.Tensor] = None

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return DeepseekV32IndexerBackend

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        """``block_size * index_head_dim`` values of ``dtype`` per block."""
        return AttentionSpec(block_size=block_size, num_kv_heads=1, head_size=self.index_head_dim, dtype=dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Write ``k`` and select: :meth:`~mtpspec.attention.backends.indexer.DeepseekV32IndexerImpl.forward`
        with the forward context's metadata; ``[T, index_topk]`` int32 positions."""
        return self.impl.forward(self, q, k, weights, self.kv_cache, get_forward_context().attn_metadata)

    def write(self, k: torch.Tensor) -> None:
        """Only write ``k [T, index_head_dim]`` (when a cache is attached)."""
        self.impl.update(self, k, self.kv_cache, get_forward_context().attn_metadata)

    def extra_repr(self) -> str:
        return f"index_head_dim={self.index_head_dim}, backend={DeepseekV32IndexerBackend.get_name()}"


class Indexer(nn.Module):
    """The lightning indexer of one attention layer (module docstring), replicated on every rank.

    Args:
        hidden_size: the model width (input of ``wk`` and ``weights_proj``).
        q_lora_rank: width of MLA's ``q_a_layernorm`` output (input of ``wq_b``).
        index_n_heads, index_head_dim, index_topk: the indexer's sizes.
        qk_rope_head_dim: rotary channels (the first of each ``index_head_dim``).
        rope_interleave: rope pairing (False: DeepSeek-V3.2's half-split; True: GLM-5's).
        params_dtype: dtype of ``wq_b``, ``wk``, ``k_norm`` (and of the cached keys' source);
            ``weights_proj`` is always fp32 (``transformers`` keeps it in fp32).

    Parameters (checkpoint names under ``self_attn.indexer.``): ``wq_b.weight [index_n_heads *
    index_head_dim, q_lora_rank]``, ``wk.weight [index_head_dim, hidden_size]``,
    ``k_norm.weight`` / ``k_norm.bias [index_head_dim]``, ``weights_proj.weight [index_n_heads,
    hidden_size]``.

    Raises:
        ValueError: a size < 1 or ``qk_rope_head_dim`` odd or larger than ``index_head_dim``.
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, index_n_heads: int, index_head_dim: int,
                 index_topk: int, qk_rope_head_dim: int, rope_interleave: bool,
                 params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if qk_rope_head_dim < 2 or qk_rope_head_dim % 2 or qk_rope_head_dim > index_head_dim:
            raise ValueError(f"indexer: qk_rope_head_dim={qk_rope_head_dim} must be even and within "
                             f"index_head_dim={index_head_dim}")
        self.index_n_heads, self.index_head_dim, self.index_topk = index_n_heads, index_head_dim, index_topk
        self.qk_rope_head_dim, self.rope_interleave = qk_rope_head_dim, bool(rope_interleave)
        self.wq_b = ReplicatedLinear(q_lora_rank, index_n_heads * index_head_dim, bias=False,
                                     params_dtype=params_dtype)
        self.wk = ReplicatedLinear(hidden_size, index_head_dim, bias=False, params_dtype=params_dtype)
        self.k_norm = LayerNorm(index_head_dim, K_NORM_EPS, params_dtype)
        self.weights_proj = ReplicatedLinear(hidden_size, index_n_heads, bias=False, params_dtype=torch.float32,
                                             quantize=False)
        #: index_n_heads ** -0.5 (transformers' head weighting) * index_head_dim ** -0.5 (its softmax_scale)
        self.weights_scale = index_n_heads ** -0.5 * index_head_dim ** -0.5
        self.k_cache = DeepseekV32IndexerCache(index_n_heads, index_head_dim, index_topk)
        #: MTP index sharing (:mod:`mtpspec.spec_decode.index_share`): set on MTP layers' indexers
        #: by the proposer when ``index_share_for_mtp_iteration`` is on, else ``None``.
        self.share = None

    def _keys(self, hidden_states: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
        """``rope(k_norm(wk(hidden_states)))`` ``[T, index_head_dim]`` (``cs``: each row's cos / sin)."""
        k = self.k_norm(self.wk(hidden_states))
        return apply_indexer_rope(k[:, None, :], cs, self.qk_rope_head_dim, self.rope_interleave)[:, 0]

    def write_keys(self, hidden_states: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
        """Only compute and write this forward's keys (a KV-cache-only pass): the key cache entries
        :meth:`forward` writes, by the same ops; no query, weights, scoring or selection, and the
        sharing state (``self.share``) is neither read nor recorded. Arguments as :meth:`forward`
        (no ``q_resid``). No host sync.

        Raises:
            ValueError: the backend's metadata / cache errors (a cache attached without metadata).
        """
        cs = cos_sin_cache.index_select(0, positions.long())
        self.k_cache.write(self._keys(hidden_states, cs))

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """This forward's selection; the keys are written to the cache in every case.

        Args:
            hidden_states: ``[T, hidden_size]`` (the attention's input).
            q_resid: ``[T, q_lora_rank]``, MLA's ``q_a_layernorm(q_a_proj(x))``.
            positions: ``[T]`` int64 rope positions.
            cos_sin_cache: ``[max_positions, qk_rope_head_dim]`` cos / sin table (MLA's
                :class:`~mtpspec.layers.rotary_embedding.RotaryEmbedding` ``cos_sin_cache``).

        Returns:
            ``[T, K]`` int positions (``-1`` = none): in a sharing round's draft step
            (``self.share.mode == "reuse"``) the shared selection
            (:meth:`~mtpspec.spec_decode.index_share.IndexShareState.shared_selection`, scoring
            skipped); else the forward context's ``attn_metadata.precomputed_topk_pos`` when set
            (the query, the weights and the scoring are skipped); else this indexer's top
            ``index_topk`` (``K = index_topk``,
            :meth:`~mtpspec.attention.backends.indexer.DeepseekV32IndexerImpl.forward`), also
            recorded at the anchor rows in a sharing round's first pass (``"record"``).

        Raises:
            ValueError: a precomputed selection that is not ``[T, K]`` of an integer dtype, or
                the backend's metadata / cache errors.
        """
        t = hidden_states.shape[0]
        cs = cos_sin_cache.index_select(0, positions.long())
        k = self._keys(hidden_states, cs)
        meta = get_forward_context().attn_metadata
        share = self.share
        if share is not None and share.mode == "reuse":  # a draft step of a sharing round
            self.k_cache.write(k)
            return share.shared_selection(positions)
        given = meta.precomputed_topk_pos if meta is not None else None
        if given is not None:
            if given.dim() != 2 or given.shape[0] != t or given.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"precomputed_topk_pos must be [num_tokens={t}, K] int32 / int64, got "
                                 f"{list(given.shape)} {given.dtype}")
            self.k_cache.write(k)
            return given
        q = self.wq_b(q_resid).view(t, self.index_n_heads, self.index_head_dim)
        q = apply_indexer_rope(q, cs, self.qk_rope_head_dim, self.rope_interleave)
        weights = self.weights_proj(hidden_states.float()) * self.weights_scale
        topk_pos = self.k_cache(q, k, weights)
        if share is not None:
            share.num_scoring_calls += 1
            if share.mode == "record" and meta is not None:  # the round's first draft pass
                share.record(topk_pos, positions, meta.num_seqs)
        return topk_pos

    def extra_repr(self) -> str:
        return (f"index_n_heads={self.index_n_heads}, index_head_dim={self.index_head_dim}, "
                f"index_topk={self.index_topk}, rope={'interleaved' if self.rope_interleave else 'half-split'}")


__all__ = ["DeepseekV32IndexerCache", "IndexSelection", "Indexer", "K_NORM_EPS", "apply_indexer_rope"]
