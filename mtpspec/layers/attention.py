"""Paged causal attention over a flattened varlen batch, and the forward context that drives it.

One :class:`AttentionMetadata` layout covers prefill, decode and (1 + k)-token verification:
sequence ``i`` contributes ``q_len_i`` new tokens (rows ``query_start_loc[i]:query_start_loc[i+1]``
of the flattened batch) and has ``seq_len_i`` tokens in total after them, so its new tokens sit
at absolute positions ``seq_len_i - q_len_i .. seq_len_i - 1``. Rows past ``query_start_loc[-1]``
(CUDA-graph padding) are never written to the cache and never read by real rows.

The engine sets the metadata around a model forward with :func:`set_forward_context`; every
:class:`Attention` layer reads it through :func:`get_forward_context`. KV caches are plain
tensors ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` assigned to ``layer.kv_cache``
(:func:`collect_attention_layers` lists a model's layers in forward order,
:func:`allocate_kv_caches` is a simple allocator for tests and drivers).

Attention itself: Vaswani et al. 2017, "Attention Is All You Need", eq. 1, with grouped kv heads
(Ainslie et al. 2023, "GQA"): query head ``h`` uses kv head ``h // (num_heads / num_kv_heads)``.
Two paths behind one contract, both without host syncs or data-dependent shapes (so a model
forward can be captured as a CUDA graph): the Triton paged-attention kernel
(:mod:`mtpspec.ops.paged_attention`: decode, verification and draft steps on GPU, and any batch
whose metadata has no host lists), and a torch path with every sequence of the batch in one
padded SDPA call (keys gathered from the paged cache through the block tables; prefill and CPU).
The host lists of :class:`AttentionMetadata` are optional hints; no path requires them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.ops.paged_attention import paged_attention, write_kv_cache, write_kv_cache_ref
from mtpspec.ops.triton_utils import FLOAT_DTYPES, use_triton

#: Longest ``max_query_len`` (host int of the metadata) sent to the Triton kernel when host lists
#: are present; longer (prefill / mixed) batches take the SDPA path. Without host lists (the
#: CUDA-graph metadata) the kernel is always used where Triton runs.
KERNEL_MAX_QUERY_LEN = 16


@dataclass
class AttentionMetadata:
    """Where each new token of a flattened varlen batch belongs.

    Attributes (tensors on the model's device):
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths;
            ``query_start_loc[-1]`` is the number of real tokens.
        seq_lens: ``[num_seqs]`` int32, tokens of each sequence after this step's new tokens.
        slot_mapping: ``[num_tokens]`` int64, KV slot ``block_id * block_size + offset`` of each
            row; ``-1`` marks a padding row (its K/V are not written).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 block ids (entries past a
            sequence's blocks: any value, e.g. -1), or ``None`` when no KV cache is used.

    Host-side values (no device sync needed to read them):
        num_seqs: sequences (rows of ``seq_lens`` / ``block_tables`` used).
        max_query_len: an upper bound of every ``q_len`` (exact, or static under CUDA graphs).
        max_seq_len: an upper bound of every ``seq_len`` (idem).
        query_lens, seq_lens_list: optional python lists of ints, one per sequence (empty when
            unknown, e.g. in captured CUDA-graph metadata); only used for input checks and the
            no-cache equal-length fast path, never required.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: Optional[torch.Tensor]
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_lens: List[int] = field(default_factory=list)
    seq_lens_list: List[int] = field(default_factory=list)

    @property
    def num_actual_tokens(self) -> int:
        """Real (non-padding) rows of the flattened batch."""
        return int(sum(self.query_lens))


@dataclass
class ForwardContext:
    """What the layers of one model forward read. ``attn_metadata=None``: no varlen layout; the
    whole flattened batch is one sequence starting at position 0, with no KV cache."""

    attn_metadata: Optional[AttentionMetadata] = None


_FORWARD_CONTEXT: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Optional[AttentionMetadata]) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` visible to every :class:`Attention` layer inside the ``with`` block
    (nested blocks restore the outer context on exit)."""
    global _FORWARD_CONTEXT
    prev = _FORWARD_CONTEXT
    _FORWARD_CONTEXT = ForwardContext(attn_metadata)
    try:
        yield _FORWARD_CONTEXT
    finally:
        _FORWARD_CONTEXT = prev


def get_forward_context() -> ForwardContext:
    """The current :class:`ForwardContext`; an empty one (``attn_metadata=None``) outside any
    :func:`set_forward_context` block."""
    return _FORWARD_CONTEXT if _FORWARD_CONTEXT is not None else ForwardContext(None)


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                             block_tables: Optional[Union[Sequence[Sequence[int]], torch.Tensor]] = None,
                             block_size: int = 16, device: Union[str, torch.device] = "cpu",
                             num_tokens: Optional[int] = None) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from per-sequence lengths and block tables.

    Args:
        query_lens: new tokens per sequence (each >= 1).
        seq_lens: total tokens per sequence after the new ones (``seq_len >= query_len``).
        block_tables: per sequence, its KV block ids in order (lists may differ in length; padded
            with -1), or ``None`` for no KV cache (every slot is -1).
        block_size: tokens per KV block.
        device: where the tensors go.
        num_tokens: rows of the flattened batch; rows past ``sum(query_lens)`` are padding
            (slot -1). Default ``sum(query_lens)``.

    Raises:
        ValueError: mismatched lengths, ``seq_len < query_len``, a sequence with more tokens than
            its blocks hold, or ``num_tokens < sum(query_lens)``.
    """
    q = [int(x) for x in query_lens]
    s = [int(x) for x in seq_lens]
    if len(q) != len(s) or not q:
        raise ValueError(f"need one query_len and one seq_len per sequence, got {len(q)} and {len(s)}")
    for i, (a, b) in enumerate(zip(q, s)):
        if a < 1 or b < a:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={a}, seq_len={b}")
    total = sum(q)
    num_tokens = total if num_tokens is None else int(num_tokens)
    if num_tokens < total:
        raise ValueError(f"num_tokens={num_tokens} is smaller than the {total} real tokens")
    slots = [-1] * num_tokens
    bt_tensor = None
    if block_tables is not None:
        rows = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else [list(r) for r in block_tables]
        if len(rows) != len(q):
            raise ValueError(f"need one block table per sequence: {len(rows)} tables for {len(q)} sequences")
        width = max(1, max(len(r) for r in rows))
        row = 0
        for i, (a, b) in enumerate(zip(q, s)):
            blocks = [x for x in rows[i]]
            if (b + block_size - 1) // block_size > len(blocks):
                raise ValueError(f"sequence {i}: {b} tokens need {(b + block_size - 1) // block_size} blocks "
                                 f"of {block_size}, its table has {len(blocks)}")
            for pos in range(b - a, b):
                slots[row] = int(blocks[pos // block_size]) * block_size + pos % block_size
                row += 1
        bt_tensor = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
    qsl = [0]
    for a in q:
        qsl.append(qsl[-1] + a)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(s, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt_tensor, num_seqs=len(q), max_query_len=max(q), max_seq_len=max(s),
        query_lens=q, seq_lens_list=s)


class Attention(nn.Module):
    """Causal attention of this rank's heads, with an optional paged KV cache.

    Args:
        num_heads: query heads on this rank.
        head_dim: channels per head.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        num_kv_heads: kv heads on this rank (``num_heads`` must be a multiple).

    Attributes:
        kv_cache: ``None`` or a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
            (index 0 keys, 1 values), assigned by the engine.

    Raises:
        ValueError: num_heads not a multiple of num_kv_heads.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache: Optional[torch.Tensor] = None

    def _check_cache(self) -> torch.Tensor:
        c = self.kv_cache
        assert c is not None
        if c.dim() != 5 or c.shape[0] != 2 or c.shape[3] != self.num_kv_heads or c.shape[4] != self.head_dim:
            raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {tuple(c.shape)}")
        return c

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor]) -> torch.Tensor:
        # q: [L, nh, hd]; k, v: [S, nkv, hd] -> [L, nh * hd]
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
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
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(q.shape[0], self.num_heads * self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend.

        Args:
            q: ``[num_tokens, num_heads * head_dim]`` (rotary already applied).
            k, v: ``[num_tokens, num_kv_heads * head_dim]``.

        Returns:
            ``[num_tokens, num_heads * head_dim]`` in q's dtype. Padding rows (past
            ``query_start_loc[-1]``) are zeros.

        With a cache, the K/V of rows whose slot is >= 0 are written first, then query ``j`` of
        sequence ``i`` attends to cache positions ``0 .. seq_len_i - q_len_i + j``. Without a
        cache, each sequence attends causally within its own new tokens.

        Paths (every one sync-free given the metadata's host ints, so CUDA-graph capturable):
        with a cache, the KV write is :func:`~mtpspec.ops.paged_attention.write_kv_cache` and
        attention is the Triton kernel :func:`~mtpspec.ops.paged_attention.paged_attention`
        when :func:`use_attention_kernel` says so (CUDA or ``TRITON_INTERPRET=1``, and short
        queries or no host lists), else one padded SDPA call over all sequences.

        Raises:
            ValueError: the metadata covers more tokens than the batch has (known from host
                lists), ``slot_mapping`` is shorter than the batch, or a cache without block tables.
        """
        t = q.shape[0]
        qh = q.view(t, self.num_heads, self.head_dim)
        kh = k.view(t, self.num_kv_heads, self.head_dim)
        vh = v.view(t, self.num_kv_heads, self.head_dim)
        meta = get_forward_context().attn_metadata
        if meta is None:
            return self._sdpa(qh, kh, vh, None) if t else q.new_zeros(0, self.num_heads * self.head_dim)
        b = meta.num_seqs
        q_lens = meta.query_lens
        if q_lens and sum(q_lens) > t:
            raise ValueError(f"attention metadata covers {sum(q_lens)} tokens but the batch has {t} rows")
        if self.kv_cache is None and q_lens and sum(q_lens) == t and len(set(q_lens)) == 1:
            # Equal-length sequences and no padding rows (training batches): one batched call.
            return self._sdpa_batched(qh, kh, vh, len(q_lens))
        qsl = meta.query_start_loc[:b + 1].long()
        q_len_t = qsl[1:] - qsl[:-1]
        if self.kv_cache is None:  # each sequence sees only its own new tokens
            return self._paged_batched(qh, kh, vh, None, qsl, q_len_t, q_len_t, meta.max_query_len,
                                       meta.max_query_len)
        cache = self._check_cache()
        if meta.block_tables is None:
            raise ValueError("a KV cache is attached but the attention metadata has no block_tables")
        if meta.slot_mapping.shape[0] < t:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {t} rows; give every row "
                             "a slot (-1 for padding rows)")
        write_kv_cache(kh, vh, cache[0], cache[1], meta.slot_mapping[:t])
        if cache.dtype == q.dtype and use_attention_kernel(qh, meta):
            out = paged_attention(qh, cache[0], cache[1], meta.query_start_loc[:b + 1], meta.seq_lens[:b],
                                  meta.block_tables[:b], self.scale, meta.max_query_len, meta.max_seq_len)
            return out.view(t, self.num_heads * self.head_dim)
        k_src = cache[0].view(-1, self.num_kv_heads, self.head_dim)
        v_src = cache[1].view(-1, self.num_kv_heads, self.head_dim)
        bs = cache.shape[2]
        pos = torch.arange(meta.max_seq_len, device=q.device)
        blocks = meta.block_tables.long()[:b].index_select(1, (pos // bs).clamp(max=meta.block_tables.shape[1] - 1))
        key_slots = (blocks * bs + pos % bs).clamp(0, k_src.shape[0] - 1)  # [B, max_s]; masked below
        return self._paged_batched(qh, k_src, v_src, key_slots, qsl, q_len_t, meta.seq_lens[:b].long(),
                                   meta.max_query_len, meta.max_seq_len)

    def _paged_batched(self, qh: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor,
                       key_slots: Optional[torch.Tensor], qsl: torch.Tensor, q_len_t: torch.Tensor,
                       key_len_t: torch.Tensor, max_q: int, max_s: int) -> torch.Tensor:
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
        rows = torch.arange(t, device=dev)
        tok_seq = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)  # b for padding rows
        real = tok_seq < b
        tok_off = (rows - qsl.index_select(0, tok_seq)).clamp(0, max(max_q - 1, 0))
        qp = qh.new_zeros(b + 1, max_q, self.num_heads, self.head_dim)
        qp[tok_seq, tok_off] = qh
        q_len_x = torch.cat([q_len_t, q_len_t.new_zeros(1)])
        key_len_x = torch.cat([key_len_t, key_len_t.new_zeros(1)])
        if key_slots is None:
            kp = qh.new_zeros(b + 1, max_s, self.num_kv_heads, self.head_dim)
            vp = torch.zeros_like(kp)
            kp[tok_seq, tok_off] = k_src.to(qh.dtype)
            vp[tok_seq, tok_off] = v_src.to(qh.dtype)
        else:
            key_slots = torch.cat([key_slots, key_slots.new_zeros(1, key_slots.shape[1])])
            kp = k_src[key_slots].to(qh.dtype)  # [B + 1, max_s, nkv, hd]
            vp = v_src[key_slots].to(qh.dtype)
        key_pos = torch.arange(max_s, device=dev)
        q_abs = (key_len_x - q_len_x)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [B + 1, max_q]
        mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & (key_pos[None, :] < key_len_x[:, None])[:, None, :]
        mask[:, :, 0] = True  # padded query slots: keep one key (their output is dropped)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            kp = kp.repeat_interleave(rep, dim=2)
            vp = vp.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                           attn_mask=mask[:, None], scale=self.scale)  # [B + 1, nh, max_q, hd]
        out = o.transpose(1, 2)[tok_seq, tok_off].reshape(t, self.num_heads * self.head_dim)
        return torch.where(real[:, None], out, torch.zeros_like(out))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def _write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
    """Torch, sync-free: write rows ``k``/``v`` ``[n, nkv, hd]`` to flat caches ``[num_slots, nkv, hd]``
    at ``slots [n]``; rows with slot -1 are skipped (:func:`~mtpspec.ops.paged_attention.write_kv_cache_ref`)."""
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)


def use_attention_kernel(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether attention over ``meta`` runs the Triton paged kernel: Triton runs on ``q``
    (CUDA, or ``TRITON_INTERPRET=1``), ``q`` is fp16/bf16/fp32, and either
    ``meta.max_query_len <= KERNEL_MAX_QUERY_LEN`` (decode, verify, draft steps) or the metadata
    has no host lists. Depends only on static things, so a captured graph always takes one path."""
    if not use_triton(q) or q.dtype not in FLOAT_DTYPES:
        return False
    return meta.max_query_len <= KERNEL_MAX_QUERY_LEN or not meta.query_lens


def collect_attention_layers(model: nn.Module) -> List[Attention]:
    """Every :class:`Attention` inside ``model``, in registration (= forward) order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: Union[str, torch.device] = "cpu") -> List[torch.Tensor]:
    """Give every attention layer of ``model`` its own zeroed cache
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; returns them in layer order."""
    caches = []
    for layer in collect_attention_layers(model):
        layer.kv_cache = torch.zeros(2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim,
                                     dtype=dtype, device=device)
        caches.append(layer.kv_cache)
    return caches
