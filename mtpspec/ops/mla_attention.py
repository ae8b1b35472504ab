"""MLA attention over a paged latent KV cache (absorbed form), and the latent KV write; both
CUDA-graph safe.

Multi-head latent attention (DeepSeek-V2 paper, sec. 2.1; DeepSeek-V3 paper, sec. 2.1.1, eq. 1-11)
caches one entry per token: the post-norm latent ``c_kv`` (``kv_lora_rank`` values) and the
post-rope shared key ``k_pe`` (``qk_rope_head_dim`` values), side by side in one cache
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``. With ``kv_b_proj``'s key half
folded into the query (``q_latent = q_nope @ W_UK``) and its value half applied after attention,
every head attends the same latent "head": MQA with keys ``[c_kv | k_pe]`` and values ``c_kv``::

    o_latent[t, h] = softmax_k(scale * (q_latent[t, h] . c_kv[k] + q_pe[t, h] . k_pe[k])) @ c_kv

over each query's causal context. Layout of the varlen batch: that of
:mod:`mtpspec.ops.paged_attention` (sequence ``i`` owns rows ``query_start_loc[i] ..
query_start_loc[i + 1] - 1``; its query ``j`` sits at position ``seq_lens[i] - q_len_i + j`` and
attends cache positions ``0 ..`` that position; position ``p`` lives in block
``block_tables[i, p // block_size]`` at offset ``p % block_size``).

Kernel (decode and verification: ``1 + k`` query rows per sequence): one program per
``(block of BLOCK_M (query row, head) pairs, key split, sequence)``. A sequence's
``q_len * num_heads`` (row, head) pairs are flattened row-major, so a program's ``BLOCK_M``
matrix rows are several heads (of one or more query rows) and every latent tile it loads from
the cache (``[BLOCK_N, kv_lora_rank]`` + ``[BLOCK_N, rope]``, read once) serves all of them: the
scores are two ``tl.dot`` (latent part and rope part) and the same latent tile is the value
operand of ``p @ c_kv``. The block index varies fastest in the grid, so programs that share a
sequence's tiles run side by side (L2). Where a cache block holds whole key tiles (``block_size``
a multiple of ``BLOCK_N``: MLA models default to 64-token blocks) a GPU of compute capability
>= 9 reads the full tiles by bulk tensor copies (TMA, Triton tensor descriptors over the cache
viewed as ``[blocks * block_size, entry]``) and only a split's partial last tile through the
masked per-element path, so stale slots never reach ``p @ c_kv``. Online softmax in base 2 with fp32 statistics and
accumulator (FlashAttention-2, Dao 2023, Algorithm 1) plus the flash-decoding split over keys
(Dao, Haziza, Massa, Sizov 2023) whose partial ``(m, l, acc)`` are merged by the combine kernel of
:mod:`mtpspec.ops.paged_attention` (same scratch layout).

CUDA-graph safety: the grid, scratch shapes and every Python branch depend only on tensor shapes
and the host ints ``max_query_len`` / ``max_seq_len`` (upper bounds); lengths, slots and block
ids are read on the device. Programs past a sequence's rows exit at once (zero-length padding
sequences cost one load); rows past ``query_start_loc[num_seqs]`` come out as zeros;
:func:`write_mla_kv_cache` skips slot ``-1`` on the device.

FP8 latent caches (``torch.float8_e4m3fn``, one ``k_scale`` per layer, :mod:`mtpspec.ops.kv_quant`):
the write quantises (``x / k_scale``, saturating, nearest even); the attention converts each tile
to q's dtype unscaled (exact: E4M3 values are bf16 / fp16 values) and applies ``k_scale`` once per
program, not per element: to the fp32 scores (folded into the softmax scale, ``q . (s x) = s (q .
x)``) and to the fp32 accumulator before it is stored (the values are the same latent, ``p @ (s
x) = s (p @ x)``); i.e. the cache is read as ``float(x) * k_scale`` in fp32 (:func:`mla_attention_ref`).
Issue 19: with the earlier per-element dequantisation (fp8 -> fp32 ``* k_scale`` -> bf16) the fp8
decode ran at half the bf16 cache's speed on an H200; compiled for sm_90 (Triton 3.6) that
variant needed 190 KB of shared memory per 16-row program (two 16-bit copies of each latent half),
so one program per SM where bf16 runs two. Now 16- and 32-row tiles re-mask the converted value
operand (``_fp8_values``: one 16-bit copy read by ``ldmatrix.trans``, the keys read from the fp8
staging buffer) and 16-row tiles take ``FP8_BLOCK_N`` = 32 keys (70 KB);
``benchmarks/ptxas_spills.py`` prints registers, spills and shared memory per variant. Same on the
pointer path and on the bulk-copy (TMA) path (the descriptors carry the cache's 1-byte dtype). By
default fp8 caches take the pointer path (the bulk-copy variant timed slower on an H200,
BENCHMARKS.md); ``tma=True`` selects it.

Dispatch (docs/structures.md): Triton on CUDA tensors and on CPU tensors under
``TRITON_INTERPRET=1``; the torch references (``*_ref``, sync-free) otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from mtpspec.ops import mla_gluon
from mtpspec.ops.argmax import num_sms
from mtpspec.ops.kv_quant import check_cache_dtype, dequantize_cache, is_fp8, quantize_to_cache, raw
from mtpspec.ops.paged_attention import combine_splits
from mtpspec.ops.paged_common import (causal_probs, choose_num_splits, launchable_block_tables, padded_queries,
                                      padded_slots, scatter_padded_rows, split_outputs)
from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, cdiv, check_paged_metadata, check_tensor_args,
                                      device_function, interpreting, next_power_of_2, tl, use_triton)

#: (query row, head) pairs per program: matrix rows of the score tile (16 = smallest tl.dot tile).
BLOCK_M = 64
MIN_BLOCK_M = 16
#: Keys per inner-loop tile (may span several cache blocks on the pointer path; one block on the
#: bulk-copy path).
BLOCK_N = 64
#: ... with an fp8 cache, by ``block_m`` (else ``BLOCK_N``): 16-row tiles take 32 keys, so that the
#: fp8 staging buffers plus the 16-bit value copy (``_fp8_values``) stay under half of an H200
#: SM's shared memory (70 KB, Triton 3.6, vs 123 KB with 64 keys: one program per SM where bf16
#: runs two; ``benchmarks/ptxas_spills.py``). From sm_90 compiles on the CPU, not yet timed.
FP8_BLOCK_N = {16: 32}
#: Launch defaults by ``block_m``, from the H200 sweeps of 2026-12-02 (``bench_mla_attention.py
#: --sweep --block-size 64``, BENCHMARKS.md): 16-row tiles (16 heads x 1 query) are memory-bound
#: and fastest with 4 warps, per-element gathers and about 8 programs per SM (several in flight
#: hide the gather latency; 0.186 ms at 16 splits vs 0.198 at 10); 32- and 64-row tiles run the wgmma path with 8 warps, bulk-copy
#: tiles where eligible and at most one wave of programs (``floor(sms / work)`` splits: a second,
#: partial wave cost 20 to 25%).
NUM_WARPS = {16: 4, 32: 8, 64: 8}
USE_TMA = {16: False, 32: True, 64: True}  # where eligible (16 rows: 1.9x slower with bulk copies)
TARGET_PROGRAMS_PER_SM = {16: 8, 32: 1, 64: 1}
NUM_STAGES = 2
#: Flash-decoding split limits.
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------- checks

def _check_mla_inputs(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int) -> None:
    check_tensor_args("mla_attention", "q_latent", q_latent,
                      (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache),
                       ("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)))
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"mla_attention: q_latent must be [num_tokens, num_heads, kv_lora_rank] and q_pe "
                         f"[num_tokens, num_heads, rope], got {list(q_latent.shape)} and {list(q_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q_latent.shape[2] + q_pe.shape[2]:
        raise ValueError(f"mla_attention: kv_cache must be [num_blocks, block_size, kv_lora_rank + rope = "
                         f"{q_latent.shape[2] + q_pe.shape[2]}], got {list(kv_cache.shape)}")
    if q_latent.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q_pe.dtype != q_latent.dtype:
        raise TypeError(f"mla_attention: q_latent and q_pe must share one of float16/bfloat16/float32, "
                        f"got {q_latent.dtype}, {q_pe.dtype}")
    check_cache_dtype("mla_attention", q_latent.dtype, kv_cache)
    if q_latent.stride(2) != 1 or q_pe.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("mla_attention: q_latent, q_pe and kv_cache need unit stride in their last dimension")
    check_paged_metadata("mla_attention", query_start_loc, seq_lens, block_tables, max_query_len)


# ---------------------------------------------------------------- torch references

def mla_attention_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_query_len: int, max_seq_len: int, k_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`mla_attention` (same arguments and result; fp32 softmax and
    products, float64 for float64 inputs; an fp8 cache read as ``float(x) * k_scale`` in fp32, as
    the kernel applies it: unscaled tiles, ``k_scale`` on the fp32 scores and outputs).
    Sync-free: every sequence padded to ``max_query_len`` queries and ``max_seq_len`` keys (``max_seq_len`` must bound every ``seq_len``); memory
    ``O(num_seqs * max_query_len * num_heads * max_seq_len)`` plus the gathered latent context
    ``num_seqs * max_seq_len * (kv_lora_rank + rope)``."""
    t, nh, r = q_latent.shape
    d = kv_cache.shape[2]
    b = seq_lens.shape[0]
    bs = kv_cache.shape[1]
    dev = q_latent.device
    acc_dtype = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    if t == 0 or b == 0 or max_query_len == 0 or max_seq_len == 0:
        return torch.zeros(t, nh, r, dtype=q_latent.dtype, device=dev)
    q_lens, s_lens, j, rows, row_ok = padded_queries(query_start_loc, seq_lens, max_query_len, dev)
    q = torch.cat([q_latent, q_pe], dim=-1).to(acc_dtype)
    qp = q.index_select(0, torch.where(row_ok, rows, 0).reshape(-1)).view(b, max_query_len, nh, d)
    pos, key_ok, slots = padded_slots(block_tables, s_lens, max_seq_len, bs, kv_cache.shape[0], dev)
    kp = kv_cache.reshape(-1, d).index_select(0, slots.reshape(-1)).view(b, max_seq_len, d)
    kp = dequantize_cache(kp, acc_dtype, k_scale).to(acc_dtype)
    kp = torch.where(key_ok[:, :, None], kp, torch.zeros_like(kp))  # stale slots never reach p @ v
    s = torch.einsum("bqhd,bkd->bhqk", qp, kp) * scale
    p = causal_probs(s, q_lens, s_lens, j, pos, key_ok, row_ok)
    o = torch.einsum("bhqk,bkd->bqhd", p, kp[..., :r])
    return scatter_padded_rows(o, rows, row_ok, t, acc_dtype, q_latent.dtype)


