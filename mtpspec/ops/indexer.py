"""The DeepSeek Sparse Attention lightning indexer over a paged key cache: key write, logits,
top-k. All CUDA-graph safe.

Lightning indexer (DeepSeek-V3.2 paper, sec. 2.1, eq. 1; transformers' ``DeepseekV32Indexer`` /
``GlmMoeDsaIndexer``): each token writes one key ``k_s`` (``index_head_dim`` values, after
``k_norm`` and rope) to its own paged cache ``[num_blocks, block_size, index_head_dim]``,
addressed by the same block tables as the latent cache. A query row ``t`` at position ``p`` with
``index_n_heads`` query heads ``q[t, h]`` and per-head weights ``w[t, h]`` scores every earlier
position::

    logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k_s)      for s <= p,   -inf otherwise

and attends the ``index_topk`` best (:mod:`mtpspec.ops.sparse_mla_attention`). transformers
computes ``sum_h (weights_proj(x)[h] * index_n_heads**-0.5) * relu((q_h . k_s) * index_head_dim**-0.5)``
in fp32 (``weights_proj`` kept in fp32, q and k cast to fp32); both factors are positive, so
:func:`indexer_logits` takes them folded into ``weights`` (the caller passes ``w =
weights_proj(x).float() * index_n_heads**-0.5 * index_head_dim**-0.5``) and computes exactly the
sum above in fp32: transformers' index scores up to fp32 rounding order. (The factors are the
same for every head and position, so they scale a row's logits and never change its selection,
except through rounding.) The logits tensor is ``[T, max_seq_len]`` fp32: a prefill of ``T``
rows needs ``4 * T * max_seq_len`` bytes.

Layout of the varlen batch: that of :mod:`mtpspec.ops.mla_attention` (sequence ``i`` owns rows
``query_start_loc[i] .. query_start_loc[i + 1] - 1``, its query ``j`` sits at position
``seq_lens[i] - q_len_i + j``; position ``s`` lives in block ``block_tables[i, s // block_size]``
at offset ``s % block_size``).

Logits kernel: one program per ``(query row j of a sequence, chunk of KEYS_PER_PROGRAM key
positions, sequence)``; the row's ``[index_n_heads, index_head_dim]`` query tile is loaded once
and each ``BLOCK_N``-key tile read from the cache gives ``tl.dot(k, q^T)`` (``[BLOCK_N, heads]``,
fp32 accumulation), ``relu``, times the weights, summed over heads. The row index varies fastest
in the grid, so the ``1 + k`` rows of a verification should find each key tile in L2 after the
first read (not yet measured).
Chunks past the row's position exit at once; the ``-inf`` outside the causal context comes from
the ``-inf``-filled output. Graph safety as the dense MLA op (grid from ``max_query_len`` /
``max_seq_len`` and shapes; lengths and block ids read on the device).

Dispatch (docs/structures.md): Triton on CUDA tensors and on CPU tensors under
``TRITON_INTERPRET=1``; the torch references (``*_ref``, sync-free) otherwise. :func:`indexer_topk`
is torch only (``torch.topk`` on one int64 key per position; deterministic ties).

An fp8 key cache (``torch.float8_e4m3fn``, one ``k_scale`` per indexer, :mod:`mtpspec.ops.kv_quant`):
the write quantises (``x / k_scale``, saturating, nearest even), the logits kernel dequantises
each key tile on load (``x * k_scale`` in q's dtype).
"""

from __future__ import annotations

from typing import Optional

import torch

from mtpspec.ops.kv_quant import check_cache_dtype, dequantize_cache, is_fp8, quantize_to_cache, raw
from mtpspec.ops.paged_common import launchable_block_tables, padded_queries, padded_slots, scatter_padded_rows
from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, cdiv, check_paged_metadata, check_tensor_args,
                                      interpreting, next_power_of_2, tl, use_triton)

#: Keys per inner-loop tile and per program (the query tile is loaded once per program).
BLOCK_N = 64
KEYS_PER_PROGRAM = 512
NUM_WARPS = 4
NUM_STAGES = 2
#: Torch reference: heads per einsum, chosen so a chunk's ``[B, Q, heads, S]`` scores stay under
#: this many elements (a static loop).
REF_CHUNK_ELEMS = 1 << 26


