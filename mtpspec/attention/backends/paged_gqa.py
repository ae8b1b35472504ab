"""Paged grouped-query attention: the first backend (today's GLM-4.5 attention).

Cache layout (:meth:`PagedGQABackend.get_kv_cache_shape`): one tensor
``[2, num_blocks, block_size, num_kv_heads, head_size]`` per layer, index 0 keys, 1 values, of the
engine's cache dtype (:class:`~mtpspec.attention.kv_cache_interface.FullAttentionSpec`): the model
dtype, or E4M3 (``--kv-cache-dtype fp8``) written as ``x / k_scale`` / ``x / v_scale`` (the
layer's floats) and dequantised tile by tile inside the kernel, or gathered and dequantised by
the SDPA path (:mod:`mtpspec.ops.kv_quant`).

Attention: Vaswani et al. 2017, "Attention Is All You Need", eq. 1, with grouped kv heads
(Ainslie et al. 2023, "GQA"): query head ``h`` uses kv head ``h // (num_heads / num_kv_heads)``.
Two paths behind one contract, both without host syncs or data-dependent shapes (so a model
forward can be captured as a CUDA graph): the Triton paged-attention kernel
(:mod:`mtpspec.ops.paged_attention`: decode, verification and draft steps on GPU, and any batch
whose metadata has no host lists), and a torch path with every sequence of the batch in one
padded SDPA call (keys gathered from the paged cache through the block tables; prefill and CPU).
The host lists of :class:`~mtpspec.layers.attention.AttentionMetadata` are optional hints; no
path requires them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, Type

import torch

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayerBase
from mtpspec.attention.backends.paged_common import (cache_key_slots, check_cache_metadata, check_metadata_rows,
                                                     padded_batch, sdpa)
from mtpspec.ops.kv_quant import dequantize_cache, is_fp8
from mtpspec.ops.paged_attention import paged_attention, write_kv_cache
from mtpspec.ops.triton_utils import FLOAT_DTYPES, use_triton

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata

#: Longest ``max_query_len`` (host int of the metadata) sent to the Triton kernel when host lists
#: are present; longer (prefill / mixed) batches take the SDPA path. Without host lists (the
#: CUDA-graph metadata) the kernel is always used where Triton runs.
KERNEL_MAX_QUERY_LEN = 16

#: A batch whose padded SDPA layout (every sequence padded to ``max_query_len`` rows) would hold
#: more than this many times its real query rows takes the kernel (varlen, no padding) whatever
#: its query lengths: chunked prefill's mixed steps (one long chunk beside many decode rows) would
#: otherwise pad every decode to the chunk's length (at 60 decodes beside a 2,048-token chunk, 30x
#: the rows: out of memory on an H200 with a 13.7 B model, issue 17).
MAX_PADDING_FACTOR = 2


def use_attention_kernel(q: torch.Tensor, meta: "AttentionMetadata", prefill_on_gpu: bool = False) -> bool:
    """Whether attention over ``meta`` runs the Triton paged kernel: Triton runs on ``q``
    (CUDA, or ``TRITON_INTERPRET=1``), ``q`` is fp16/bf16/fp32, and either
    ``meta.max_query_len <= KERNEL_MAX_QUERY_LEN`` (decode, verify, draft steps), or the metadata
    has no host lists, or padding the batch would multiply its query rows by more than
    :data:`MAX_PADDING_FACTOR` (mixed prefill + decode steps), or ``prefill_on_gpu`` and ``q`` is
    a CUDA tensor (the backend's kernel serves prefills too). Depends only on static things (and
    host ints), so a captured graph always takes one path."""
    if not use_triton(q) or q.dtype not in FLOAT_DTYPES:
        return False
    if (prefill_on_gpu and q.is_cuda) or meta.max_query_len <= KERNEL_MAX_QUERY_LEN or not meta.query_lens:
        return True
    return len(meta.query_lens) * meta.max_query_len > MAX_PADDING_FACTOR * sum(meta.query_lens)


class PagedGQABackend(AttentionBackend):
    """Keys and values per kv head in ``[2, num_blocks, block_size, num_kv_heads, head_size]``."""

    @staticmethod
    def get_name() -> str:
        return "PAGED_GQA"

    @staticmethod
    def get_impl_cls() -> Type["PagedGQAImpl"]:
        return PagedGQAImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    block_dim = 1  # K and V planes first


class PagedGQAImpl(AttentionImpl):
    """Causal GQA of ``num_heads`` query heads over ``num_kv_heads`` kv heads of ``head_size``.

    Raises:
        ValueError: ``num_heads`` not a positive multiple of ``num_kv_heads``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads

    def _check_cache(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() != 5 or c.shape[0] != 2 or c.shape[3] != self.num_kv_heads or c.shape[4] != self.head_dim:
            raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {tuple(c.shape)}")
        return c

    def do_kv_cache_update(self, layer: AttentionLayerBase, key: torch.Tensor, value: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key`` / ``value`` ``[n, num_kv_heads, head_size]`` into ``kv_cache[0]`` /
        ``kv_cache[1]`` at ``slot_mapping [n]`` (-1 skipped) with
        :func:`~mtpspec.ops.paged_attention.write_kv_cache` (Triton or its torch reference; an
        fp8 cache quantised with the layer's ``k_scale`` / ``v_scale``)."""
        write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, layer.k_scale, layer.v_scale)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor]) -> torch.Tensor:
        # q: [L, nh, hd]; k, v: [S, nkv, hd] -> [L, nh * hd]
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = sdpa(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            is_causal=mask is None, scale=self.scale)
        return out.transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_dim)

    def _sdpa_batched(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
        # q: [b * L, nh, hd]; k, v: [b * L, nkv, hd]; b causal sequences of equal length L.
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        length = q.shape[0] // b
        qb, kb, vb = (x.view(b, length, x.shape[1], self.head_dim).transpose(1, 2) for x in (q, k, v))
        out = sdpa(qb, kb, vb, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(q.shape[0], self.num_heads * self.head_dim)

    def forward(self, layer: AttentionLayerBase, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: Optional[torch.Tensor], attn_metadata: Optional["AttentionMetadata"]) -> torch.Tensor:
        """Attend.

        Args:
            layer: the calling layer (its fp8 ``k_scale`` / ``v_scale``).
            query: ``[num_tokens, num_heads * head_dim]`` (rotary already applied).
            key, value: ``[num_tokens, num_kv_heads * head_dim]``.
            kv_cache: ``None`` or ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            attn_metadata: the forward context's metadata or ``None``.

        Returns:
            ``[num_tokens, num_heads * head_dim]`` in q's dtype. Padding rows (past
            ``query_start_loc[-1]``) are zeros.

        With a cache, the K/V of rows whose slot is >= 0 are written first, then query ``j`` of
        sequence ``i`` attends to cache positions ``0 .. seq_len_i - q_len_i + j``. Without a
        cache, each sequence attends causally within its own new tokens.

        Paths (every one sync-free given the metadata's host ints, so CUDA-graph capturable):
        with a cache, the KV write is :meth:`do_kv_cache_update` and attention is the Triton
        kernel :func:`~mtpspec.ops.paged_attention.paged_attention` on CUDA tensors (any query
        length) or where :func:`use_attention_kernel` says so (``TRITON_INTERPRET=1``: short
        queries or no host lists), when the cache has q's dtype or is fp8; else one padded SDPA
        call over all sequences (an fp8 cache's gathered context dequantised first).

        Raises:
            ValueError: the metadata covers more tokens than the batch has (known from host
                lists), ``slot_mapping`` is shorter than the batch, a cache without block tables,
                or a cache of the wrong shape.
        """
        q, k, v, meta = query, key, value, attn_metadata
        t = q.shape[0]
        qh = q.view(t, self.num_heads, self.head_dim)
        kh = k.view(t, self.num_kv_heads, self.head_dim)
        vh = v.view(t, self.num_kv_heads, self.head_dim)
        if meta is None:
            return self._sdpa(qh, kh, vh, None) if t else q.new_zeros(0, self.num_heads * self.head_dim)
        b = meta.num_seqs
        q_lens = meta.query_lens
        check_metadata_rows(meta, t)
        if kv_cache is None and q_lens and sum(q_lens) == t and len(set(q_lens)) == 1:
            # Equal-length sequences and no padding rows (training batches): one batched call.
            return self._sdpa_batched(qh, kh, vh, len(q_lens))
        if kv_cache is None:  # each sequence sees only its own new tokens
            qsl = meta.query_start_loc[:b + 1].long()
            q_len_t = qsl[1:] - qsl[:-1]
            return self._paged_batched(qh, kh, vh, None, qsl, q_len_t, q_len_t, meta.max_query_len,
                                       meta.max_query_len)
        cache = self._check_cache(kv_cache)
        check_cache_metadata(meta, t)
        self.do_kv_cache_update(layer, kh, vh, cache, meta.slot_mapping[:t])
        # On a GPU the kernel serves prefills too: one launch per layer instead of the padded SDPA
        # path's gathers, masks and scatters (a prefill step's host time, issue 17's cache hits).
        if (cache.dtype == q.dtype or is_fp8(cache.dtype)) and use_attention_kernel(qh, meta, prefill_on_gpu=True):
            out = paged_attention(qh, cache[0], cache[1], meta.query_start_loc[:b + 1], meta.seq_lens[:b],
                                  meta.block_tables[:b], self.scale, meta.max_query_len, meta.max_seq_len,
                                  k_scale=layer.k_scale, v_scale=layer.v_scale)
            return out.view(t, self.num_heads * self.head_dim)
        k_src = cache[0].view(-1, self.num_kv_heads, self.head_dim)
        v_src = cache[1].view(-1, self.num_kv_heads, self.head_dim)
        bs = cache.shape[2]
        key_slots = cache_key_slots(meta, bs, k_src.shape[0], q.device)  # [B, max_s]; masked below
        qsl = meta.query_start_loc[:b + 1].long()  # (here, not above: 2 launches the kernel path never reads)
        q_len_t = qsl[1:] - qsl[:-1]
        return self._paged_batched(qh, k_src, v_src, key_slots, qsl, q_len_t, meta.seq_lens[:b].long(),
                                   meta.max_query_len, meta.max_seq_len, layer.k_scale, layer.v_scale)

    def _paged_batched(self, qh: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor,
                       key_slots: Optional[torch.Tensor], qsl: torch.Tensor, q_len_t: torch.Tensor,
                       key_len_t: torch.Tensor, max_q: int, max_s: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
        """All sequences in one SDPA call, padded to ``[B + 1, max_q]`` queries and ``[B + 1, max_s]`` keys.

        Query ``j`` of sequence ``i`` sits at absolute position ``key_len_i - q_len_i + j`` and may
        attend key positions ``<= that`` and ``< key_len_i``. Keys come from ``k_src[key_slots]``
        (cache) or, without a cache, from the sequence's own rows. Every row of the batch is
        placed: real rows by ``searchsorted`` over ``query_start_loc``, padding rows (past
        ``query_start_loc[-1]``) into an extra dummy sequence ``B`` whose output is replaced by
        zeros. Padded query slots always see key 0 (no all-masked row, hence no NaN). Device
        tensors and host ints only: no host sync, no data-dependent shape.
        """
        dev = qh.device
        t = qh.shape[0]
        b = q_len_t.shape[0]
        tok_seq, tok_off, real, _, mask = padded_batch(qsl, q_len_t, key_len_t, t, max_q, max_s, dev)
        qp = qh.new_zeros(b + 1, max_q, self.num_heads, self.head_dim)
        qp[tok_seq, tok_off] = qh
        if key_slots is None:
            kp = qh.new_zeros(b + 1, max_s, self.num_kv_heads, self.head_dim)
            vp = torch.zeros_like(kp)
            kp[tok_seq, tok_off] = k_src.to(qh.dtype)
            vp[tok_seq, tok_off] = v_src.to(qh.dtype)
        else:
            key_slots = torch.cat([key_slots, key_slots.new_zeros(1, key_slots.shape[1])])
            # [B + 1, max_s, nkv, hd]; an fp8 cache read as the kernel reads it, (x * scale) in q's dtype
            kp = dequantize_cache(k_src[key_slots], qh.dtype, k_scale).to(qh.dtype)
            vp = dequantize_cache(v_src[key_slots], qh.dtype, v_scale).to(qh.dtype)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            kp = kp.repeat_interleave(rep, dim=2)
            vp = vp.repeat_interleave(rep, dim=2)
        o = sdpa(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                           attn_mask=mask[:, None], scale=self.scale)  # [B + 1, nh, max_q, hd]
        out = o.transpose(1, 2)[tok_seq, tok_off].reshape(t, self.num_heads * self.head_dim)
        return torch.where(real[:, None], out, torch.zeros_like(out))


__all__ = ["KERNEL_MAX_QUERY_LEN", "MAX_PADDING_FACTOR", "PagedGQABackend", "PagedGQAImpl", "use_attention_kernel"]