def write_mla_kv_cache_ref(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: float = 1.0) -> None:
    """Torch version of :func:`write_mla_kv_cache` (fp8: :func:`~mtpspec.ops.kv_quant.quantize_to_cache`,
    bytes moved as uint8), sync-free: a row with slot ``-1`` is
    redirected to the first valid row's slot with that row's values (identical duplicates, so
    the result does not depend on write order); with no valid row, slot 0 gets its own content."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    d = kv_cache.shape[-1]
    flat = raw(kv_cache.view(-1, d))
    new = raw(quantize_to_cache(torch.cat([c_kv.reshape(n, -1), k_pe.reshape(n, -1)], dim=-1), kv_cache.dtype,
                                k_scale))
    slots = slot_mapping.long()
    valid = slots >= 0
    any_valid = valid.any().view(1)
    first = torch.argmax(valid.to(torch.int8)).view(1)
    idx = torch.where(valid, slots, torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first)))
    fb_val = torch.where(any_valid[:, None], new.index_select(0, first), flat[:1])
    flat.index_copy_(0, idx, torch.where(valid[:, None], new, fb_val))


# ---------------------------------------------------------------- kernels

try:  # Triton >= 3.4: host-side tensor descriptors (bulk tensor copies on Hopper)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton or none: the pointer path only
    TensorDescriptor = None

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import quant_fp8, round_to_dtype

    @device_function
    def _mla_tile(acc0, acc1, m_i, l_i, ql0, ql1, qp, k0, k1, kr, v0, v1, offs_n, n_ok, q_pos, row_ok, qk_scale,
                  PRECISION: tl.constexpr):
        """One key tile of the online softmax (base 2): the scores from the two latent halves and
        the rope part (``[BLOCK_M, BLOCK_N]``), then the same latent halves as the value operand
        (``v0``, ``v1``: ``k0``, ``k1`` or, for fp8 caches, :func:`_fp8_values` of them).
        Returns the updated ``(acc0, acc1, m_i, l_i)``."""
        s = tl.dot(ql0, tl.trans(k0), input_precision=PRECISION)
        s = tl.dot(ql1, tl.trans(k1), acc=s, input_precision=PRECISION)
        s = tl.dot(qp, tl.trans(kr), acc=s, input_precision=PRECISION)
        s = s * qk_scale
        ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(k0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, v0, input_precision=PRECISION)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=PRECISION)
        return acc0, acc1, m_new, l_i

    @device_function
    def _widen_fp8(x, q_dtype: tl.constexpr, DOT_FP32: tl.constexpr):
        """An E4M3 tile as dot operands: converted to ``q_dtype`` (fp32 under ``DOT_FP32``), exact
        (E4M3 values are fp16 / bf16 values) and not scaled: the kernels apply ``k_scale`` to the
        fp32 scores (folded into ``qk_scale``) and to the fp32 accumulator before it is stored
        (keys and values are the same latent), so the tile is never multiplied."""
        return x.to(tl.float32) if DOT_FP32 else x.to(q_dtype)

    @device_function
    def _fp8_values(k, n_ok, BLOCK_M: tl.constexpr):
        """The value operand made of an fp8 cache's converted latent half ``k`` (``[BLOCK_N, HALF]``).
        Tiles of fewer than 64 rows (``mma.sync`` dots, operands loaded into registers): ``k``
        re-masked on the keys ``n_ok`` (zero there already), a select that keeps Triton from moving
        the conversion behind the value operand's shared-memory load, where sm_90 has no
        transposing 8-bit ``ldmatrix`` (one byte-wide shared load per element otherwise): the tile
        is converted in registers and a 16-bit copy read by ``ldmatrix.trans``. 64-row tiles
        (``wgmma``, a 16-bit copy either way; the select's extra copy would pass the 227 KiB of
        shared memory of an sm_90 program): ``k``."""
        if BLOCK_M < 64:
            k = tl.where(n_ok[:, None], k, 0.0)
        return k

    @device_function
    def _masked_latent(kv_ptr, base, cols, col_ok, n_ok, q_dtype: tl.constexpr, FP8: tl.constexpr,
                       DOT_FP32: tl.constexpr):
        """``[BLOCK_N, len(cols)]`` cache values at ``kv_ptr + base[:, None] + cols[None, :]``,
        zero where the key (``n_ok``) or column (``col_ok``) is out of range; an fp8 cache's
        (``FP8``) converted unscaled (:func:`_widen_fp8`)."""
        x = tl.load(kv_ptr + base[:, None] + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            x = _widen_fp8(x, q_dtype, DOT_FP32)
        elif DOT_FP32:
            x = x.to(tl.float32)
        return x

    def _mla_attn_kernel(ql_ptr, qp_ptr, kv_ptr, kvl_desc, kvr_desc, out_ptr, part_acc_ptr, part_ml_ptr,
                         qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, num_splits, k_scale,
                         stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_kb, stride_ks,
                         stride_ot, stride_oh, stride_bt, stride_pt, stride_ph,
                         NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                         BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
                         WARP_SPECIALIZE: tl.constexpr, TAIL_STAGES: tl.constexpr,
                         DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                         FP8: tl.constexpr):
        # One program: (query row, head) pairs [rb * BLOCK_M, (rb + 1) * BLOCK_M) of sequence
        # `seq` (row-major over [q_len, NUM_HEADS]), key split `split`. Scores in base 2. The
        # latent is handled as two halves of HALF columns (a TMA box is at most 256 wide).
        HALF: tl.constexpr = BLOCK_L // 2
        rb = tl.program_id(0)
        split = tl.program_id(1)
        seq = tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
        if rb * BLOCK_M >= q_len * NUM_HEADS:  # past this sequence's rows (padding sequences: all)
            return
        ctx = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
        pair = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = pair // NUM_HEADS
        head = pair % NUM_HEADS
        row_ok = tok < q_len
        q_pos = ctx + tok
        row = (q_start + tok).to(tl.int64)
        offs_h = tl.arange(0, HALF)
        h0_ok = offs_h < LORA
        h1_ok = offs_h + HALF < LORA
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < ROPE
        ql_rows = ql_ptr + row[:, None] * stride_qlt + head[:, None] * stride_qlh
        ql0 = tl.load(ql_rows + offs_h[None, :], mask=row_ok[:, None] & h0_ok[None, :], other=0.0)
        ql1 = tl.load(ql_rows + HALF + offs_h[None, :], mask=row_ok[:, None] & h1_ok[None, :], other=0.0)
        qp = tl.load(qp_ptr + row[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_FP32:
            ql0 = ql0.to(tl.float32)
            ql1 = ql1.to(tl.float32)
            qp = qp.to(tl.float32)
        # Keys this block needs: 0 .. ctx + its last query row; this split's share of them.
        n_keys = ctx + tl.minimum(q_len, ((rb + 1) * BLOCK_M - 1) // NUM_HEADS + 1)
        chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        k_hi = tl.minimum(k_lo + chunk, n_keys)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        if FP8:  # tiles stay unscaled (_widen_fp8): q . (k_scale x) = k_scale (q . x); acc likewise, below
            qk_scale = qk_scale * k_scale
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        if TMA:
            # Whole tiles lie in one cache block (CACHE_BLOCK % BLOCK_N == 0): one bulk tensor copy per
            # part, unmasked (stale slots past k_hi only occur in the last, partial tile, below).
            k_full = k_lo + (k_hi - k_lo) // BLOCK_N * BLOCK_N
            for start in tl.range(k_lo, k_full, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                offs_n = start + tl.arange(0, BLOCK_N)
                blk = tl.load(bt_row + start // CACHE_BLOCK).to(tl.int32)
                r0 = blk * CACHE_BLOCK + start % CACHE_BLOCK
                k0 = kvl_desc.load([r0, 0])
                k1 = kvl_desc.load([r0, HALF])
                kr = kvr_desc.load([r0, LORA])
                if FP8:
                    q_ty = ql_ptr.dtype.element_ty
                    k0 = _widen_fp8(k0, q_ty, DOT_FP32)
                    k1 = _widen_fp8(k1, q_ty, DOT_FP32)
                    kr = _widen_fp8(kr, q_ty, DOT_FP32)
                if DOT_FP32:
                    k0, k1, kr = k0.to(tl.float32), k1.to(tl.float32), kr.to(tl.float32)
                n_ok = offs_n < k_hi
                v0, v1 = k0, k1
                if FP8:
                    v0, v1 = _fp8_values(k0, n_ok, BLOCK_M), _fp8_values(k1, n_ok, BLOCK_M)
                acc0, acc1, m_i, l_i = _mla_tile(acc0, acc1, m_i, l_i, ql0, ql1, qp, k0, k1, kr, v0, v1, offs_n,
                                                 n_ok, q_pos, row_ok, qk_scale, PRECISION)
            k_lo = k_full
        for start in tl.range(k_lo, k_hi, BLOCK_N, num_stages=TAIL_STAGES):  # pointer path (TMA: last tile)
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_hi
            blk = tl.load(bt_row + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
            base = blk * stride_kb + (offs_n % CACHE_BLOCK) * stride_ks
            q_dtype = ql_ptr.dtype.element_ty
            k0 = _masked_latent(kv_ptr, base, offs_h, h0_ok, n_ok, q_dtype, FP8, DOT_FP32)
            k1 = _masked_latent(kv_ptr, base + HALF, offs_h, h1_ok, n_ok, q_dtype, FP8, DOT_FP32)
            kr = _masked_latent(kv_ptr, base + LORA, offs_r, r_ok, n_ok, q_dtype, FP8, DOT_FP32)
            v0, v1 = k0, k1
            if FP8:
                v0, v1 = _fp8_values(k0, n_ok, BLOCK_M), _fp8_values(k1, n_ok, BLOCK_M)
            acc0, acc1, m_i, l_i = _mla_tile(acc0, acc1, m_i, l_i, ql0, ql1, qp, k0, k1, kr, v0, v1, offs_n, n_ok,
                                             q_pos, row_ok, qk_scale, PRECISION)
        if FP8:  # p @ (k_scale x) = k_scale (p @ x)
            acc0 = acc0 * k_scale
            acc1 = acc1 * k_scale
        if SPLIT:
            pbase = row * stride_pt + head * stride_ph + split
            tl.store(part_ml_ptr + 2 * pbase, m_i, mask=row_ok)
            tl.store(part_ml_ptr + 2 * pbase + 1, l_i, mask=row_ok)
            acc_rows = part_acc_ptr + pbase[:, None] * BLOCK_L
            tl.store(acc_rows + offs_h[None, :], acc0, mask=row_ok[:, None])
            tl.store(acc_rows + HALF + offs_h[None, :], acc1, mask=row_ok[:, None])
        else:
            denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_rows = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh
            o0 = round_to_dtype(acc0 / denom, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_rows + offs_h[None, :], o0, mask=row_ok[:, None] & h0_ok[None, :])
            o1 = round_to_dtype(acc1 / denom, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_rows + HALF + offs_h[None, :], o1, mask=row_ok[:, None] & h1_ok[None, :])

    def _write_mla_kv_kernel(ckv_ptr, kpe_ptr, cache_ptr, slot_ptr, k_scale, stride_ct, stride_pt, stride_cb,
                             stride_cs, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
                             BLOCK_R: tl.constexpr, CACHE_BLOCK: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                             FP8: tl.constexpr, FP8_BY_BITS: tl.constexpr):
        # One program per row: [c_kv | k_pe] to its slot's LORA + ROPE values; slot < 0: skip.
        # (values pass through fp32: exact for fp16/bf16 inputs, one rounding for fp32 inputs)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        live = (slot >= 0).to(tl.int32)
        dst = cache_ptr + (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
        offs_l = tl.arange(0, BLOCK_L)
        ok_l = offs_l < LORA * live
        x = tl.load(ckv_ptr + t * stride_ct + offs_l, mask=ok_l).to(tl.float32)
        offs_r = tl.arange(0, BLOCK_R)
        ok_r = offs_r < ROPE * live
        y = tl.load(kpe_ptr + t * stride_pt + offs_r, mask=ok_r).to(tl.float32)
        if FP8:  # quantised with the layer's k_scale (saturating, nearest even)
            x_low = quant_fp8(x, k_scale, FP8_BY_BITS)
            y_low = quant_fp8(y, k_scale, FP8_BY_BITS)
        else:
            x_low = round_to_dtype(x, cache_ptr.dtype.element_ty, BF16_BY_BITS)
            y_low = round_to_dtype(y, cache_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(dst + offs_l, x_low, mask=ok_l)
        tl.store(dst + LORA + offs_r, y_low, mask=ok_r)

    _mla_attn = LazyKernel(_mla_attn_kernel)
    _write_mla_kv = LazyKernel(_write_mla_kv_kernel)


# ---------------------------------------------------------------- launch planning

def mla_attention_plan(num_seqs: int, max_query_len: int, num_heads: int, max_seq_len: int, sms: int,
                       num_splits: Optional[int] = None, block_m: Optional[int] = None) -> dict:
    """Launch shape of :func:`mla_attention` from static sizes only (CUDA-graph safe).

    Returns ``dict(block_m, row_blocks, num_splits, num_warps, tma)``: ``block_m`` (query row, head)
    pairs per program = ``BLOCK_M`` (or the given one) clipped to ``[MIN_BLOCK_M, next power of
    two of max_query_len * num_heads]``; ``row_blocks = ceil(max_query_len * num_heads /
    block_m)``; ``num_splits`` unless given = ``min(T * sms // work, ceil(max_seq_len /
    MIN_KEYS_PER_SPLIT), MAX_SPLITS)``, at least 1, with ``work = num_seqs * row_blocks`` and
    ``T = TARGET_PROGRAMS_PER_SM[block_m]``; ``num_warps = NUM_WARPS[block_m]``; ``tma`` =
    ``USE_TMA[block_m]`` (bulk-copy key tiles where :func:`tma_eligible`).

    Raises:
        ValueError: ``block_m`` not a power of two >= ``MIN_BLOCK_M``; ``num_splits`` < 1.
    """
    pairs = max(1, max_query_len * num_heads)
    block_m = BLOCK_M if block_m is None else int(block_m)
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK_M}, got {block_m}")
    block_m = max(MIN_BLOCK_M, min(block_m, next_power_of_2(pairs)))
    row_blocks = cdiv(pairs, block_m)
    if num_splits is None:
        work = max(1, num_seqs * row_blocks)
        num_splits = max(1, min(TARGET_PROGRAMS_PER_SM.get(block_m, 1) * sms // work,
                                cdiv(max(1, max_seq_len), MIN_KEYS_PER_SPLIT), MAX_SPLITS))
    num_splits = choose_num_splits(num_splits, 0, sms, max_seq_len, 1, MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return dict(block_m=block_m, row_blocks=row_blocks, num_splits=num_splits,
                num_warps=NUM_WARPS.get(block_m, 8), tma=USE_TMA.get(block_m, True))


def tma_eligible(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_n: int) -> bool:
    """Whether :func:`mla_attention` can read key tiles by bulk tensor copies: Triton tensor
    descriptors available; a 16-bit, contiguous ``kv_cache`` (16-byte aligned) whose
    ``block_size`` is a multiple of ``block_n`` (a tile never spans two cache blocks); and
    ``kv_lora_rank / 2`` and ``rope`` powers of two of at most 256 (one copy box each). An fp8
    (e4m3) cache is eligible too (tiles converted after the copy)."""
    r, rope = q_latent.shape[2], kv_cache.shape[2] - q_latent.shape[2]
    half = r // 2
    return (TensorDescriptor is not None and (kv_cache.dtype in (torch.float16, torch.bfloat16) or is_fp8(kv_cache.dtype))
            and kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0 and kv_cache.shape[1] % block_n == 0
            and r % 2 == 0 and 16 <= half <= 256 and half & (half - 1) == 0
            and 16 <= rope <= 256 and rope & (rope - 1) == 0)


def write_warps(kv_lora_rank: int) -> int:
    """Warps of the KV-write program: 8 latent values (16 bytes of bf16) per thread, 1 to 4 warps."""
    return max(1, min(4, next_power_of_2(kv_lora_rank) // 256))


# ---------------------------------------------------------------- public ops

def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  scale: float, max_query_len: int, max_seq_len: int, num_splits: Optional[int] = None,
                  block_m: Optional[int] = None, block_n: Optional[int] = None,
                  num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                  tma: Optional[bool] = None, warp_specialize: bool = False, k_scale: float = 1.0,
                  impl: Optional[str] = None) -> torch.Tensor:
    """Absorbed MLA attention of a flattened varlen batch against a paged latent cache.

    Args:
        q_latent: ``[num_tokens, num_heads, kv_lora_rank]`` fp16/bf16/fp32 (``q_nope`` folded
            through ``kv_b_proj``'s key half); q_pe: ``[num_tokens, num_heads, rope]`` (rope
            applied); unit stride in the last dimension, rows / heads may be strided.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]`` of q's dtype or
            ``torch.float8_e4m3fn`` (read as ``float(x) * k_scale``: unscaled tiles, the scale
            on the fp32 scores and outputs; pointer path unless ``tma=True``),
            already holding this step's entries (:func:`write_mla_kv_cache`).
        query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len: as
            :func:`mtpspec.ops.paged_attention.paged_attention`.
        scale: softmax scale (the qk head dim's ``** -0.5``, times YaRN's mscale squared where used).
        num_splits, block_m, block_n, num_warps, num_stages: launch overrides (tuning; default
            :func:`mla_attention_plan` and the module constants).
        tma: read whole key tiles with bulk tensor copies (Hopper's TMA, through Triton tensor
            descriptors) instead of per-element gathers; ``None`` = the plan's choice where
            :func:`tma_eligible` on a GPU of compute capability >= 9. ``True`` where not eligible raises ValueError.
        warp_specialize: Triton's automatic warp specialization of the bulk-copy loop (tuning).
        k_scale: an fp8 cache's per-layer scale (ignored for other caches).
        impl: ``"gluon"``: the warp-specialised Hopper kernel of :mod:`mtpspec.ops.mla_gluon` (64-pair
            programs; ValueError where not :func:`~mtpspec.ops.mla_gluon.supported`); ``"triton"``:
            this module's kernel; ``None``: the Gluon kernel where it is supported (any head and row
            count: fewer than 64 pairs pad one program, :func:`~mtpspec.ops.mla_gluon.dense_plan`), no
            launch override is given and ``MTPSPEC_MLA_GLUON`` is not ``0``.

    Returns:
        ``o_latent [num_tokens, num_heads, kv_lora_rank]`` in q's dtype; rows at or past
        ``query_start_loc[num_seqs]`` are zeros.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, strides or devices (named in the message).

    Triton kernel on CUDA (and CPU under ``TRITON_INTERPRET=1``), else :func:`mla_attention_ref`.
    No host sync, CUDA-graph capturable.
    """
    _check_mla_inputs(q_latent, q_pe, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len)
    overrides = (block_m, block_n, num_warps, num_stages, tma) != (None,) * 5 or warp_specialize
    choice = mla_gluon.resolve_impl("mla_attention", impl,
                                    impl != "triton" and mla_gluon.supported(q_latent, q_pe, kv_cache), overrides,
                                    "a contiguous, 16-byte-aligned cache whose block_size is a multiple of "
                                    f"{mla_gluon.BLOCK_N}")
    if not use_triton(q_latent, q_pe, kv_cache):
        return mla_attention_ref(q_latent, q_pe, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                 max_query_len, max_seq_len, k_scale)
    t, nh, r = q_latent.shape
    rope = q_pe.shape[2]
    b = seq_lens.shape[0]
    bs = kv_cache.shape[1]
    # the Gluon kernel wherever it runs (its 64-pair programs, padded below 64 pairs: 16 heads x 1 row
    # is memory-bound, so the padding costs only tensor-core time)
    gluon = choice in ("gluon", "auto")
    plan = (mla_gluon.dense_plan(b, max_query_len, nh, max_seq_len, num_sms(q_latent.device), num_splits) if gluon
            else mla_attention_plan(b, max_query_len, nh, max_seq_len, num_sms(q_latent.device), num_splits, block_m))
    s = plan["num_splits"]
    block_l = next_power_of_2(max(r, 32))  # two halves of >= 16 columns (the smallest tl.dot)
    block_r = next_power_of_2(max(rope, 16))
    # keys per tile of the Triton kernel (the Gluon plan has no block_m: its tiles are mla_gluon.BLOCK_N)
    bn = None if gluon else (FP8_BLOCK_N.get(plan["block_m"], BLOCK_N) if is_fp8(kv_cache.dtype) else BLOCK_N) \
        if block_n is None else int(block_n)
    eligible = not gluon and tma_eligible(q_latent, kv_cache, bn)
    if tma and not eligible:  # (impl="gluon" with tma was refused above)
        raise ValueError(f"mla_attention: tma=True needs a contiguous 16-bit or fp8 kv_cache whose block_size "
                         f"({bs}) is a multiple of block_n ({bn}), power-of-two kv_lora_rank / 2 and rope <= 256, "
                         f"and Triton tensor descriptors")
    # fp8 caches default to the pointer path: on an H200 the fp8 bulk-copy variant timed slower
    # (BENCHMARKS.md, 2026-12-02); tma=True still selects it
    use_tma = eligible and (tma if tma is not None else (plan["tma"] and not is_fp8(kv_cache.dtype) and
                                                         q_latent.is_cuda and
                                                         torch.cuda.get_device_capability(q_latent.device)[0] >= 9))
    # Triton's interpreter: bf16 tl.dot is wrong and fp32 -> bf16 truncates; run the dots in
    # fp32 and round by integer ops there (compiled: native bf16 dots, fp32 accumulation).
    bf16_interp = interpreting() and q_latent.dtype == torch.bfloat16
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    if t == 0:
        return torch.empty_like(q_latent)
    if b == 0 or max_query_len == 0:
        return torch.zeros_like(q_latent)
    out, part_acc, part_ml = split_outputs(q_latent, s, block_l)
    block_tables = launchable_block_tables(block_tables, b)
    if gluon:
        mla_gluon.launch(q_latent, q_pe, kv_cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables,
                         float(scale) * _LOG2E, plan["row_blocks"], s)
    else:
        stages = NUM_STAGES if num_stages is None else int(num_stages)
        kvl_desc = kvr_desc = None
        if use_tma:
            flat = kv_cache.view(-1, kv_cache.shape[2])
            kvl_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [bn, block_l // 2])
            kvr_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [bn, block_r])
        _mla_attn[(plan["row_blocks"], s, b)](
            q_latent, q_pe, kv_cache, kvl_desc, kvr_desc, out, part_acc, part_ml, query_start_loc, seq_lens,
            block_tables, float(scale) * _LOG2E, s, float(k_scale), q_latent.stride(0), q_latent.stride(1),
            q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), nh * s, s,
            NUM_HEADS=nh, LORA=r, ROPE=rope, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_M=plan["block_m"], BLOCK_N=bn,
            CACHE_BLOCK=bs, SPLIT=s > 1, TMA=use_tma, WARP_SPECIALIZE=bool(warp_specialize),
            TAIL_STAGES=1 if use_tma else stages, DOT_FP32=bf16_interp, PRECISION=precision,
            BF16_BY_BITS=bf16_interp, FP8=is_fp8(kv_cache.dtype),
            num_warps=plan["num_warps"] if num_warps is None else num_warps, num_stages=stages)
    if s > 1:
        combine_splits(out, part_acc, part_ml, query_start_loc, b, s, r, block_l, bf16_interp)
    return out


def write_mla_kv_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0) -> None:
    """Write each row's ``[c_kv | k_pe]`` to its paged latent-cache slot; negative slots skipped.

    Args:
        c_kv: ``[n, kv_lora_rank]``; k_pe: ``[n, rope]`` (or ``[n, 1, rope]``); any float dtype
            (cast to the cache's); unit stride in the last dimension, rows may be strided.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``, unit stride in the last dim.
        slot_mapping: ``[n]`` int32/int64, ``block * block_size + offset`` or ``-1`` (skip).
        k_scale: an fp8 cache's scale: stored ``e4m3(clamp(x / k_scale, +-448))`` (nearest even).

    Real slots must be distinct (or carry identical data). No host sync, CUDA-graph capturable:
    Triton kernel (one program per row) on CUDA / under ``TRITON_INTERPRET=1``, else
    :func:`write_mla_kv_cache_ref`.

    Raises:
        ValueError: mismatched shapes or strides.
    """
    n = slot_mapping.shape[0]
    if kv_cache.dim() != 3 or c_kv.shape[0] != n or k_pe.shape[0] != n:
        raise ValueError(f"write_mla_kv_cache: {n} slots, c_kv {list(c_kv.shape)}, k_pe {list(k_pe.shape)}, cache "
                         f"{list(kv_cache.shape)} do not fit together")
    c2, p2 = c_kv.reshape(n, -1), k_pe.reshape(n, -1)
    r, rope = c2.shape[1], p2.shape[1]
    if r + rope != kv_cache.shape[2]:
        raise ValueError(f"write_mla_kv_cache: kv_lora_rank {r} + rope {rope} != cache entry {kv_cache.shape[2]}")
    if n == 0:
        return
    if not use_triton(kv_cache, c2, p2):
        write_mla_kv_cache_ref(c2, p2, kv_cache, slot_mapping, k_scale)
        return
    if (r > 1 and c2.stride(1) != 1) or (rope > 1 and p2.stride(1) != 1) or kv_cache.stride(2) != 1:
        raise ValueError(f"write_mla_kv_cache: need unit stride in the last dimension, got c_kv {tuple(c2.stride())}, "
                         f"k_pe {tuple(p2.stride())}, cache {tuple(kv_cache.stride())}")
    fp8 = is_fp8(kv_cache.dtype)
    _write_mla_kv[(n,)](c2, p2, kv_cache, slot_mapping, float(k_scale), c2.stride(0), p2.stride(0), kv_cache.stride(0),
                        kv_cache.stride(1), LORA=r, ROPE=rope, BLOCK_L=next_power_of_2(r),
                        BLOCK_R=next_power_of_2(rope), CACHE_BLOCK=kv_cache.shape[1],
                        BF16_BY_BITS=interpreting() and kv_cache.dtype == torch.bfloat16,
                        FP8=fp8, FP8_BY_BITS=fp8 and interpreting(), num_warps=write_warps(r))


__all__ = ["mla_attention", "mla_attention_plan", "mla_attention_ref", "tma_eligible", "write_mla_kv_cache",
           "write_mla_kv_cache_ref"]
