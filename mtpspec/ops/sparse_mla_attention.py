"""Sparse MLA attention over the paged latent cache (DeepSeek Sparse Attention), CUDA-graph safe.

DeepSeek Sparse Attention (DeepSeek-V3.2 paper, sec. 2.1): each query row attends only the
``index_topk`` cache positions its lightning indexer selected (:mod:`mtpspec.ops.indexer`), in
the absorbed MLA form of :mod:`mtpspec.ops.mla_attention` (same cache ``[num_blocks, block_size,
kv_lora_rank + rope]``, keys ``[c_kv | k_pe]``, values ``c_kv``, one latent "head" shared by all
heads)::

    o_latent[t, h] = softmax_k(scale * (q_latent[t, h] . c_kv[k] + q_pe[t, h] . k_pe[k])) @ c_kv

with ``k`` over the valid entries of ``topk_slots[t]``: GLOBAL cache slots (``block_id *
block_size + offset``, :func:`positions_to_slots` makes them from positions). Every row has its
own selection (decode, the ``1 + k`` rows of a verification, prefill rows alike); no causal mask
is applied, the selection is the mask. An entry ``< 0`` (or ``>= num_blocks * block_size``) is
unused and never read, wherever it sits in the row; a row with no valid entry gives zeros.
Slots must be distinct within a row (the caller guarantees it: a duplicate would be counted
twice in the softmax).

Kernel: one program per ``(block of BLOCK_M heads, split of the K entries, query row)``. The
row's heads are the tile's matrix rows (padded to a power of two >= 16, masked), so each latent
tile gathered from the cache (``BLOCK_N`` selected rows, ``[BLOCK_N, kv_lora_rank]`` in two
halves + ``[BLOCK_N, rope]``, loaded once) serves every head: the dense MLA kernel's tile step
(``_mla_tile``: the score dots, then the same latent halves as the value operand of
``p @ c_kv``) with its causal test switched off. A pre-pass over the split's slot ids (4 bytes
each) finds the span holding its valid entries, so leading and trailing ``-1`` cost no tiles
(``-1`` inside the span are masked) and the main loop stays branch-free, hence pipelined. With
more heads than ``BLOCK_M`` (128 heads: 2 head blocks of 64; the fp32 accumulator ``[BLOCK_M,
kv_lora_rank]`` lives in registers, 128 rows of it would not fit) the head blocks of a row are
adjacent in the grid, so the second gather of each latent row should come from L2. Online
softmax in base 2 with fp32 statistics (FlashAttention-2, Dao 2023, Algorithm 1) and the
flash-decoding split over K (Dao, Haziza, Massa, Sizov 2023) merged by the combine kernel of
:mod:`mtpspec.ops.paged_attention` (same ``(m, l, acc)`` scratch layout as the dense MLA op).

CUDA-graph safety: grid, scratch shapes and every Python branch depend only on tensor shapes;
slots are read on the device. Dispatch (docs/structures.md): Triton on CUDA tensors and on CPU
tensors under ``TRITON_INTERPRET=1``, the torch reference (sync-free) otherwise.

An fp8 latent cache (``torch.float8_e4m3fn``, :mod:`mtpspec.ops.kv_quant`) is read as the dense
kernel reads it: each gathered tile converted to q's dtype unscaled (exact), ``k_scale`` applied to
the fp32 scores and the fp32 output accumulator (``_widen_fp8``, ``_fp8_values``), i.e. the cache
read as ``float(x) * k_scale`` in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from mtpspec.ops import mla_gluon, mla_gluon_km
from mtpspec.ops.argmax import num_sms
from mtpspec.ops.kv_quant import check_cache_dtype, dequantize_cache, is_fp8
from mtpspec.ops.mla_attention import FP8_BLOCK_N
from mtpspec.ops.paged_attention import combine_splits
from mtpspec.ops.paged_common import choose_num_splits, split_outputs
from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, cdiv, check_tensor_args, interpreting, next_power_of_2,
                                      tl, use_triton)

#: Heads per program (matrix rows of the score tile; 16 = smallest tl.dot tile, 64 as the dense
#: MLA kernel's H200 default: a [64, kv_lora_rank] fp32 accumulator fits in registers, 128 does not).
BLOCK_M = 64
MIN_BLOCK_M = 16
#: Selected entries per inner-loop tile; slot ids per step of the pre-pass that finds a split's valid span.
BLOCK_N = 64
SCAN_N = 256
#: Launch defaults by ``block_m``, taken from the dense MLA kernel's H200 sweeps (same tile step;
#: its 16-row tiles gather like this kernel): 16-row tiles 4 warps and about 5 programs per SM in
#: flight to hide the gather latency, 32 / 64-row tiles 8 warps and at most one wave
#: (``floor(T * sms / work)`` splits). Not yet swept for this kernel (bench_sparse_mla.py --sweep).
NUM_WARPS = {16: 4, 32: 8, 64: 8}
TARGET_PROGRAMS_PER_SM = {16: 5, 32: 1, 64: 1}
NUM_STAGES = 2
#: Split over the K entries (flash-decoding): its limits.
MAX_SPLITS = 32
MIN_SLOTS_PER_SPLIT = 256
#: Torch reference: rows per chunk are chosen so one chunk's gathered latents stay under this
#: many elements (a static loop: prefill-sized batches without a T * K * D intermediate).
REF_CHUNK_ELEMS = 1 << 26

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------- checks

def _check_sparse_inputs(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         topk_slots: torch.Tensor) -> None:
    op = "sparse_mla_attention"
    check_tensor_args(op, "q_latent", q_latent, (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache),
                                                 ("topk_slots", topk_slots)))
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"{op}: q_latent must be [num_tokens, num_heads, kv_lora_rank] and q_pe "
                         f"[num_tokens, num_heads, rope], got {list(q_latent.shape)} and {list(q_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q_latent.shape[2] + q_pe.shape[2]:
        raise ValueError(f"{op}: kv_cache must be [num_blocks, block_size, kv_lora_rank + rope = "
                         f"{q_latent.shape[2] + q_pe.shape[2]}], got {list(kv_cache.shape)}")
    if q_latent.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q_pe.dtype != q_latent.dtype:
        raise TypeError(f"{op}: q_latent and q_pe must share one of float16/bfloat16/float32, "
                        f"got {q_latent.dtype}, {q_pe.dtype}")
    check_cache_dtype(op, q_latent.dtype, kv_cache)
    if q_latent.stride(2) != 1 or q_pe.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError(f"{op}: q_latent, q_pe and kv_cache need unit stride in their last dimension")
    if topk_slots.dim() != 2 or topk_slots.shape[0] != q_latent.shape[0]:
        raise ValueError(f"{op}: topk_slots must be [num_tokens={q_latent.shape[0]}, topk], got "
                         f"{list(topk_slots.shape)}")
    if topk_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: topk_slots must be int32 (or int64), got {topk_slots.dtype}")
    if topk_slots.shape[1] > 1 and topk_slots.stride(1) != 1:
        raise ValueError(f"{op}: topk_slots needs unit stride in its last dimension")


# ---------------------------------------------------------------- torch references

def sparse_mla_attention_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                             topk_slots: torch.Tensor, scale: float, k_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`sparse_mla_attention` (same arguments and result): the rows'
    selected latents gathered (an fp8 cache's read as ``float(x) * k_scale`` in fp32, as the kernel
    applies it: unscaled tiles, ``k_scale`` on the fp32 scores and outputs), fp32 scores /
    softmax / products (float64 for float64 inputs).
    Sync-free; rows go in static chunks of at most ``REF_CHUNK_ELEMS / (K * (kv_lora_rank +
    rope))`` so the gathered latents never need ``T * K * (kv_lora_rank + rope)`` elements."""
    t, nh, r = q_latent.shape
    d = kv_cache.shape[2]
    k = topk_slots.shape[1]
    acc_dtype = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    if t == 0 or k == 0:
        return torch.zeros(t, nh, r, dtype=q_latent.dtype, device=q_latent.device)
    flat = kv_cache.reshape(-1, d)
    n_slots = flat.shape[0]
    chunk = max(1, REF_CHUNK_ELEMS // (k * d))
    outs = []
    for lo in range(0, t, chunk):
        hi = min(t, lo + chunk)
        slots = topk_slots[lo:hi].long()
        ok = (slots >= 0) & (slots < n_slots)  # [c, K]
        kv = flat.index_select(0, torch.where(ok, slots, 0).reshape(-1)).view(hi - lo, k, d)
        kv = dequantize_cache(kv, acc_dtype, k_scale).to(acc_dtype)
        kv = torch.where(ok[:, :, None], kv, torch.zeros_like(kv))  # unused entries never reach p @ v
        q = torch.cat([q_latent[lo:hi], q_pe[lo:hi]], dim=-1).to(acc_dtype)
        s = torch.einsum("thd,tkd->thk", q, kv) * scale
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        l = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(l > 0, l, torch.ones_like(l))
        outs.append(torch.einsum("thk,tkr->thr", p, kv[..., :r]).to(q_latent.dtype))
    return torch.cat(outs)


def positions_to_slots(topk_pos: torch.Tensor, token_seq_idx: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """Global cache slots of selected positions: ``topk_slots[t, j] = block_tables[token_seq_idx[t],
    p // block_size] * block_size + p % block_size`` for ``p = topk_pos[t, j]``.

    Args:
        topk_pos: ``[T, K]`` int32/int64 positions within row ``t``'s sequence, ``-1`` = unused
            (e.g. :func:`mtpspec.ops.indexer.indexer_topk`'s output).
        token_seq_idx: ``[T]`` int32/int64, the ``block_tables`` row of each query row (values
            outside ``[0, num_seqs)`` are clamped into it, not checked: no host sync).
        block_tables: ``[num_seqs, max_blocks]`` int32/int64 (padding entries may be ``-1``).
        block_size: cache block size (tokens per block), an int >= 1.

    Returns:
        ``[T, K]`` int32 slots; ``-1`` where the position is ``< 0``, lies past the table's width,
        or falls in a negative (padding) block id. Sync-free, CUDA-graph capturable (torch ops).

    Raises:
        ValueError / TypeError: wrong shapes, dtypes, devices or ``block_size``.
    """
    op = "positions_to_slots"
    check_tensor_args(op, "topk_pos", topk_pos, (("topk_pos", topk_pos), ("token_seq_idx", token_seq_idx),
                                                 ("block_tables", block_tables)))
    if topk_pos.dim() != 2 or token_seq_idx.shape != (topk_pos.shape[0],) or block_tables.dim() != 2:
        raise ValueError(f"{op}: need topk_pos [T, K], token_seq_idx [T] and block_tables [num_seqs, max_blocks], "
                         f"got {list(topk_pos.shape)}, {list(token_seq_idx.shape)}, {list(block_tables.shape)}")
    for name, x in (("topk_pos", topk_pos), ("token_seq_idx", token_seq_idx), ("block_tables", block_tables)):
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: {name} must be int32 or int64, got {x.dtype}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"{op}: block_size must be an int >= 1, got {block_size!r}")
    width = block_tables.shape[1]
    if width == 0 or block_tables.shape[0] == 0:
        return torch.full(topk_pos.shape, -1, dtype=torch.int32, device=topk_pos.device)
    pos = topk_pos.long()
    col = pos.div(block_size, rounding_mode="floor")
    ok = (pos >= 0) & (col < width)
    rows = block_tables.long().index_select(0, token_seq_idx.long().clamp(0, block_tables.shape[0] - 1))
    blk = rows.gather(1, torch.where(ok, col, 0))
    ok = ok & (blk >= 0)
    return torch.where(ok, blk * block_size + pos % block_size, -1).to(torch.int32)


# ---------------------------------------------------------------- kernel

if HAS_TRITON:
    from mtpspec.ops.mla_attention import _fp8_values, _masked_latent, _mla_tile  # the dense kernel's tile, shared
    from mtpspec.ops.triton_helpers import round_to_dtype

    def _sparse_mla_kernel(ql_ptr, qp_ptr, kv_ptr, slots_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                           qk_scale, num_topk, n_slots, num_splits, k_scale,
                           stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_kb, stride_ks, stride_st,
                           stride_ot, stride_oh, stride_pt, stride_ph,
                           NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                           BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, SCAN_N: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                           SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                           BF16_BY_BITS: tl.constexpr, FP8: tl.constexpr):
        # One program: heads [hb * BLOCK_M, (hb + 1) * BLOCK_M) of query row `row`, its split `split`
        # of the row's K selected slots. Scores in base 2; the latent in two halves of HALF columns
        # and each tile through the dense kernel's _mla_tile (no causal mask: the selection is the mask).
        HALF: tl.constexpr = BLOCK_L // 2
        hb = tl.program_id(0)
        split = tl.program_id(1)
        row = tl.program_id(2).to(tl.int64)
        head = hb * BLOCK_M + tl.arange(0, BLOCK_M)
        h_ok = head < NUM_HEADS
        offs_h = tl.arange(0, HALF)
        h0_ok = offs_h < LORA
        h1_ok = offs_h + HALF < LORA
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < ROPE
        ql_rows = ql_ptr + row * stride_qlt + head[:, None] * stride_qlh
        ql0 = tl.load(ql_rows + offs_h[None, :], mask=h_ok[:, None] & h0_ok[None, :], other=0.0)
        ql1 = tl.load(ql_rows + HALF + offs_h[None, :], mask=h_ok[:, None] & h1_ok[None, :], other=0.0)
        qp = tl.load(qp_ptr + row * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_FP32:
            ql0 = ql0.to(tl.float32)
            ql1 = ql1.to(tl.float32)
            qp = qp.to(tl.float32)
        chunk = tl.cdiv(tl.cdiv(num_topk, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        k_hi = tl.minimum(k_lo + chunk, num_topk)
        # Pre-pass over this split's slot ids (4 bytes per entry): the span [v_lo, v_hi) holding its
        # valid ones, so the -1 tail of a short context's selection (indexer_topk puts unused
        # entries last) costs no tiles, while the main loop stays branch-free (pipelined).
        v_lo = k_hi
        v_hi = v_lo * 0  # (k_hi < k_lo in splits past the end: start from an empty span)
        for start in range(k_lo, k_hi, SCAN_N):
            offs = start + tl.arange(0, SCAN_N)
            sl = tl.load(slots_ptr + row * stride_st + offs, mask=offs < k_hi, other=-1)
            ok = (sl >= 0) & (sl < n_slots)
            v_lo = tl.minimum(v_lo, tl.min(tl.where(ok, offs, k_hi), axis=0))
            v_hi = tl.maximum(v_hi, tl.max(tl.where(ok, offs + 1, 0), axis=0))
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        no_pos = tl.zeros([BLOCK_N], dtype=tl.int32)  # _mla_tile's causal test `pos <= q_pos`: always true
        no_q_pos = tl.zeros([BLOCK_M], dtype=tl.int32)
        if FP8:  # unscaled tiles (the dense kernel's _widen_fp8): k_scale on the scores and on acc, below
            qk_scale = qk_scale * k_scale
        for start in range(v_lo, v_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            slot = tl.load(slots_ptr + row * stride_st + offs_n, mask=offs_n < v_hi, other=-1).to(tl.int64)
            n_ok = (slot >= 0) & (slot < n_slots)
            base = (slot // CACHE_BLOCK) * stride_kb + (slot % CACHE_BLOCK) * stride_ks
            # the gathered latent tile: keys' first part and the values, loaded once for every head
            q_dtype = ql_ptr.dtype.element_ty
            k0 = _masked_latent(kv_ptr, base, offs_h, h0_ok, n_ok, q_dtype, FP8, DOT_FP32)
            k1 = _masked_latent(kv_ptr, base + HALF, offs_h, h1_ok, n_ok, q_dtype, FP8, DOT_FP32)
            kr = _masked_latent(kv_ptr, base + LORA, offs_r, r_ok, n_ok, q_dtype, FP8, DOT_FP32)
            v0, v1 = k0, k1
            if FP8:
                v0, v1 = _fp8_values(k0, n_ok, BLOCK_M), _fp8_values(k1, n_ok, BLOCK_M)
            acc0, acc1, m_i, l_i = _mla_tile(acc0, acc1, m_i, l_i, ql0, ql1, qp, k0, k1, kr, v0, v1, no_pos, n_ok,
                                             no_q_pos, h_ok, qk_scale, PRECISION)
        if FP8:
            acc0 = acc0 * k_scale
            acc1 = acc1 * k_scale
        if SPLIT:
            pbase = row * stride_pt + head * stride_ph + split
            tl.store(part_ml_ptr + 2 * pbase, m_i, mask=h_ok)
            tl.store(part_ml_ptr + 2 * pbase + 1, l_i, mask=h_ok)
            acc_rows = part_acc_ptr + pbase[:, None] * BLOCK_L
            tl.store(acc_rows + offs_h[None, :], acc0, mask=h_ok[:, None])
            tl.store(acc_rows + HALF + offs_h[None, :], acc1, mask=h_ok[:, None])
        else:
            denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_rows = out_ptr + row * stride_ot + head[:, None] * stride_oh
            o0 = round_to_dtype(acc0 / denom, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_rows + offs_h[None, :], o0, mask=h_ok[:, None] & h0_ok[None, :])
            o1 = round_to_dtype(acc1 / denom, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_rows + HALF + offs_h[None, :], o1, mask=h_ok[:, None] & h1_ok[None, :])

    _sparse_mla = LazyKernel(_sparse_mla_kernel)


# ---------------------------------------------------------------- launch planning

def sparse_mla_attention_plan(num_tokens: int, num_heads: int, topk: int, sms: int,
                              num_splits: Optional[int] = None, block_m: Optional[int] = None) -> dict:
    """Launch shape of :func:`sparse_mla_attention` from static sizes only (CUDA-graph safe).

    Returns ``dict(block_m, head_blocks, num_splits, num_warps)``: ``block_m`` heads per program =
    ``BLOCK_M`` (or the given power of two >= 16) clipped to ``[MIN_BLOCK_M, next power of two of
    num_heads]``; ``head_blocks = ceil(num_heads / block_m)``; ``num_splits`` unless given =
    ``min(T * sms // (num_tokens * head_blocks), ceil(topk / MIN_SLOTS_PER_SPLIT), MAX_SPLITS)``,
    at least 1, with ``T = TARGET_PROGRAMS_PER_SM[block_m]``; ``num_warps = NUM_WARPS[block_m]``.

    Raises:
        ValueError: ``block_m`` not a power of two >= 16, ``num_splits`` not an int >= 1.
    """
    block_m = BLOCK_M if block_m is None else int(block_m)
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK_M}, got {block_m}")
    block_m = max(MIN_BLOCK_M, min(block_m, next_power_of_2(num_heads)))
    head_blocks = cdiv(max(1, num_heads), block_m)
    if num_splits is None:
        work = max(1, num_tokens * head_blocks)
        num_splits = max(1, min(TARGET_PROGRAMS_PER_SM.get(block_m, 1) * sms // work,
                                cdiv(max(1, topk), MIN_SLOTS_PER_SPLIT), MAX_SPLITS))
    num_splits = choose_num_splits(num_splits, 0, sms, topk, 1, MIN_SLOTS_PER_SPLIT, MAX_SPLITS)  # (checks it)
    return dict(block_m=block_m, head_blocks=head_blocks, num_splits=num_splits, num_warps=NUM_WARPS.get(block_m, 8))


# ---------------------------------------------------------------- public op

def sparse_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         topk_slots: torch.Tensor, scale: float, num_splits: Optional[int] = None,
                         block_m: Optional[int] = None, block_n: Optional[int] = None,
                         num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                         k_scale: float = 1.0, impl: Optional[str] = None) -> torch.Tensor:
    """Absorbed MLA attention of each query row over its own selected cache slots.

    Args:
        q_latent: ``[T, num_heads, kv_lora_rank]`` fp16/bf16/fp32; q_pe: ``[T, num_heads, rope]``
            (rope applied); unit stride in the last dimension, rows / heads may be strided.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]`` of q's dtype or
            ``torch.float8_e4m3fn`` (read as ``float(x) * k_scale``: unscaled tiles, the scale on
            the fp32 scores and outputs; the dense MLA op's latent cache, already holding this
            step's entries).
        topk_slots: ``[T, K]`` int32 (int64 accepted), unit stride in the last dimension: row
            ``t``'s selected GLOBAL slots ``block_id * block_size + offset``; ``-1`` (any entry
            ``< 0`` or ``>= num_blocks * block_size``) = unused, anywhere in the row. Valid slots
            of a row must be distinct (not checked).
        scale: softmax scale (as :func:`mtpspec.ops.mla_attention.mla_attention`).
        num_splits, block_m, block_n, num_warps, num_stages: launch overrides (tuning; default
            :func:`sparse_mla_attention_plan` and the module constants).
        k_scale: an fp8 cache's per-layer scale (ignored for other caches).
        impl: ``"gluon"``: the warp-specialised Hopper kernel (:func:`mtpspec.ops.mla_gluon.launch_sparse`,
            ValueError where not :func:`~mtpspec.ops.mla_gluon.sparse_supported`); ``"gluon-km"``: the
            Hopper kernel with the keys as the MMA's M dimension for at most 32 heads
            (:func:`mtpspec.ops.mla_gluon_km.launch_sparse_km`; ValueError for more heads or where
            ``"gluon"`` cannot run); ``"triton"``: this module's kernel; ``None``: a Gluon kernel where
            one is supported (any head count; fewer than 64 pad one head block; ``"gluon-km"`` at <= 32
            heads with ``MTPSPEC_MLA_SPARSE_KM=1``), no launch override is given and
            ``MTPSPEC_MLA_GLUON`` is not ``0``.

    Returns:
        ``o_latent [T, num_heads, kv_lora_rank]`` in q's dtype; rows with no valid slot are zeros.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, strides or devices (named in the message).

    Triton kernel on CUDA (and CPU under ``TRITON_INTERPRET=1``), else
    :func:`sparse_mla_attention_ref`. No host sync, CUDA-graph capturable.
    """
    _check_sparse_inputs(q_latent, q_pe, kv_cache, topk_slots)
    nh = q_latent.shape[1]
    if impl not in (None, "triton", "gluon", "gluon-km"):
        raise ValueError(f"sparse_mla_attention: impl must be None, 'triton', 'gluon' or 'gluon-km', got {impl!r}")
    if impl == "gluon-km" and not 1 <= nh <= mla_gluon_km.KM_MAX_HEADS:
        raise ValueError(f"sparse_mla_attention: impl='gluon-km' takes 1 to {mla_gluon_km.KM_MAX_HEADS} heads, "
                         f"got {nh}")
    gluon_ok = impl != "triton" and mla_gluon.sparse_supported(q_latent, q_pe, kv_cache, topk_slots)
    if impl == "gluon-km" and not (gluon_ok and mla_gluon_km.km_supported(nh)):
        raise ValueError("sparse_mla_attention: impl='gluon-km' needs what impl='gluon' does: a compute-capability-9 "
                         "GPU, Triton's Gluon (no interpreter), 16-bit q and cache of one dtype, kv_lora_rank "
                         f"{mla_gluon.LORA} + rope {mla_gluon.ROPE} and 16-byte-aligned cache rows")
    choice = mla_gluon.resolve_impl("sparse_mla_attention", "gluon" if impl == "gluon-km" else impl, gluon_ok,
                                    (block_m, block_n, num_warps, num_stages) != (None,) * 4,
                                    "16-byte-aligned cache rows")
    if not use_triton(q_latent, q_pe, kv_cache):
        return sparse_mla_attention_ref(q_latent, q_pe, kv_cache, topk_slots, scale, k_scale)
    t, _, r = q_latent.shape
    rope = q_pe.shape[2]
    k = topk_slots.shape[1]
    if t == 0:
        return torch.empty_like(q_latent)
    if k == 0:
        return torch.zeros_like(q_latent)
    if choice in ("gluon", "auto"):  # any head count (H200, 16 heads: 0.065 / 0.192 ms vs Triton 0.072 / 0.196)
        # keys as the MMA's M for few heads (opt-in, not yet run on a GPU): one head block
        km = impl == "gluon-km" or (impl is None and mla_gluon_km.USE_KM and mla_gluon_km.km_supported(nh))
        gp = mla_gluon.sparse_plan(t, 1 if km else nh, k, num_sms(q_latent.device), num_splits)
        s = gp["num_splits"]
        out, part_acc, part_ml = split_outputs(q_latent, s, r)
        if km:
            mla_gluon_km.launch_sparse_km(q_latent, q_pe, kv_cache, topk_slots, out, part_acc, part_ml,
                                          float(scale) * _LOG2E, s)
        else:
            mla_gluon.launch_sparse(q_latent, q_pe, kv_cache, topk_slots, out, part_acc, part_ml,
                                    float(scale) * _LOG2E, gp["head_blocks"], s)
        _combine(out, part_acc, part_ml, s, r, False)
        return out
    plan = sparse_mla_attention_plan(t, nh, k, num_sms(q_latent.device), num_splits, block_m)
    s = plan["num_splits"]
    block_l = next_power_of_2(max(r, 32))  # two halves of >= 16 columns (the smallest tl.dot), as mla_attention
    # Triton's interpreter: bf16 tl.dot is wrong and fp32 -> bf16 truncates; as in mla_attention,
    # fp32 dots and rounding by integer ops there (compiled: native bf16 dots, fp32 accumulation).
    bf16_interp = interpreting() and q_latent.dtype == torch.bfloat16
    # fp8: the dense kernel's tile choice (FP8_BLOCK_N: shared memory of the 16-bit value copy)
    bn = (FP8_BLOCK_N.get(plan["block_m"], BLOCK_N) if is_fp8(kv_cache.dtype) else BLOCK_N) if block_n is None \
        else int(block_n)
    out, part_acc, part_ml = split_outputs(q_latent, s, block_l)
    _sparse_mla[(plan["head_blocks"], s, t)](
        q_latent, q_pe, kv_cache, topk_slots, out, part_acc, part_ml,
        float(scale) * _LOG2E, k, kv_cache.shape[0] * kv_cache.shape[1], s, float(k_scale),
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), topk_slots.stride(0), out.stride(0), out.stride(1), nh * s, s,
        NUM_HEADS=nh, LORA=r, ROPE=rope, BLOCK_L=block_l, BLOCK_R=next_power_of_2(max(rope, 16)),
        BLOCK_M=plan["block_m"], BLOCK_N=bn, SCAN_N=SCAN_N,
        CACHE_BLOCK=kv_cache.shape[1],
        SPLIT=s > 1, DOT_FP32=bf16_interp, PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        BF16_BY_BITS=bf16_interp, FP8=is_fp8(kv_cache.dtype),
        num_warps=plan["num_warps"] if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages)
    _combine(out, part_acc, part_ml, s, block_l, bf16_interp)
    return out


def _combine(out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, num_splits: int, block_l: int,
             bf16_interp: bool) -> None:
    """Merge the splits' partials into ``out`` (nothing to do for one split); every row is real."""
    if num_splits > 1:  # every row real: no query_start_loc (a one-element fill kernel a call, before)
        combine_splits(out, part_acc, part_ml, None, 0, num_splits, out.shape[2], block_l, bf16_interp)


__all__ = ["positions_to_slots", "sparse_mla_attention", "sparse_mla_attention_plan", "sparse_mla_attention_ref"]