def _check_int(op: str, name: str, v: object, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{op}: {name} must be an int >= {lo}, got {v!r}")


def _check_logits_inputs(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         max_query_len: int, max_seq_len: int) -> None:
    op = "indexer_logits"
    check_tensor_args(op, "q", q, (("q", q), ("weights", weights), ("k_cache", k_cache),
                                   ("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                                   ("block_tables", block_tables)))
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"{op}: q must be [num_tokens, index_n_heads, index_head_dim] and weights "
                         f"[num_tokens, index_n_heads], got {list(q.shape)} and {list(weights.shape)}")
    if k_cache.dim() != 3 or k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: k_cache must be [num_blocks, block_size, index_head_dim={q.shape[2]}], got "
                         f"{list(k_cache.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: q must be float16/bfloat16/float32, got {q.dtype}")
    check_cache_dtype(op, q.dtype, k_cache)
    if weights.dtype != torch.float32:
        raise TypeError(f"{op}: weights must be float32, got {weights.dtype}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or (weights.shape[1] > 1 and weights.stride(1) != 1):
        raise ValueError(f"{op}: q, weights and k_cache need unit stride in their last dimension")
    check_paged_metadata(op, query_start_loc, seq_lens, block_tables, max_query_len)
    _check_int(op, "max_seq_len", max_seq_len, 0)


# ---------------------------------------------------------------- torch references

def indexer_logits_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                       max_seq_len: int, k_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`indexer_logits` (same arguments and result; fp32 products and
    sums, float64 for float64 inputs; an fp8 cache read as ``(x * k_scale).to(q.dtype)``).
    Sync-free: every sequence padded to ``max_query_len`` rows and ``max_seq_len`` keys, heads in static chunks (``REF_CHUNK_ELEMS``)."""
    t, nh, _ = q.shape
    b = seq_lens.shape[0]
    dev = q.device
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if t == 0 or b == 0 or max_query_len == 0 or max_seq_len == 0:
        return torch.full((t, max_seq_len), float("-inf"), dtype=out_dtype, device=dev)
    q_lens, s_lens, j, rows, row_ok = padded_queries(query_start_loc, seq_lens, max_query_len, dev)
    safe_rows = torch.where(row_ok, rows, 0).reshape(-1)
    qp = q.to(acc_dtype).index_select(0, safe_rows).view(b, max_query_len, nh, -1)
    wp = weights.to(acc_dtype).index_select(0, safe_rows).view(b, max_query_len, nh)
    pos, key_ok, slots = padded_slots(block_tables, s_lens, max_seq_len, k_cache.shape[1],
                                      k_cache.shape[0], dev)
    kp = k_cache.reshape(-1, k_cache.shape[2]).index_select(0, slots.reshape(-1)).view(b, max_seq_len, -1)
    kp = dequantize_cache(kp, q.dtype, k_scale).to(acc_dtype)
    logits = torch.zeros(b, max_query_len, max_seq_len, dtype=acc_dtype, device=dev)
    hc = max(1, min(nh, REF_CHUNK_ELEMS // (b * max_query_len * max_seq_len)))
    for h0 in range(0, nh, hc):
        s = torch.relu(torch.einsum("bqhd,bsd->bqhs", qp[:, :, h0:h0 + hc], kp))
        logits += torch.einsum("bqhs,bqh->bqs", s, wp[:, :, h0:h0 + hc])
    q_pos = (s_lens - q_lens)[:, None] + j[None, :]  # [B, Q]
    ok = (pos[None, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :] & row_ok[:, :, None]
    logits = logits.masked_fill(~ok, float("-inf"))
    full = scatter_padded_rows(logits[:, :, None, :], rows, row_ok, t, acc_dtype, out_dtype)[:, 0]
    # rows of no sequence (graph padding) come out 0 from the scatter: -inf like the kernel's
    covered = torch.zeros(t + 1, dtype=torch.bool, device=dev)
    covered.index_fill_(0, torch.where(row_ok, rows, t).reshape(-1), True)
    return full.masked_fill(~covered[:t, None], float("-inf"))


def indexer_k_cache_write_ref(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              k_scale: float = 1.0) -> None:
    """Torch version of :func:`indexer_k_cache_write` (fp8: :func:`~mtpspec.ops.kv_quant.quantize_to_cache`,
    bytes moved as uint8), sync-free: a row with slot ``-1`` is
    redirected to the first valid row's slot with that row's values (identical duplicates, so
    the result does not depend on write order); with no valid row, slot 0 gets its own content."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    d = k_cache.shape[-1]
    flat = raw(k_cache.view(-1, d))
    new = raw(quantize_to_cache(k.reshape(n, d), k_cache.dtype, k_scale))
    slots = slot_mapping.long()
    valid = slots >= 0
    any_valid = valid.any().view(1)
    first = torch.argmax(valid.to(torch.int8)).view(1)
    idx = torch.where(valid, slots, torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first)))
    fb_val = torch.where(any_valid[:, None], new.index_select(0, first), flat[:1])
    flat.index_copy_(0, idx, torch.where(valid[:, None], new, fb_val))


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import dequant_kv, quant_fp8, round_to_dtype

    def _indexer_logits_kernel(q_ptr, w_ptr, k_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, out_width, k_scale,
                               stride_qt, stride_qh, stride_wt, stride_kb, stride_ks, stride_ot, stride_bt,
                               NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_PER_PROGRAM: tl.constexpr,
                               CACHE_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                               FP8: tl.constexpr):
        # One program: query row j of sequence `seq`, key positions [chunk * KEYS_PER_PROGRAM, +KEYS_PER_PROGRAM)
        # clipped to the row's causal context 0 .. p.
        j = tl.program_id(0)
        chunk = tl.program_id(1)
        seq = tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
        if j >= q_len:  # past this sequence's rows (padding sequences: all)
            return
        p = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len + j
        k_lo = chunk * KEYS_PER_PROGRAM
        k_hi = tl.minimum(tl.minimum(k_lo + KEYS_PER_PROGRAM, p + 1), out_width)
        if k_lo >= k_hi:
            return
        row = (q_start + j).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < NUM_HEADS
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + row * stride_wt + offs_h, mask=h_ok, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(k_lo, k_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_hi
            blk = tl.load(bt_row + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
            base = blk * stride_kb + (offs_n % CACHE_BLOCK) * stride_ks
            k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if FP8:  # (DOT_FP32 = interpreter and bf16 q: round to bf16 by integer ops there)
                k = dequant_kv(k, k_scale, q_ptr.dtype.element_ty, DOT_FP32)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.maximum(tl.dot(k, tl.trans(q), input_precision=PRECISION), 0.0)  # [BLOCK_N, BLOCK_H]
            logit = tl.sum(s * w[None, :], axis=1)
            tl.store(out_ptr + row * stride_ot + offs_n, logit, mask=n_ok)

    def _indexer_k_write_kernel(k_ptr, cache_ptr, slot_ptr, k_scale, stride_kt, stride_cb, stride_cs,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                                BF16_BY_BITS: tl.constexpr, FP8: tl.constexpr, FP8_BY_BITS: tl.constexpr):
        # One program per row: its key to its slot's HEAD_DIM values; slot < 0: skip.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        ok = offs < HEAD_DIM * (slot >= 0).to(tl.int32)
        x = tl.load(k_ptr + t * stride_kt + offs, mask=ok).to(tl.float32)
        dst = cache_ptr + (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
        if FP8:
            x_low = quant_fp8(x, k_scale, FP8_BY_BITS)
        else:
            x_low = round_to_dtype(x, cache_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(dst + offs, x_low, mask=ok)

    _indexer_logits = LazyKernel(_indexer_logits_kernel)
    _indexer_k_write = LazyKernel(_indexer_k_write_kernel)


# ---------------------------------------------------------------- public ops

def indexer_k_cache_write(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: float = 1.0) -> None:
    """Write each row's indexer key to its paged cache slot; negative slots skipped.

    Args:
        k: ``[n, index_head_dim]`` (or ``[n, 1, index_head_dim]``), any float dtype (cast to the
            cache's, rounded to nearest even); unit stride in the last dimension.
        k_cache: ``[num_blocks, block_size, index_head_dim]``, unit stride in the last dimension.
        slot_mapping: ``[n]`` int32/int64, ``block * block_size + offset`` or ``-1`` (skip): the
            latent cache's slots (both caches share the block tables).
        k_scale: an fp8 cache's scale: stored ``e4m3(clamp(x / k_scale, +-448))`` (nearest even).

    Real slots must be distinct (or carry identical data). No host sync, CUDA-graph capturable:
    Triton kernel (one program per row) on CUDA / under ``TRITON_INTERPRET=1``, else
    :func:`indexer_k_cache_write_ref`.

    Raises:
        ValueError: mismatched shapes or strides.
    """
    n = slot_mapping.shape[0]
    if k_cache.dim() != 3 or slot_mapping.dim() != 1 or k.shape[0] != n or k.numel() != n * k_cache.shape[2]:
        raise ValueError(f"indexer_k_cache_write: {n} slots, k {list(k.shape)} and k_cache {list(k_cache.shape)} "
                         "do not fit together (need k [n, index_head_dim], k_cache [blocks, block_size, "
                         "index_head_dim])")
    if n == 0:
        return
    k2 = k.reshape(n, -1)
    if not use_triton(k_cache, k2):
        indexer_k_cache_write_ref(k2, k_cache, slot_mapping, k_scale)
        return
    d = k_cache.shape[2]
    if (d > 1 and k2.stride(1) != 1) or k_cache.stride(2) != 1:
        raise ValueError(f"indexer_k_cache_write: need unit stride in the last dimension, got k {tuple(k2.stride())}, "
                         f"k_cache {tuple(k_cache.stride())}")
    fp8 = is_fp8(k_cache.dtype)
    _indexer_k_write[(n,)](k2, k_cache, slot_mapping, float(k_scale), k2.stride(0), k_cache.stride(0),
                           k_cache.stride(1),
                           HEAD_DIM=d, BLOCK_D=next_power_of_2(d), CACHE_BLOCK=k_cache.shape[1],
                           BF16_BY_BITS=interpreting() and k_cache.dtype == torch.bfloat16,
                           FP8=fp8, FP8_BY_BITS=fp8 and interpreting(),
                           num_warps=max(1, min(4, next_power_of_2(d) // 256)))


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                   block_n: Optional[int] = None, keys_per_program: Optional[int] = None,
                   num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                   k_scale: float = 1.0) -> torch.Tensor:
    """Indexer logits of a flattened varlen batch against the paged indexer key cache.

    Args:
        q: ``[T, index_n_heads, index_head_dim]`` fp16/bf16/fp32 (rope applied), unit stride in
            the last dimension.
        weights: ``[T, index_n_heads]`` float32, with every scale folded in (module docstring:
            ``weights_proj(x) * index_n_heads**-0.5 * index_head_dim**-0.5``).
        k_cache: ``[num_blocks, block_size, index_head_dim]`` of q's dtype or
            ``torch.float8_e4m3fn`` (read as ``x * k_scale`` in q's dtype), already holding this
            step's keys (:func:`indexer_k_cache_write`).
        query_start_loc, seq_lens, block_tables, max_query_len: as
            :func:`mtpspec.ops.mla_attention.mla_attention`.
        max_seq_len: an int >= every ``seq_len`` (a graph's bound): the logits' width.
        block_n, keys_per_program, num_warps, num_stages: launch overrides (tuning).
        k_scale: an fp8 cache's per-layer scale (ignored for other caches).

    Returns:
        ``logits [T, max_seq_len]`` float32 (float64 for float64 inputs on the torch path):
        ``sum_h weights[t, h] * relu(q[t, h] . k_s)`` for positions ``s <= p`` of row ``t``'s
        causal context, ``-inf`` at ``s > p``; rows at or past ``query_start_loc[num_seqs]`` are
        all ``-inf``.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, strides, devices or ints (named in the message).

    Triton kernel on CUDA (and CPU under ``TRITON_INTERPRET=1``), else :func:`indexer_logits_ref`.
    No host sync, CUDA-graph capturable.
    """
    _check_logits_inputs(q, weights, k_cache, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len)
    if not use_triton(q, weights, k_cache):
        return indexer_logits_ref(q, weights, k_cache, query_start_loc, seq_lens, block_tables, max_query_len,
                                  max_seq_len, k_scale)
    t, nh, d = q.shape
    b = seq_lens.shape[0]
    out = torch.full((t, max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or b == 0 or max_query_len == 0 or max_seq_len == 0:
        return out
    kpp = KEYS_PER_PROGRAM if keys_per_program is None else int(keys_per_program)
    block_tables = launchable_block_tables(block_tables, b)
    _indexer_logits[(max_query_len, cdiv(max_seq_len, kpp), b)](
        q, weights, k_cache, out, query_start_loc, seq_lens, block_tables, max_seq_len, float(k_scale),
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), out.stride(0),
        block_tables.stride(0),
        NUM_HEADS=nh, HEAD_DIM=d, BLOCK_H=next_power_of_2(max(nh, 16)), BLOCK_D=next_power_of_2(max(d, 16)),
        BLOCK_N=BLOCK_N if block_n is None else int(block_n), KEYS_PER_PROGRAM=kpp, CACHE_BLOCK=k_cache.shape[1],
        DOT_FP32=interpreting() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=is_fp8(k_cache.dtype),
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages)
    return out


def indexer_topk(logits: torch.Tensor, index_topk: int) -> torch.Tensor:
    """The ``index_topk`` best positions of each row among its finite logits.

    Ties at the boundary go to the LOWER position: each position gets one int64 key, the
    order-preserving int32 image of its fp32 logit (``-0.0`` counted as ``+0.0``) in the high
    half and ``2**32 - 1 - position`` in the low half, so keys are distinct and ``torch.topk`` on
    them is deterministic (transformers' ``topk`` on the float logits states no tie policy; its
    picks may differ from these only among equal logits).

    Args:
        logits: ``[T, S]`` float32 (:func:`indexer_logits`; ``-inf`` marks positions outside the
            causal context; ``-inf``, ``+inf`` and NaN are never selected), ``S < 2**31``.
        index_topk: an int >= 1.

    Returns:
        ``topk_pos [T, index_topk]`` int32: each row's selected positions in ASCENDING order, then
        ``-1`` for the entries a row with fewer than ``index_topk`` finite logits cannot fill.
        Torch ops only; no host sync, CUDA-graph capturable.

    Raises:
        TypeError / ValueError: logits not a 2-D float32 tensor, ``index_topk`` not an int >= 1.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"indexer_topk: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"indexer_topk: logits must be [num_tokens, max_seq_len], got {list(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"indexer_topk: logits must be float32, got {logits.dtype}")
    _check_int("indexer_topk", "index_topk", index_topk, 1)
    t, s = logits.shape
    if s == 0:
        return torch.full((t, index_topk), -1, dtype=torch.int32, device=logits.device)
    bits = torch.where(logits == 0, torch.zeros_like(logits), logits).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in the float value
    pos = torch.arange(s, device=logits.device, dtype=torch.int64)
    key = ordered * (1 << 32) + ((1 << 32) - 1 - pos)
    key = torch.where(torch.isfinite(logits), key, torch.iinfo(torch.int64).min)
    k = min(index_topk, s)
    top = torch.topk(key, k, dim=1, sorted=False)
    picked = torch.where(top.values > torch.iinfo(torch.int64).min, top.indices, s)
    picked = torch.sort(picked, dim=1).values  # ascending positions, unfilled entries (= s) last
    out = torch.where(picked < s, picked, -1).to(torch.int32)
    if k < index_topk:
        out = torch.cat([out, out.new_full((t, index_topk - k), -1)], dim=1)
    return out


__all__ = ["indexer_k_cache_write", "indexer_k_cache_write_ref", "indexer_logits", "indexer_logits_ref",
           "indexer_topk"]
