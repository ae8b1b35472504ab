"""MLA over a paged latent cache: DeepSeek-V3's attention (absorbed form).

Cache layout (:meth:`MLABackend.get_kv_cache_shape`): one tensor
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer, one entry per token shared
by all heads: the post-``kv_a_layernorm`` latent ``c_kv`` then the post-rope key ``k_pe``
(:class:`~mtpspec.attention.kv_cache_interface.AttentionSpec` with ``num_kv_heads=1``; 576 values
per token at DeepSeek-V3 sizes instead of 128 heads x 2 x 128), of the model dtype or E4M3
(``--kv-cache-dtype fp8``: written as ``x / layer.k_scale``, dequantised tile by tile in the
kernel's pointer path, never its bulk-copy path; the SDPA path dequantises the gathered context;
:mod:`mtpspec.ops.kv_quant`).

Attention (DeepSeek-V3 paper, sec. 2.1.1): with ``kv_b_proj``'s key half folded into the query
(``q_latent``) and its value half applied by the caller afterwards, every head attends one
shared latent "head": MQA with keys ``[c_kv | k_pe]`` (``kv_lora_rank + rope`` channels) and
values ``c_kv``. Two paths behind one contract, both sync-free with static shapes (CUDA-graph
safe), chosen like paged GQA's (:func:`~mtpspec.attention.backends.paged_gqa.use_attention_kernel`):
the Triton kernel :func:`~mtpspec.ops.mla_attention.mla_attention` (decode, verification, draft
steps; every head of a sequence shares each latent tile it loads), and a torch path with every
sequence of the batch in one padded SDPA call (the latent context gathered through the block
tables; one key/value head broadcast to all query heads; prefill and CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, Type

import torch

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.paged_common import (cache_key_slots, check_cache_metadata, check_metadata_rows,
                                                     padded_batch, sdpa)
from mtpspec.attention.backends.paged_gqa import use_attention_kernel
from mtpspec.ops.kv_quant import dequantize_cache, is_fp8
from mtpspec.ops.mla_attention import mla_attention, write_mla_kv_cache

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata


class MLABackend(AttentionBackend):
    """One latent entry ``[kv_lora_rank + rope]`` per token in ``[num_blocks, block_size, entry]``."""

    @staticmethod
    def get_name() -> str:
        return "MLA"

    @staticmethod
    def get_impl_cls() -> Type["MLAImpl"]:
        return MLAImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``; ``head_size = kv_lora_rank + rope`` and
        ``num_kv_heads`` must be 1 (one entry per token shared by all heads)."""
        if num_kv_heads != 1:
            raise ValueError(f"MLA caches one latent entry per token (num_kv_heads=1), got num_kv_heads={num_kv_heads}")
        return (num_blocks, block_size, head_size)


