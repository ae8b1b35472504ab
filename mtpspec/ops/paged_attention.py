"""Paged attention over a flattened varlen batch, and the paged KV-cache write; both CUDA-graph safe.

Layout (the contract of :mod:`mtpspec.layers.attention`): sequence ``i`` owns query rows
``query_start_loc[i] .. query_start_loc[i + 1] - 1`` of the flattened batch and has ``seq_lens[i]``
tokens after them, so its query ``j`` sits at absolute position ``seq_lens[i] - q_len_i + j`` and
attends cache positions ``0 ..`` that position. Position ``p`` of sequence ``i`` lives in cache
block ``block_tables[i, p // block_size]``, offset ``p % block_size``. Grouped-query attention
(Ainslie et al. 2023): query head ``h`` reads kv head ``h // (num_heads / num_kv_heads)``.

Algorithm: online softmax with a split over the key axis, i.e. FlashAttention-2 (Dao 2023,
"FlashAttention-2", Algorithm 1: running row max ``m``, running sum ``l``, rescaled accumulator,
one division at the end) plus flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for
long-context inference": keys cut into ``S`` splits processed by separate programs, whose partial
``(m, l, acc)`` are combined by a second kernel with weights ``2^(m_s - max_s m_s)``). Scores are
kept in base 2 (``exp2``, scale multiplied by ``log2 e``), all softmax statistics in fp32.

Kernel layout: one program per ``(sequence, block of BLOCK_Q query rows, kv head, split)``. Its
``BLOCK_M = BLOCK_Q * REP_P`` matrix rows are the block's query rows times the kv head's
``REP = num_heads / num_kv_heads`` query heads (``REP_P``: next power of two), so each K/V tile
read from the cache serves every query head of the group and the ``1 + k`` rows of a
verification at once (``tl.dot`` on ``[BLOCK_M, D] x [D, BLOCK_N]``). Each split covers
``ceil(ceil(n_keys / S) / BLOCK_N)`` tiles of the sequence's own key range, so every split has
work whatever the sequence's length.

CUDA-graph safety: the launch grid, the scratch shapes and every branch in Python depend only on
tensor shapes and the host ints ``max_query_len`` (upper bound of any ``q_len``) and
``max_seq_len`` (upper bound of any ``seq_len``; only used to choose ``S``). Lengths, slots and
block ids are read on the device. Programs of query blocks past a sequence's ``q_len`` exit at
once, so zero-length (padding) sequences cost one scalar load; rows past
``query_start_loc[num_seqs]`` (padding rows) come out as zeros. :func:`write_kv_cache` skips
rows with slot ``-1`` on the device.

FP8 caches (``torch.float8_e4m3fn``, :mod:`mtpspec.ops.kv_quant`): the write quantises each row
(``x / scale``, saturating, nearest even) and the attention kernel dequantises each K / V tile as
it loads it (``x * scale`` in q's dtype); the cache is never dequantised as a whole.

Dispatch (docs/structures.md): Triton on CUDA tensors and on CPU tensors under
``TRITON_INTERPRET=1``; the torch references (``*_ref``, also sync-free) otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from mtpspec.ops.argmax import num_sms
from mtpspec.ops.kv_quant import check_cache_dtype, dequantize_cache, is_fp8, quantize_to_cache, raw
from mtpspec.ops.paged_common import (causal_probs, choose_num_splits, launchable_block_tables, padded_queries,
                                      padded_slots, scatter_padded_rows, split_outputs)
from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, cdiv, check_paged_metadata, check_tensor_args,
                                      interpreting, next_power_of_2, tl, use_triton)

#: Keys per inner-loop tile (may span several cache blocks).
BLOCK_N = 64
#: Matrix rows (query rows x heads of a kv group) a program aims at: 16 is the smallest
#: ``tl.dot`` tile; longer queries (prefill) use ``PREFILL_BLOCK_M``.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
#: Programs per SM the key split aims at (flash-decoding), and its limits.
TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
#: 64 (one key tile): on the H200 at one sequence x 1,024 keys, 8 kv heads, a split of 64-128 keys
#: beat 256 (16-32 splits 9.9 us against 6 splits 11.6 us; plain decoding of 8 layers 1.788 ->
#: 1.765 ms a token); larger batches reach the program target first (BENCHMARKS.md, 2026-12-04).
MIN_KEYS_PER_SPLIT = 64
#: Warps per attention program.
NUM_WARPS = 4
#: Most values (heads x splits x head dim) one program of the split combine merges.
COMBINE_BLOCK_ELEMS = 4096

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------- checks

def _check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, max_query_len: int) -> None:
    check_tensor_args("paged_attention", "q", q,
                      (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("query_start_loc", query_start_loc),
                       ("seq_lens", seq_lens), ("block_tables", block_tables)))
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [num_tokens, num_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {list(k_cache.shape)} and {list(v_cache.shape)}")
    nh, hd = q.shape[1], q.shape[2]
    nkv = k_cache.shape[2]
    if k_cache.shape[3] != hd:
        raise ValueError(f"paged_attention: cache head_dim {k_cache.shape[3]} != q head_dim {hd}")
    if nkv < 1 or nh % nkv:
        raise ValueError(f"paged_attention: num_heads={nh} must be a positive multiple of num_kv_heads={nkv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"paged_attention: q must be float16/bfloat16/float32, got {q.dtype}")
    check_cache_dtype("paged_attention", q.dtype, k_cache, v_cache)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention: q and the caches need unit stride in head_dim")
    check_paged_metadata("paged_attention", query_start_loc, seq_lens, block_tables, max_query_len)


# ---------------------------------------------------------------- torch references

def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, max_query_len: int, max_seq_len: int, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`paged_attention` (same arguments and result; fp32 softmax, or
    float64 for float64 inputs; an fp8 cache read as ``(x * scale).to(q.dtype)``). Sync-free like
    the kernel: every sequence is padded to ``max_query_len`` queries and ``max_seq_len`` keys (``max_seq_len`` must bound every
    ``seq_len``); memory ``O(num_seqs * max_query_len * num_heads * max_seq_len)``.
    """
    t, nh, hd = q.shape
    b = seq_lens.shape[0]
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    rep = nh // nkv
    dev = q.device
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(t, nh, hd, dtype=q.dtype, device=dev)
    if t == 0 or b == 0 or max_query_len == 0 or max_seq_len == 0:
        return out
    q_lens, s_lens, j, rows, row_ok = padded_queries(query_start_loc, seq_lens, max_query_len, dev)
    qp = q.index_select(0, torch.where(row_ok, rows, 0).reshape(-1)).view(b, max_query_len, nh, hd)
    pos, key_ok, slots = padded_slots(block_tables, s_lens, max_seq_len, bs, k_cache.shape[0], dev)
    kp = k_cache.reshape(-1, nkv, hd).index_select(0, slots.reshape(-1)).view(b, max_seq_len, nkv, hd)
    vp = v_cache.reshape(-1, nkv, hd).index_select(0, slots.reshape(-1)).view(b, max_seq_len, nkv, hd)
    kp = dequantize_cache(kp, q.dtype, k_scale).to(acc_dtype).repeat_interleave(rep, dim=2)
    vp = dequantize_cache(vp, q.dtype, v_scale).to(acc_dtype).repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qp.to(acc_dtype), kp) * scale
    p = causal_probs(s, q_lens, s_lens, j, pos, key_ok, row_ok)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vp)
    return scatter_padded_rows(o, rows, row_ok, t, acc_dtype, q.dtype)


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch version of :func:`write_kv_cache`, sync-free (fp8 caches:
    :func:`~mtpspec.ops.kv_quant.quantize_to_cache`, bytes moved as uint8).

    A row with slot ``-1`` is redirected to the first valid row's slot with that row's values, so
    duplicate indices of one ``index_copy_`` carry identical data and the result does not depend
    on write order; with no valid row at all, slot 0 is rewritten with its own content.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    nkv, hd = k_cache.shape[-2], k_cache.shape[-1]
    slots = slot_mapping.long()
    valid = slots >= 0
    any_valid = valid.any().view(1)
    first = torch.argmax(valid.to(torch.int8)).view(1)
    fb_slot = torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first))
    idx = torch.where(valid, slots, fb_slot)
    for cache, new, sc in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        flat = raw(cache.view(-1, nkv, hd))
        new = raw(quantize_to_cache(new.reshape(n, nkv, hd), cache.dtype, sc))
        fb_val = torch.where(any_valid[:, None, None], new.index_select(0, first), flat[:1])
        flat.index_copy_(0, idx, torch.where(valid[:, None, None], new, fb_val))


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import dequant_kv, pdl_begin, quant_fp8, round_to_dtype

    def _attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                     qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, num_splits, k_scale, v_scale,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_ot, stride_oh, stride_bt, stride_pt, stride_ph,
                     REP: tl.constexpr, REP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CACHE_BLOCK: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                     PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # One program: sequence `seq`, query rows [qb * BLOCK_Q, (qb + 1) * BLOCK_Q) of it, kv head
        # `g`, key split `split`. qk_scale = softmax scale * log2(e) (scores in base 2). FP8: the
        # cache holds E4M3; each tile is dequantised to q's dtype (x * k_scale / v_scale) on load.
        seq = tl.program_id(0)
        qb = tl.program_id(1)
        g = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        q_start = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
        if qb * BLOCK_Q >= q_len:  # past this sequence's queries (zero-length padding sequences: all)
            return
        ctx = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
        offs_m = tl.arange(0, BLOCK_M)
        tok = qb * BLOCK_Q + offs_m // REP_P
        hrep = offs_m % REP_P
        head = g * REP + hrep
        row_ok = (tok < q_len) & (hrep < REP)
        q_pos = ctx + tok
        row = (q_start + tok).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        # Keys this block needs: 0 .. ctx + (last row of the block); this split's share of them.
        n_keys = ctx + tl.minimum(q_len, (qb + 1) * BLOCK_Q)
        chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        k_hi = tl.minimum(k_lo + chunk, n_keys)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(k_lo, k_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_hi
            blk = tl.load(bt_row + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
            in_blk = offs_n % CACHE_BLOCK
            k_off = blk * stride_kb + in_blk * stride_ks + g * stride_kh
            k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            if FP8:
                k = dequant_kv(k, k_scale, q_ptr.dtype.element_ty, BF16_BY_BITS)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_off = blk * stride_vb + in_blk * stride_vs + g * stride_vh
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if FP8:
                v = dequant_kv(v, v_scale, q_ptr.dtype.element_ty, BF16_BY_BITS)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLIT:
            base = row * stride_pt + head * stride_ph + split
            tl.store(part_ml_ptr + 2 * base, m_i, mask=row_ok)
            tl.store(part_ml_ptr + 2 * base + 1, l_i, mask=row_ok)
            tl.store(part_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            # BF16_BY_BITS: round to nearest even by integer ops (the interpreter truncates)
            o_low = round_to_dtype(o, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o_low, mask=row_ok[:, None] & d_ok[None, :])

    def _combine_kernel(out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, num_seqs, num_splits, num_heads,
                        stride_ot, stride_oh, stride_pt, stride_ph,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_H: tl.constexpr, BF16_BY_BITS: tl.constexpr, ALL_ROWS: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_begin(PDL)
        # One program per (row, block of BLOCK_H heads): merge the splits' (m, l, acc); padding
        # rows get zeros (ALL_ROWS: every row is real, query_start_loc is not read).
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < num_heads
        # The partials are loaded without waiting for query_start_loc (one memory round trip on the
        # path, not two); a padding row's (never written) are then replaced as if masked off.
        offs_s = tl.arange(0, BLOCK_S)
        ld = h_ok[:, None] & (offs_s < num_splits)[None, :]
        base = t.to(tl.int64) * stride_pt + h[:, None] * stride_ph + offs_s[None, :]  # [BLOCK_H, BLOCK_S]
        m = tl.load(part_ml_ptr + 2 * base, mask=ld, other=float("-inf"))
        l = tl.load(part_ml_ptr + 2 * base + 1, mask=ld, other=0.0)
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.load(part_acc_ptr + base[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=ld[:, :, None],
                      other=0.0)
        # (integer limits, not broadcast scalar booleans: Triton's interpreter rejects those in masks)
        if ALL_ROWS:
            ok = ld
        else:
            n_valid = num_splits * (t < tl.load(qsl_ptr + num_seqs)).to(tl.int32)
            ok = h_ok[:, None] & (offs_s < n_valid)[None, :]
        m = tl.where(ok, m, float("-inf"))
        l = tl.where(ok, l, 0.0)
        acc = tl.where(ok[:, :, None], acc, 0.0)
        m_max = tl.max(m, axis=1)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])
        denom = tl.sum(w * l, axis=1)
        o = tl.sum(acc * w[:, :, None], axis=1) / tl.where(denom > 0, denom, 1.0)[:, None]
        o_low = round_to_dtype(o, out_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :], o_low,
                 mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :])

    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale, v_scale, stride_kt, stride_vt,
                         stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                         ROW: tl.constexpr, BLOCK_R: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr, FP8: tl.constexpr, FP8_BY_BITS: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # One program per row: copy its [num_kv_heads * head_dim] K and V to its slot; slot < 0: skip.
        # FP8: quantise (x / scale, saturating, nearest even; FP8_BY_BITS under the interpreter).
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_R)
        # the row is loaded without waiting for its slot (one memory round trip before the store)
        kx = tl.load(k_ptr + t * stride_kt + offs, mask=offs < ROW)
        vx = tl.load(v_ptr + t * stride_vt + offs, mask=offs < ROW)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = offs < ROW * (slot >= 0).to(tl.int32)
        blk = slot // CACHE_BLOCK
        off = slot % CACHE_BLOCK
        if FP8:
            k_low = quant_fp8(kx.to(tl.float32), k_scale, FP8_BY_BITS)
            v_low = quant_fp8(vx.to(tl.float32), v_scale, FP8_BY_BITS)
        else:
            # BF16_BY_BITS: fp32 -> bf16 to nearest even by integer ops (the interpreter truncates)
            k_low = round_to_dtype(kx, kc_ptr.dtype.element_ty, BF16_BY_BITS)
            v_low = round_to_dtype(vx, vc_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + offs, k_low, mask=ok)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + offs, v_low, mask=ok)

    _attn = LazyKernel(_attn_kernel, pdl=True)
    _combine = LazyKernel(_combine_kernel, pdl=True)
    _write_kv = LazyKernel(_write_kv_kernel, pdl=True)