class MLAImpl(AttentionImpl):
    """Absorbed MLA of ``num_heads`` query heads over one latent of ``kv_lora_rank`` channels
    plus a shared rope key of ``qk_rope_head_dim`` channels.

    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        for name, v in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MLA: {name} must be an int >= 1, got {v!r}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.entry = kv_lora_rank + qk_rope_head_dim
        self.scale = float(scale)

    def _check_cache(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() != 3 or c.shape[2] != self.entry:
            raise ValueError(f"kv_cache must be [num_blocks, block_size, kv_lora_rank + rope = {self.entry}], "
                             f"got {tuple(c.shape)}")
        return c

    def do_kv_cache_update(self, layer: AttentionLayerBase, key: torch.Tensor, value: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``[c_kv | k_pe]`` (``key`` = ``c_kv [n, kv_lora_rank]``, ``value`` = ``k_pe
        [n, rope]``) at ``slot_mapping [n]`` (-1 skipped) with
        :func:`~mtpspec.ops.mla_attention.write_mla_kv_cache` (Triton or its torch reference; an
        fp8 cache quantised with ``layer.k_scale``)."""
        if value is None:
            raise ValueError("MLA: do_kv_cache_update needs k_pe as `value`")
        write_mla_kv_cache(key, value, kv_cache, slot_mapping, layer.k_scale)

    def forward(self, layer: AttentionLayerBase, query: torch.Tensor, key: torch.Tensor,
                value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                attn_metadata: Optional["AttentionMetadata"], q_pe: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attend (the :class:`~mtpspec.attention.backends.abstract.AttentionImpl` contract with
        MLA's inputs).

        Args:
            layer: the calling layer (its fp8 ``k_scale``).
            query: ``q_latent [num_tokens, num_heads, kv_lora_rank]``.
            key: ``c_kv [num_tokens, kv_lora_rank]`` (post ``kv_a_layernorm``).
            value: ``k_pe [num_tokens, rope]`` (rope applied).
            kv_cache: ``None`` or ``[num_blocks, block_size, kv_lora_rank + rope]``.
            attn_metadata: the forward context's metadata or ``None`` (one causal sequence).
            q_pe: ``[num_tokens, num_heads, rope]`` (rope applied); required.

        Returns:
            ``o_latent [num_tokens, num_heads, kv_lora_rank]`` in ``query``'s dtype; padding rows
            (past ``query_start_loc[-1]``) are zeros. With a cache, rows with slot >= 0 are
            written first; query ``j`` of sequence ``i`` attends to positions ``0 .. seq_len_i -
            q_len_i + j``. Without a cache each sequence attends within its own new tokens.

        Raises:
            ValueError: missing ``q_pe`` / ``k_pe`` or wrong shapes, metadata covering more rows
                than the batch (from host lists), a short ``slot_mapping``, a cache without
                block tables or of the wrong shape.
        """
        if q_pe is None or value is None:
            raise ValueError("MLA: forward needs q_pe and k_pe")
        meta = attn_metadata
        t = query.shape[0]
        nh, r, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        ql = query.reshape(t, nh, r)
        qp = q_pe.reshape(t, nh, rope)
        c_kv = key.reshape(t, r)
        k_pe = value.reshape(t, rope)
        if meta is None:
            if t == 0:
                return ql.new_zeros(0, nh, r)
            return self._sdpa_causal(ql, qp, c_kv, k_pe)
        b = meta.num_seqs
        check_metadata_rows(meta, t)
        if kv_cache is None:  # each sequence sees only its own new tokens
            qsl = meta.query_start_loc[:b + 1].long()
            q_len_t = qsl[1:] - qsl[:-1]
            keys = torch.cat([c_kv, k_pe], dim=-1)
            return self._paged_batched(ql, qp, keys, None, qsl, q_len_t, q_len_t, meta.max_query_len,
                                       meta.max_query_len)
        cache = self._check_cache(kv_cache)
        check_cache_metadata(meta, t)
        self.do_kv_cache_update(layer, c_kv, k_pe, cache, meta.slot_mapping[:t])
        if (cache.dtype == ql.dtype or is_fp8(cache.dtype)) and qp.dtype == ql.dtype \
                and use_attention_kernel(ql, meta):
            if ql.stride(2) != 1:
                ql = ql.contiguous()
            if qp.stride(2) != 1:
                qp = qp.contiguous()
            return mla_attention(ql, qp, cache, meta.query_start_loc[:b + 1], meta.seq_lens[:b],
                                 meta.block_tables[:b], self.scale, meta.max_query_len, meta.max_seq_len,
                                 k_scale=layer.k_scale)
        src = cache.view(-1, self.entry)
        bs = cache.shape[1]
        key_slots = cache_key_slots(meta, bs, src.shape[0], ql.device)  # [B, max_s]; masked below
        qsl = meta.query_start_loc[:b + 1].long()  # (here, not above: 2 launches the kernel path never reads)
        q_len_t = qsl[1:] - qsl[:-1]
        return self._paged_batched(ql, qp, src, key_slots, qsl, q_len_t, meta.seq_lens[:b].long(),
                                   meta.max_query_len, meta.max_seq_len, layer.k_scale)

    def _sdpa_causal(self, ql: torch.Tensor, qp: torch.Tensor, c_kv: torch.Tensor,
                     k_pe: torch.Tensor) -> torch.Tensor:
        # One causal sequence over all rows: q [1, nh, T, r + rope], k [1, 1, T, r + rope], v = k[..., :r].
        q = torch.cat([ql, qp.to(ql.dtype)], dim=-1).transpose(0, 1)[None]
        k = torch.cat([c_kv, k_pe], dim=-1).to(ql.dtype)[None, None]
        o = sdpa(q, k, k[..., :self.kv_lora_rank], is_causal=True, scale=self.scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)

    def _paged_batched(self, ql: torch.Tensor, qp: torch.Tensor, k_src: torch.Tensor,
                       key_slots: Optional[torch.Tensor], qsl: torch.Tensor, q_len_t: torch.Tensor,
                       key_len_t: torch.Tensor, max_q: int, max_s: int, k_scale: float = 1.0) -> torch.Tensor:
        """All sequences in one SDPA call, padded to ``[B + 1, max_q]`` queries and ``[B + 1, max_s]``
        latent keys (the padded layout of paged GQA's torch path; one key head shared by all query
        heads, values = the keys' first ``kv_lora_rank`` channels; an fp8 cache's rows dequantised
        as the kernel reads them).

        Keys come from ``k_src[key_slots]`` (cache rows ``[*, r + rope]``) or, without a cache, from
        the sequence's own rows (``k_src`` = ``[T, r + rope]``). Real rows are placed by
        ``searchsorted`` over ``query_start_loc``; padding rows go to a dummy sequence ``B``
        whose output is replaced by zeros; padded query slots always see key 0 (no NaN).
        """
        dev = ql.device
        t = ql.shape[0]
        b = q_len_t.shape[0]
        nh, r, e = self.num_heads, self.kv_lora_rank, self.entry
        tok_seq, tok_off, real, key_ok, mask = padded_batch(qsl, q_len_t, key_len_t, t, max_q, max_s, dev)
        qpad = ql.new_zeros(b + 1, max_q, nh, e)
        qpad[tok_seq, tok_off] = torch.cat([ql, qp.to(ql.dtype)], dim=-1)
        if key_slots is None:
            kpad = ql.new_zeros(b + 1, max_s, e)
            kpad[tok_seq, tok_off] = k_src.to(ql.dtype)
        else:
            key_slots = torch.cat([key_slots, key_slots.new_zeros(1, key_slots.shape[1])])
            # [B + 1, max_s, r + rope]; an fp8 cache read as (x * k_scale) in q's dtype (the kernel applies
            # k_scale in fp32 to unscaled tiles: the same values up to this rounding to q's dtype)
            kpad = dequantize_cache(k_src[key_slots], ql.dtype, k_scale).to(ql.dtype)
        if key_slots is not None:  # never let stale slots (past seq_len, block -1) reach p @ v
            kpad = torch.where(key_ok[:, :, None], kpad, torch.zeros_like(kpad))
        k4 = kpad[:, None]  # [B + 1, 1, max_s, e]
        o = sdpa(qpad.transpose(1, 2), k4, k4[..., :r], attn_mask=mask[:, None],
                                           scale=self.scale, enable_gqa=True)  # [B + 1, nh, max_q, r]
        out = o.transpose(1, 2)[tok_seq, tok_off]
        return torch.where(real[:, None, None], out, torch.zeros_like(out))


__all__ = ["MLABackend", "MLAImpl"]