# ---------------------------------------------------------------- launch planning

def attention_plan(num_seqs: int, max_query_len: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                   sms: int, num_splits: Optional[int] = None) -> dict:
    """Launch shape of :func:`paged_attention` from static sizes only (CUDA-graph safe).

    Returns ``dict(rep_p, block_q, block_m, q_blocks, num_splits)``: ``rep_p`` = next power of two
    of the group size; ``block_m`` matrix rows per program = the next power of two of
    ``max_query_len * rep_p`` clipped to ``[DECODE_BLOCK_M, PREFILL_BLOCK_M]`` (at least
    ``rep_p``), i.e. ``block_q = block_m / rep_p`` query rows; ``q_blocks =
    ceil(max_query_len / block_q)``; and ``num_splits`` =
    ``min(ceil(TARGET_PROGRAMS_PER_SM * sms / (num_seqs * q_blocks * num_kv_heads)),
    ceil(max_seq_len / MIN_KEYS_PER_SPLIT), MAX_SPLITS)`` (at least 1) unless given.
    """
    rep_p = next_power_of_2(num_heads // num_kv_heads)
    block_m = max(rep_p, min(PREFILL_BLOCK_M, max(DECODE_BLOCK_M, next_power_of_2(max_query_len * rep_p))))
    block_q = block_m // rep_p
    q_blocks = cdiv(max(1, max_query_len), block_q)
    num_splits = choose_num_splits(num_splits, num_seqs * q_blocks * num_kv_heads, sms, max_seq_len,
                                   TARGET_PROGRAMS_PER_SM, MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return dict(rep_p=rep_p, block_q=block_q, block_m=block_m, q_blocks=q_blocks, num_splits=num_splits)


def combine_block_h(num_heads: int, block_s: int, block_d: int) -> int:
    """Heads per program of the split combine: a power of two with ``block_h * block_s * block_d``
    at most :data:`COMBINE_BLOCK_ELEMS` (one head at least, and no more than ``num_heads`` needs).
    One head per program left the combine of a 79-row hit step as slow as the attention itself
    (16.6 us for 79 x 64 programs of 4 x 128 values, H200, 2026-12-03)."""
    cap = max(1, COMBINE_BLOCK_ELEMS // (block_s * block_d))
    return max(1, min(1 << (cap.bit_length() - 1), next_power_of_2(num_heads)))


def combine_splits(out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor,
                   query_start_loc: Optional[torch.Tensor], num_seqs: int, num_splits: int, head_dim: int,
                   block_d: int, bf16_by_bits: bool) -> None:
    """Launch the split combine into ``out`` ``[T, num_heads, >= head_dim]`` from the scratch of
    :func:`~mtpspec.ops.paged_common.split_outputs` (fp32 ``[T, num_heads, num_splits]`` (m, l)
    pairs and ``block_d``-wide accumulators; ``out`` in the query's dtype); rows at or past
    ``query_start_loc[num_seqs]`` get zeros; ``query_start_loc=None``: every row is real (nothing
    read for it, so a caller without one launches no kernel to make it). No host sync.
    Shared by the paged, MLA and sparse MLA attentions."""
    t, nh = out.shape[0], out.shape[1]
    block_s = next_power_of_2(num_splits)
    block_h = combine_block_h(nh, block_s, block_d)
    all_rows = query_start_loc is None
    _combine[(t, cdiv(nh, block_h))](out, part_acc, part_ml, part_ml if all_rows else query_start_loc, num_seqs,
                                      num_splits, nh, out.stride(0), out.stride(1), nh * num_splits, num_splits,
                                      HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_H=block_h,
                                      BF16_BY_BITS=bf16_by_bits, ALL_ROWS=all_rows, num_warps=NUM_WARPS)


# ---------------------------------------------------------------- public ops

def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, num_splits: Optional[int] = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of a flattened varlen batch of queries against a paged KV cache.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32 (rotary applied), unit stride in
            ``head_dim``; rows may be strided.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype or both
            ``torch.float8_e4m3fn`` (e.g. ``kv_cache[0]`` and ``kv_cache[1]`` of a ``[2, ...]``
            cache); already holding this step's keys/values (:func:`write_kv_cache`).
        query_start_loc: ``[num_seqs + 1]`` int32/int64 cumulative query lengths (a zero-length
            sequence repeats the previous value).
        seq_lens: ``[num_seqs]`` int32/int64, tokens of each sequence including its queries
            (``seq_len >= q_len``; 0 for a zero-length padding sequence).
        block_tables: ``[num_seqs, max_blocks]`` int32/int64, unit-stride rows; entries past a
            sequence's ``ceil(seq_len / block_size)`` blocks are never read.
        scale: softmax scale (e.g. ``head_dim ** -0.5``).
        max_query_len: host int >= every ``q_len`` (a static upper bound under CUDA graphs).
        max_seq_len: host int >= every ``seq_len``; only chooses the key split (kernel) or the
            padded key length (reference).
        num_splits: force the number of key splits (default: :func:`attention_plan`).
        k_scale, v_scale: an fp8 cache's per-layer scales (each tile read as ``(x * scale)`` in
            q's dtype, :mod:`mtpspec.ops.kv_quant`); ignored for other caches.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype; rows at or past
        ``query_start_loc[num_seqs]`` are zeros.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, strides or devices (named in the message).

    Runs the Triton kernels on CUDA (and CPU tensors under ``TRITON_INTERPRET=1``), else
    :func:`paged_attention_ref`. No host sync, CUDA-graph capturable.
    """
    _check_attention_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len)
    if not use_triton(q, k_cache, v_cache):
        return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                   max_query_len, max_seq_len, k_scale, v_scale)
    t, nh, hd = q.shape
    b = seq_lens.shape[0]
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    plan = attention_plan(b, max_query_len, nh, nkv, max_seq_len, num_sms(q.device), num_splits)
    s = plan["num_splits"]
    block_d = next_power_of_2(max(hd, 16))
    # Triton's interpreter: its bf16 tl.dot gives garbage and its fp32 -> bf16 cast truncates, so
    # bf16 dots run in fp32 there and bf16 results are rounded by integer ops (compiled: native).
    bf16_interp = interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if t == 0:
        return torch.empty_like(q)
    if b == 0 or max_query_len == 0:
        return torch.zeros_like(q)
    out, part_acc, part_ml = split_outputs(q, s, block_d)
    block_tables = launchable_block_tables(block_tables, b)
    _attn[(b, plan["q_blocks"], nkv * s)](
        q, k_cache, v_cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables,
        float(scale) * _LOG2E, s, float(k_scale), float(v_scale), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0),
        out.stride(1), block_tables.stride(0), nh * s, s,
        REP=nh // nkv, REP_P=plan["rep_p"], BLOCK_Q=plan["block_q"], BLOCK_M=plan["block_m"], BLOCK_N=BLOCK_N,
        HEAD_DIM=hd, BLOCK_D=block_d, CACHE_BLOCK=bs, SPLIT=s > 1, DOT_FP32=bf16_interp, PRECISION=precision,
        BF16_BY_BITS=bf16_interp, FP8=is_fp8(k_cache.dtype),
        num_warps=NUM_WARPS)
    if s > 1:
        combine_splits(out, part_acc, part_ml, query_start_loc, b, s, hd, block_d, bf16_interp)
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each row's key/value to its paged cache slot; rows with a negative slot are skipped.

    Args:
        key, value: ``[n, num_kv_heads, head_dim]`` (or ``[n, num_kv_heads * head_dim]``), any
            float dtype (cast to the cache's); each row's ``num_kv_heads * head_dim`` elements
            contiguous, rows may be strided.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, each slot's
            ``num_kv_heads * head_dim`` elements contiguous.
        slot_mapping: ``[n]`` int32/int64, ``block * block_size + offset`` or ``-1`` (skip).
        k_scale, v_scale: an fp8 cache's scales: stored ``e4m3(clamp(x / scale, +-448))``
            (nearest even); ignored for other caches.

    Real slots must be distinct (or carry identical data). No host sync, CUDA-graph capturable:
    Triton kernel (one program per row) on CUDA / under ``TRITON_INTERPRET=1``, else
    :func:`write_kv_cache_ref`.

    Raises:
        ValueError: mismatched shapes or non-contiguous rows.
    """
    n = slot_mapping.shape[0]
    nb, bs, nkv, hd = k_cache.shape
    row = nkv * hd
    if v_cache.shape != k_cache.shape or key.shape[0] != n or value.shape[0] != n:
        raise ValueError(f"write_kv_cache: {n} slots, key {list(key.shape)}, value {list(value.shape)}, caches "
                         f"{list(k_cache.shape)} / {list(v_cache.shape)} do not fit together")
    key2, value2 = key.reshape(n, -1), value.reshape(n, -1)
    if key2.shape[1] != row or value2.shape[1] != row:
        raise ValueError(f"write_kv_cache: rows must hold num_kv_heads * head_dim = {row} values, got "
                         f"{key2.shape[1]} and {value2.shape[1]}")
    if n == 0:
        return
    if not use_triton(k_cache, key, value):
        write_kv_cache_ref(key2, value2, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    for name, x in (("key", key2), ("value", value2)):
        if row > 1 and x.stride(1) != 1:
            raise ValueError(f"write_kv_cache: {name} rows must be contiguous, got strides {tuple(x.stride())}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(3) != 1 or c.stride(2) != hd:
            raise ValueError(f"write_kv_cache: {name} slots must be contiguous [num_kv_heads, head_dim], got "
                             f"strides {tuple(c.stride())}")
    fp8 = is_fp8(k_cache.dtype)
    _write_kv[(n,)](key2, value2, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
                    key2.stride(0), value2.stride(0),
                    k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                    ROW=row, BLOCK_R=next_power_of_2(row), CACHE_BLOCK=bs,
                    BF16_BY_BITS=interpreting() and k_cache.dtype == torch.bfloat16 and key2.dtype == torch.float32,
                    FP8=fp8, FP8_BY_BITS=fp8 and interpreting(), num_warps=4)


__all__ = ["attention_plan", "paged_attention", "paged_attention_ref", "write_kv_cache", "write_kv_cache_ref"]
