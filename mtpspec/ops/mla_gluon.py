"""MLA attention on Hopper (sm_90): warp-specialised Gluon kernels, dense (decode / verify) and sparse (DSA).

Same operation, arguments and split-K scratch as :func:`mtpspec.ops.mla_attention.mla_attention`
(absorbed MLA over the paged latent cache: keys ``[c_kv | k_pe]``, values ``c_kv``; DeepSeek-V3
paper, sec. 2.1.1), for 64 (query row, head) pairs per program. Issue 14: the Triton kernel's
64-row programs load a key tile and then run its products one after the other (4.5 us per 64-key
tile at 16 heads x 4 rows: the sum of the copy time and the tensor-core time), and Triton 3.6 does
not warp-specialise that loop. Here the roles are split the way FlashMLA splits them (DeepSeek,
2025; facts only, own code), in three partitions of one program:

* a 1-warp **producer** reads the block table and issues the bulk tensor copies (TMA) of each
  ``BLOCK_N``-key tile (latent halves ``[BLOCK_N, 256]`` x 2 and rope ``[BLOCK_N, 64]``) into a
  ring of ``STAGES`` shared-memory slots, each with an mbarrier that completes on the bytes, and
  refills a slot once both warpgroups are done with it;
* **warpgroup 0** (the default partition) computes the scores ``S = Q K^T`` (``wgmma``, the
  query's latent halves and rope part resident in shared memory, each key tile read transposed
  in place), the causal mask and the online softmax (FlashAttention-2, Dao 2023, Alg. 1, base 2),
  writes ``P`` (bf16) and the rescale factor ``alpha`` of each row to shared memory for the
  other warpgroup (``P_BUFS`` buffers), and accumulates the left 256 value columns ``O_L = alpha
  O_L + P V_L``;
* **warpgroup 1** waits for each ``P``, accumulates the right 256 columns ``O_R = alpha O_R +
  P V_R`` from the same key tile (the latent is both key and value), and frees the slot.

So the copies of the next tiles run under the products of this one, and the 64 x 512 fp32 output
accumulator is split across two warpgroups (128 registers a thread each). A tile that ends before
``BLOCK_N`` (the last of a split) is zeroed past its end in shared memory by warpgroup 0 before
any product reads it, so stale cache slots never reach ``P V``. Split-K over keys (flash-decoding)
writes ``(acc, m, l)`` in the scratch layout of :func:`mtpspec.ops.paged_attention.combine_splits`.

A second dense schedule, ``"seesaw"`` (:data:`DENSE_SCHEDULE`; FlashMLA's, facts only), takes the
key tiles in pairs: warpgroup 0 computes the scores and softmax of the first, warpgroup 1 of the
second against the first's row max, so one softmax runs under the other warpgroup's products; each
warpgroup accumulates its value half over both tiles (its own ``P`` from registers, the other's
from shared memory) and refills the key halves it read last (no producer partition); ``"seesaw-r1"``
orders each pair as FlashMLA does (one rescale of warpgroup 1's half of O a pair, not two).
A third, ``"split-pv"``, keeps the split schedule's warpgroups and lags warpgroup 0's value half one
tile (FlashAttention-3's intra-warpgroup overlap): tile i's softmax runs while tile i - 1's left value
product does, each tile's left latent half released apart from its right half + rope.
Both schedules mask only the tiles that reach past the row block's first query position or the
split's end (FlashMLA masks its last tiles only) and fold the softmax scale into the exponent's
FMA, the running max kept in raw score units (scaled once, where ``m`` is stored).

Sparse MLA (DeepSeek Sparse Attention, DeepSeek-V3.2 paper, sec. 2.1; the operation of
:func:`mtpspec.ops.sparse_mla_attention.sparse_mla_attention`): the same two warpgroups over 64
heads of one token row and its selected cache slots, the selection as the mask; Hopper's bulk
copies cannot gather scattered rows, so a 4-warp producer gathers each tile's rows with 16-byte
``cp.async`` (unused entries, ``-1`` or past the cache, zero-filled: no stale row reaches ``P V``)
and completes the tile's barrier once its copies have landed (``SPARSE_*`` launch shape).

Limits (``supported`` / ``sparse_supported``): CUDA device of compute capability 9.x, Triton with
Gluon's Hopper API (3.6), not under ``TRITON_INTERPRET``, 16-bit queries and cache (same dtype),
``kv_lora_rank`` 512 and rope 64 (DeepSeek-V3 / GLM-5 sizes); dense: a contiguous, 16-byte-aligned
cache whose ``block_size`` is a multiple of ``BLOCK_N``; sparse: 16-byte-aligned cache rows.
Everything else, and the CPU (no Gluon interpreter), takes the Triton kernel or the torch
reference, which the tests compare these kernels against on the GPU.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mtpspec.ops.triton_utils import interpreting

try:  # Triton >= 3.6 with Gluon's Hopper API; checked against 3.6.0 (the device's)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    # the copies into shared memory: `async_copy_global_to_shared` in 3.6, `async_load` in later releases
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _cp_arrive = cp.mbarrier_arrive  # cp.async.mbarrier.arrive: on the barrier once this thread's copies land
    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton, or none
    HAS_GLUON = False

#: Keys per tile, key-tile ring slots and P buffers (dense): 2 x 72 KiB of 64-key tiles + 72 KiB of
#: query + one 8 KiB P tile + ~1 KiB of statistics and barriers = 225 KiB of an sm_90 program's 227
#: KiB. From an H200 sweep (2026-12-04, BENCHMARKS.md): 64-key tiles (n = 64 score products, half
#: the query re-reads per key of n = 32) beat 32-key tiles with 3 or 4 slots by 14-27%.
BLOCK_N = 64
STAGES = 2
P_BUFS = 1
BLOCK_M = 64
LORA = 512
ROPE = 64
HALF = LORA // 2
#: Registers a thread of the worker partitions: warpgroup 1 (its 64 x 256 fp32 accumulator) and the
#: producer (dense: 1 TMA warp; ``SPARSE_*``: the 4-warp gathering warpgroup); warpgroup 0 gets the rest
#: of the 64 K (ptxas compiles each partition to its count: sparse with 192 / 40 spilled 316 bytes).
WG1_REGS = 192
PRODUCER_REGS = 40
SPARSE_WG1_REGS = 168
SPARSE_PRODUCER_REGS = 112
#: Dense schedule: ``"split"`` (:func:`_mla_ws_kernel`: warpgroup 0 computes every tile's scores and
#: softmax) or ``"seesaw"`` (:func:`_mla_seesaw_kernel`: the warpgroups alternate the tiles' scores
#: and softmax; no producer partition, each warpgroup issues the copies of the key halves it read
#: last, so its 8 warps get 256 registers a thread). H200, 64 x 8,192 (2026-12-04, BENCHMARKS.md):
#: the seesaw is 4-10% slower over scattered cache blocks (its refills start later, two slots only)
#: and 2-4% faster where the keys sit in L2, so ``"split"`` is the default
#: (``MTPSPEC_MLA_SCHEDULE=seesaw`` selects the other). ``"seesaw-r1"``: the seesaw in FlashMLA's
#: order within a pair (warpgroup 1's softmax of B first, ``P_A`` stored by warpgroup 0 at B's max,
#: warpgroup 1's half of O rescaled once a pair instead of twice; compiled for sm_90, not yet run on
#: a GPU: it takes 128 FMULs a pair off warpgroup 1 but queues ``P_A V_R(A)`` behind B's softmax,
#: where ``"seesaw"`` runs it under that softmax).
#: ``"split-pv"``: the split schedule with warpgroup 0's value product one tile behind, under the next
#: tile's softmax (session 42's profile: the split kernel's tensor cores idle through each softmax);
#: H100, 64 x 8,192 (2026-12-07, BENCHMARKS.md): 5% faster than ``"split"`` at 128 heads x 4 (HBM and
#: L2), 4% slower at 128 x 1 from HBM (its left half's refill starts a softmax later), 6% faster there
#: from L2. ``"auto"`` takes ``"split-pv"`` from :data:`PV_ROW_BLOCKS` row blocks a sequence on (the
#: compute-bound shapes), ``"split"`` below; opt-in until split-pv's GPU tests are seen to pass (the
#: session-43 run's test summary was lost from its output; its outputs matched the reference at
#: 128 x 1 and 128 x 4, full tiles only).
DENSE_SCHEDULE = os.environ.get("MTPSPEC_MLA_SCHEDULE", "split")
PV_ROW_BLOCKS = 4
#: Dense (split / split-pv): the producer's L2 prefetch distance in key tiles (0: none). Built blind
#: (session 43): the split-pv schedule's left latent half is refilled one softmax before its scores
#: read it, so from HBM the copy's latency shows (4% slower than split at 128 x 1 on an H100, 6%
#: faster with the keys in L2); a bulk L2 prefetch of tile i + L2_AHEAD, issued after tile i's copies, hides it.
L2_AHEAD = int(os.environ.get("MTPSPEC_MLA_L2_AHEAD", "0"))
SEESAW_WG1_REGS = 256
#: Sparse launch shape (H200 sweeps, 2026-12-04, BENCHMARKS.md): 64-key tiles in 2 slots with one P
#: buffer (224 KiB, the dense shape), the gathering threads' copies completing each tile's barrier
#: as they land (``ahead`` 0) and the selection's ids loaded before the waits they would otherwise
#: follow: 128 x 1 / 128 x 4 0.104 / 0.387 ms against 0.119 / 0.455 for session 17's 32-key tiles in 4
#: slots with the producer waiting one tile behind (``ahead`` 1; 2 and 3 were slower still).
SPARSE_BLOCK_N = 64
SPARSE_STAGES = 2
SPARSE_P_BUFS = 1
#: Sparse: ``0`` = the copies arrive on the tile's barrier themselves (``cp.async.mbarrier.arrive``);
#: ``k`` >= 1 = the producer waits for the tile ``k`` behind the one it issued (see :func:`launch_sparse`).
SPARSE_AHEAD = 0


#: The Gluon kernels are the default where they apply (``mla_attention`` / ``sparse_mla_attention``
#: with ``impl=None``) unless ``MTPSPEC_MLA_GLUON=0``.
USE_GLUON = os.environ.get("MTPSPEC_MLA_GLUON", "1") != "0"


def _hopper_latent(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """What both kernels need: Gluon's Hopper API (compiled, not under ``TRITON_INTERPRET``), CUDA
    tensors on a compute-capability-9 GPU, 16-bit q / q_pe / cache of one dtype, ``kv_lora_rank``
    512 + rope 64, cache rows 16-byte aligned."""
    if not (HAS_GLUON and q_latent.is_cuda and kv_cache.is_cuda) or interpreting():  # Gluon: no interpreter
        return False
    if torch.cuda.get_device_capability(q_latent.device)[0] != 9:
        return False
    es = kv_cache.element_size()
    return (q_latent.dtype in (torch.float16, torch.bfloat16) and kv_cache.dtype == q_latent.dtype
            and q_pe.dtype == q_latent.dtype and q_latent.shape[2] == LORA and q_pe.shape[2] == ROPE
            and kv_cache.shape[2] == LORA + ROPE and kv_cache.stride(2) == 1 and kv_cache.data_ptr() % 16 == 0
            and (kv_cache.stride(0) * es) % 16 == 0 and (kv_cache.stride(1) * es) % 16 == 0)


def supported(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`launch` can run these tensors (see the module docstring): as the sparse
    kernel, plus a contiguous cache whose ``block_size`` is a multiple of ``BLOCK_N`` (a bulk-copied
    tile never spans two cache blocks)."""
    return _hopper_latent(q_latent, q_pe, kv_cache) and kv_cache.shape[1] % BLOCK_N == 0 and kv_cache.is_contiguous()


def resolve_impl(op: str, impl: Optional[str], ok: bool, overrides: bool, needs: str) -> str:
    """``"gluon"`` (asked for, and it can run), ``"triton"`` (asked for, not runnable here, Triton
    kernel tuning given, or ``MTPSPEC_MLA_GLUON=0``) or ``"auto"`` (Gluon where the op's plan
    prefers it) for an op's ``impl`` argument; ``ok``: the tensors are :func:`supported` (or
    :func:`sparse_supported`); ``overrides``: Triton-kernel launch overrides were given; ``needs``:
    what the Gluon kernel needs, for the error.

    Raises:
        ValueError: ``impl`` not ``None`` / ``"triton"`` / ``"gluon"``; ``"gluon"`` where ``ok`` is
            false, or with ``overrides``.
    """
    if impl not in (None, "triton", "gluon"):
        raise ValueError(f"{op}: impl must be None, 'triton' or 'gluon', got {impl!r}")
    if impl == "gluon":
        if not ok:
            raise ValueError(f"{op}: impl='gluon' needs a compute-capability-9 GPU, Triton's Gluon (no interpreter), "
                             f"16-bit q and cache of one dtype, kv_lora_rank {LORA} + rope {ROPE} and {needs}")
        if overrides:
            raise ValueError(f"{op}: block_m, block_n, num_warps, num_stages, tma and warp_specialize tune the Triton "
                             "kernel; impl='gluon' takes none of them")
        return "gluon"
    return "auto" if impl is None and ok and USE_GLUON and not overrides else "triton"


if HAS_GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(n):
        """The accumulator layout of one warpgroup's ``m64 n{n}`` wgmma (a ``[64, n]`` fp32 tile)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _tile_row(bt_row, start, CACHE_BLOCK: gl.constexpr):
        """The flat cache row of dense key ``start`` (through the sequence's block table row ``bt_row``),
        int32: TMA coordinates are 32-bit (int64 tables too)."""
        blk = gl.load(bt_row + start // CACHE_BLOCK)
        return (blk * CACHE_BLOCK + start % CACHE_BLOCK).to(gl.int32)

    @gluon.jit
    def _prefetch_l2(kv_ptr, bt_row, k_lo, tile, n_tiles, BLOCK_N: gl.constexpr, CACHE_BLOCK: gl.constexpr,
                     ROW: gl.constexpr):
        """Dense key tile ``tile`` (if it exists) into L2: its ``BLOCK_N`` cache rows of ``ROW`` values
        are contiguous (a tile never spans two cache blocks), so one bulk prefetch
        (``cp.async.bulk.prefetch.L2``, PTX ISA 8.0, sm_90) of the whole tile, the same address in
        every lane of the producer's warp (ptxas issues a uniform instruction once per distinct
        address: once). No barrier, no shared memory: the bulk tensor copy of the tile, issued
        later, then reads L2 instead of waiting on HBM (the split-pv schedule's left half has a
        short refill window)."""
        if tile < n_tiles:
            r0 = _tile_row(bt_row, k_lo + tile * BLOCK_N, CACHE_BLOCK)
            lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
            ptrs = kv_ptr + (r0.to(gl.int64) * ROW + gl.zeros([32], gl.int64, lane_l))
            nbytes = gl.full([32], BLOCK_N * ROW * kv_ptr.dtype.element_ty.primitive_bitwidth // 8, gl.int32, lane_l)
            gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [ptrs, nbytes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_ahead(kv_ptr, bt_row, k_lo, i, n_tiles, BLOCK_N: gl.constexpr, CACHE_BLOCK: gl.constexpr,
                        ROW: gl.constexpr, L2_AHEAD: gl.constexpr):
        """After tile ``i``'s copies were issued: tile ``i + L2_AHEAD`` into L2 (tiles 1 to ``L2_AHEAD``
        after tile 0's), so the block-table load each prefetch waits on never delays a copy."""
        if L2_AHEAD > 0:
            if i == 0:
                for j in gl.static_range(1, L2_AHEAD):
                    _prefetch_l2(kv_ptr, bt_row, k_lo, j, n_tiles, BLOCK_N, CACHE_BLOCK, ROW)
            _prefetch_l2(kv_ptr, bt_row, k_lo, i + L2_AHEAD, n_tiles, BLOCK_N, CACHE_BLOCK, ROW)

    @gluon.jit
    def _producer(k0_desc, k1_desc, kr_desc, kv_ptr, bt_row, k_lo, n_tiles, kbuf0, kbuf1, kbufr, k_ready, k_free,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CACHE_BLOCK: gl.constexpr, HALF: gl.constexpr,
                  LORA: gl.constexpr, ROPE: gl.constexpr, L2_AHEAD: gl.constexpr):
        """Dense: tile ``i`` (its latent halves and rope) into slot ``i % STAGES`` once both warpgroups
        freed it (``k_free``), completing ``k_ready``; with ``L2_AHEAD`` > 0, then tile ``i + L2_AHEAD``
        prefetched into L2 (:func:`_prefetch_ahead`)."""
        for i in range(n_tiles):
            s = i % STAGES
            r0 = _tile_row(bt_row, k_lo + i * BLOCK_N, CACHE_BLOCK)  # its load under the wait (as _pv_producer)
            mbarrier.wait(k_free.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh slot passes at once
            bar = k_ready.index(s)
            mbarrier.expect(bar, k0_desc.block_type.nbytes * 2 + kr_desc.block_type.nbytes)
            _tma_load(k0_desc, [r0, 0], bar, kbuf0.index(s))
            _tma_load(k1_desc, [r0, HALF], bar, kbuf1.index(s))
            _tma_load(kr_desc, [r0, LORA], bar, kbufr.index(s))
            _prefetch_ahead(kv_ptr, bt_row, k_lo, i, n_tiles, BLOCK_N, CACHE_BLOCK, LORA + ROPE, L2_AHEAD)

    @gluon.jit
    def _store_half(o, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split, col0,
                    stride_ot, stride_oh, stride_pt, stride_ph, o_layout: gl.constexpr, SPLIT: gl.constexpr,
                    WRITE_ML: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr):
        """One warpgroup's 256 output columns: ``o / l`` (or the split's ``acc``, ``m``, ``l``)."""
        row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, o_layout)
        r = gl.convert_layout(row, row_l)
        h = gl.convert_layout(head, row_l)
        ok = gl.convert_layout(row_ok, row_l)
        cols = col0 + gl.arange(0, HALF, layout=col_l)
        if SPLIT:
            pbase = r * stride_pt + h * stride_ph + split
            gl.store(part_acc_ptr + pbase[:, None] * LORA + cols[None, :], o, mask=ok[:, None])
            if WRITE_ML:
                gl.store(part_ml_ptr + 2 * pbase, gl.convert_layout(m_i, row_l), mask=ok)
                gl.store(part_ml_ptr + 2 * pbase + 1, gl.convert_layout(l_i, row_l), mask=ok)
        else:
            ll = gl.convert_layout(l_i, row_l)
            denom = gl.where(ll > 0, ll, 1.0)
            val = (o / denom[:, None]).to(out_ptr.dtype.element_ty)
            gl.store(out_ptr + r[:, None] * stride_ot + h[:, None] * stride_oh + cols[None, :], val, mask=ok[:, None])

    @gluon.jit
    def _dense_keys(seq_lens_ptr, seq, rb, split, num_splits, q_len, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        """``(ctx, k_lo, k_hi)`` of a dense program (row block ``rb`` of sequence ``seq``, key split
        ``split`` of ``num_splits``): the context before the sequence's query rows, and this split's
        keys ``[k_lo, k_hi)`` of the causal context of the block's rows, in ``BLOCK_N``-key chunks."""
        ctx = gl.load(seq_lens_ptr + seq).to(gl.int32) - q_len
        n_keys = ctx + gl.minimum(q_len, ((rb + 1) * BLOCK_M - 1) // NUM_HEADS + 1)
        chunk = gl.cdiv(gl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        return ctx, k_lo, gl.minimum(k_lo + chunk, n_keys)

    @gluon.jit
    def _row_info(rb, q_start, q_len, ctx, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, SPARSE: gl.constexpr,
                  layout: gl.constexpr):
        """``(token row, head, row ok, query position)`` of a program's ``BLOCK_M`` matrix rows: dense,
        (query row, head) pairs ``rb * BLOCK_M + r`` of a sequence's ``q_len`` rows (row-major);
        sparse, heads ``rb * BLOCK_M + r`` of token row ``q_start``."""
        r = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
        if SPARSE:
            return (r * 0 + q_start).to(gl.int64), r, r < NUM_HEADS, r * 0
        tok = r // NUM_HEADS
        return (q_start + tok).to(gl.int64), r % NUM_HEADS, tok < q_len, ctx + tok

    @gluon.jit
    def _load_q(qbuf0, qbuf1, qbufr, ql_ptr, qp_ptr, rb, q_start, q_len, ctx, stride_qlt, stride_qlh, stride_qpt,
                stride_qph, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, SPARSE: gl.constexpr, HALF: gl.constexpr,
                ROPE: gl.constexpr):
        """The program's query rows into shared memory (zeros past its real rows), by the softmax
        warpgroup at its start: under the producer's first copies, not before the partitions start."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, SPARSE,
                                             gl.SliceLayout(1, ld))
        ok = row_ok[:, None]
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
        ql_rows = ql_ptr + row[:, None] * stride_qlt + head[:, None] * stride_qlh
        qbuf0.store(gl.load(ql_rows + cols[None, :], mask=ok, other=0.0))
        qbuf1.store(gl.load(ql_rows + HALF + cols[None, :], mask=ok, other=0.0))
        rcols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ld))
        qbufr.store(gl.load(qp_ptr + row[:, None] * stride_qpt + head[:, None] * stride_qph + rcols[None, :],
                            mask=ok, other=0.0))
        fence_async_shared()

    @gluon.jit
    def _wg0_state(rb, q_start, q_len, ctx, k_hi, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, SPARSE: gl.constexpr,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, HALF: gl.constexpr):
        """Warpgroup 0's rows and starting state (split schedules): ``(row, head, row_ok, q_pos, k_full,
        m = -inf in raw score units, l = 0, O's left half = 0)``."""
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, SPARSE, row_l)
        k_full = _full_keys(ctx, rb, k_hi, NUM_HEADS, BLOCK_M)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_l)  # raw score units (_exp_scaled)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_l)
        return row, head, row_ok, q_pos, k_full, m_i, l_i, gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)

    @gluon.jit
    def _wg0_finish(o, m_i, l_i, qk_scale, mlbuf, done, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split,
                    stride_ot, stride_oh, stride_pt, stride_ph, o_layout: gl.constexpr, SPLIT: gl.constexpr,
                    HALF: gl.constexpr, LORA: gl.constexpr):
        """Warpgroup 0's end (split schedules): the max (in scaled log2 units, as combine_splits reads
        it) and sum handed to warpgroup 1 through ``mlbuf`` / ``done``, then its half of O stored."""
        m_i = m_i * qk_scale
        mlbuf.index(0).store(m_i)
        mlbuf.index(1).store(l_i)
        mbarrier.arrive(done, count=1)
        _store_half(o, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split, 0, stride_ot,
                    stride_oh, stride_pt, stride_ph, o_layout, SPLIT, True, HALF, LORA)

    @gluon.jit
    def _softmax_wg(ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, abuf, mlbuf, k_ready, k_free,
                    p_ready, p_free, done, out_ptr, part_acc_ptr, part_ml_ptr, slots_row, n_slots, rb, split, q_start,
                    q_len, ctx, k_lo, k_hi, n_tiles, qk_scale, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                    stride_ot, stride_oh, stride_pt, stride_ph,
                    NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    P_BUFS: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr,
                    SPLIT: gl.constexpr, SPARSE: gl.constexpr):
        _load_q(qbuf0, qbuf1, qbufr, ql_ptr, qp_ptr, rb, q_start, q_len, ctx, stride_qlt, stride_qlh, stride_qpt,
                stride_qph, NUM_HEADS, BLOCK_M, SPARSE, HALF, ROPE)
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(HALF)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        row, head, row_ok, q_pos, k_full, m_i, l_i, o = _wg0_state(rb, q_start, q_len, ctx, k_hi, NUM_HEADS, BLOCK_M,
                                                                   SPARSE, s_layout, o_layout, HALF)
        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
            if SPARSE:  # gathered by cp.async (generic proxy) and read by wgmma (async proxy)
                fence_async_shared()
            start = k_lo + i * BLOCK_N
            offs_n = start + gl.arange(0, BLOCK_N, layout=col_l)
            if SPARSE:  # the selection is the mask: its load in flight under the score products
                slot = gl.load(slots_row + offs_n, mask=offs_n < k_hi, other=-1)
            if not SPARSE:  # a split's partial last tile: zero its stale value rows (both halves)
                _zero_tail(kbuf0.index(s), start, k_hi, BLOCK_N, HALF)
                _zero_tail(kbuf1.index(s), start, k_hi, BLOCK_N, HALF)
            sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            sc = warpgroup_mma(qbuf0, kbuf0.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
            sc = warpgroup_mma(qbuf1, kbuf1.index(s).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma(qbufr, kbufr.index(s).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(0, deps=[sc])
            if SPARSE:  # (the gather zero-filled unused entries' rows)
                ok = row_ok[:, None] & ((slot >= 0) & (slot < n_slots))[None, :]
                sc = gl.where(ok, sc, float("-inf"))
            else:
                sc = _causal_scores(sc, start, k_full, k_hi, row_ok, q_pos, s_layout, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(sc, axis=1))
            p, m_safe = _exp_scaled(sc, m_new, qk_scale)
            alpha = gl.exp2(m_i * qk_scale - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            b = i % P_BUFS
            mbarrier.wait(p_free.index(b), ((i // P_BUFS) & 1) ^ 1)
            pbuf.index(b).store(p.to(pbuf.dtype))
            abuf.index(b).store(alpha)
            fence_async_shared()
            mbarrier.arrive(p_ready.index(b), count=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            o = warpgroup_mma(pbuf.index(b), kbuf0.index(s), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[o])
            mbarrier.arrive(k_free.index(s), count=1)
        _wg0_finish(o, m_i, l_i, qk_scale, mlbuf, done, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split,
                    stride_ot, stride_oh, stride_pt, stride_ph, o_layout, SPLIT, HALF, LORA)

    @gluon.jit
    def _value_wg(kbuf1, pbuf, abuf, mlbuf, k_ready, k_free, p_ready, p_free, done, out_ptr, part_acc_ptr,
                  part_ml_ptr, rb, split, q_start, q_len, ctx, n_tiles, stride_ot, stride_oh, stride_pt, stride_ph,
                  NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, P_BUFS: gl.constexpr,
                  HALF: gl.constexpr, LORA: gl.constexpr, SPLIT: gl.constexpr, SPARSE: gl.constexpr):
        o_layout: gl.constexpr = _wgmma_layout(HALF)
        row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        o = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        for i in range(n_tiles):
            s = i % STAGES
            b = i % P_BUFS
            mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)  # stable: the slot waits for this partition too
            if SPARSE:
                fence_async_shared()
            mbarrier.wait(p_ready.index(b), (i // P_BUFS) & 1)
            alpha = abuf.index(b).load(row_l)
            o = o * alpha[:, None]
            o = warpgroup_mma(pbuf.index(b), kbuf1.index(s), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[o])
            mbarrier.arrive(p_free.index(b), count=1)
            mbarrier.arrive(k_free.index(s), count=1)
        mbarrier.wait(done, 0)
        m_i = mlbuf.index(0).load(row_l)
        l_i = mlbuf.index(1).load(row_l)
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, SPARSE, row_l)
        _store_half(o, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split, HALF, stride_ot,
                    stride_oh, stride_pt, stride_ph, o_layout, SPLIT, False, HALF, LORA)

    # ------------------------------------------------------------------ dense, "split-pv" schedule
    # The split schedule's warpgroups with the softmax warpgroup's value half one tile behind
    # (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024, sec. 3.2, on MLA's shared key /
    # value tiles): it issues tile i's scores, then tile i - 1's left value product, and runs tile
    # i's softmax while that product runs; the value warpgroup's right half of tile i - 1 runs under
    # tile i's scores. Two slots still suffice because a tile's halves are released apart: the right
    # half + rope after tile i's scores and the value warpgroup's product (``k_free``, count 2), the
    # left half after the lagged product (``free_l``); the producer refills the right half first and
    # the scores read it first. Opt-in (DENSE_SCHEDULE); the ncu profile it answers is in
    # BENCHMARKS.md (session 42: the split kernel's softmax ran with the tensor cores idle).

    @gluon.jit
    def _pv_producer(k0_desc, k1_desc, kr_desc, kv_ptr, bt_row, k_lo, n_tiles, kbuf0, kbuf1, kbufr, k_ready,
                     k_free, ready_l, free_l, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CACHE_BLOCK: gl.constexpr,
                     HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, L2_AHEAD: gl.constexpr):
        """Tile ``i``'s right latent half + rope into slot ``i % STAGES`` once the slot's are free
        (``k_free``), completing ``k_ready``; then its left half once that is free (``free_l``),
        completing ``ready_l``; with ``L2_AHEAD`` > 0, then tile ``i + L2_AHEAD`` prefetched into L2
        (:func:`_prefetch_ahead`). (The copies are :func:`_seesaw_load`'s two kinds, written out here
        to look the tile's cache row up once.)"""
        for i in range(n_tiles):
            s = i % STAGES
            phase = ((i // STAGES) & 1) ^ 1  # a fresh slot passes at once
            r0 = _tile_row(bt_row, k_lo + i * BLOCK_N, CACHE_BLOCK)
            mbarrier.wait(k_free.index(s), phase)
            mbarrier.expect(k_ready.index(s), k1_desc.block_type.nbytes + kr_desc.block_type.nbytes)
            _tma_load(k1_desc, [r0, HALF], k_ready.index(s), kbuf1.index(s))
            _tma_load(kr_desc, [r0, LORA], k_ready.index(s), kbufr.index(s))
            mbarrier.wait(free_l.index(s), phase)
            mbarrier.expect(ready_l.index(s), k0_desc.block_type.nbytes)
            _tma_load(k0_desc, [r0, 0], ready_l.index(s), kbuf0.index(s))
            _prefetch_ahead(kv_ptr, bt_row, k_lo, i, n_tiles, BLOCK_N, CACHE_BLOCK, LORA + ROPE, L2_AHEAD)

    @gluon.jit
    def _pv_scores(qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, k_ready, ready_l, i, start, k_hi,
                   s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   HALF: gl.constexpr):
        """Tile ``i``'s ``Q K^T`` issued async (3 wgmma groups): the right half + rope once landed,
        then the left half (refilled last). A partial last tile waits for both halves and zeroes
        their stale value rows before any product (zeroing with the score products in flight made
        ptxas spill ~20 values a tile for the whole loop)."""
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        if start + BLOCK_N > k_hi:
            mbarrier.wait(ready_l.index(s), phase)
            _zero_tail(kbuf1.index(s), start, k_hi, BLOCK_N, HALF)
            _zero_tail(kbuf0.index(s), start, k_hi, BLOCK_N, HALF)
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        sc = warpgroup_mma(qbuf1, kbuf1.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qbufr, kbufr.index(s).permute((1, 0)), sc, is_async=True)
        mbarrier.wait(ready_l.index(s), phase)  # (at once after a partial tile's wait)
        return warpgroup_mma(qbuf0, kbuf0.index(s).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _pv_exp(sc, m_i, start, k_hi, k_full, row_ok, q_pos, qk_scale, s_layout: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """A tile's online softmax, first step: masked raw scores -> ``(p, m_new, m_safe)``."""
        sc = _causal_scores(sc, start, k_full, k_hi, row_ok, q_pos, s_layout, BLOCK_N)
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        p, m_safe = _exp_scaled(sc, m_new, qk_scale)
        return p, m_new, m_safe

    @gluon.jit
    def _pv_sum(p, m_i, m_safe, l_i, qk_scale, dtype: gl.constexpr):
        """... second step: ``(p, alpha, l)``, ``p`` in the P buffer's 16-bit ``dtype`` (half the
        registers while the lagged value product runs)."""
        alpha = gl.exp2(m_i * qk_scale - m_safe)
        return p.to(dtype), alpha, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _pv_store_p(p, alpha, i, pbuf, abuf, p_ready, p_free):
        """Tile ``i``'s P and alpha into the one P buffer, once the value warpgroup has read tile
        ``i - 1``'s (the caller's own read of it is done)."""
        mbarrier.wait(p_free.index(0), (i & 1) ^ 1)
        pbuf.index(0).store(p)
        abuf.index(0).store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(0), count=1)

    @gluon.jit
    def _pv_softmax_wg(ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, abuf, mlbuf, k_ready, k_free,
                       ready_l, free_l, p_ready, p_free, done, out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start,
                       q_len, ctx, k_lo, k_hi, n_tiles, qk_scale, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                       stride_ot, stride_oh, stride_pt, stride_ph,
                       NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, SPLIT: gl.constexpr):
        """``"split-pv"``'s warpgroup 0: tile i's scores and softmax, tile i - 1's left value half
        under them (one P buffer: the value warpgroup reads tile i's P after tile i - 1's)."""
        _load_q(qbuf0, qbuf1, qbufr, ql_ptr, qp_ptr, rb, q_start, q_len, ctx, stride_qlt, stride_qlh, stride_qpt,
                stride_qph, NUM_HEADS, BLOCK_M, False, HALF, ROPE)
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(HALF)
        o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
        row, head, row_ok, q_pos, k_full, m_i, l_i, o = _wg0_state(rb, q_start, q_len, ctx, k_hi, NUM_HEADS, BLOCK_M,
                                                                   False, s_layout, o_layout, HALF)
        alpha = gl.zeros_like(l_i)
        if n_tiles > 0:  # tile 0: scores and softmax, no value product yet
            acc = _pv_scores(qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, k_ready, ready_l, 0, k_lo, k_hi, s_layout,
                             BLOCK_M, BLOCK_N, STAGES, HALF)
            sc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(k_free.index(0), count=1)  # its right half + rope: read by the scores
            p, m_new, m_safe = _pv_exp(sc, m_i, k_lo, k_hi, k_full, row_ok, q_pos, qk_scale, s_layout, BLOCK_N)
            p, alpha, l_i = _pv_sum(p, m_i, m_safe, l_i, qk_scale, pbuf.dtype)
            m_i = m_new
            _pv_store_p(p, alpha, 0, pbuf, abuf, p_ready, p_free)
        for i in range(1, n_tiles):
            s = i % STAGES
            sp = (i - 1) % STAGES
            acc = _pv_scores(qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, k_ready, ready_l, i, k_lo + i * BLOCK_N, k_hi,
                             s_layout, BLOCK_M, BLOCK_N, STAGES, HALF)
            o = o * gl.convert_layout(alpha, o_row)[:, None]  # to tile i - 1's max, then its P V
            oa = warpgroup_mma(pbuf.index(0), kbuf0.index(sp), o, is_async=True)
            sc = warpgroup_mma_wait(1, deps=[acc])  # the scores done; the value product may still run
            mbarrier.arrive(k_free.index(s), count=1)
            # tile i's softmax under tile i - 1's value product; its P stored once that product is done
            p, m_new, m_safe = _pv_exp(sc, m_i, k_lo + i * BLOCK_N, k_hi, k_full, row_ok, q_pos, qk_scale, s_layout,
                                       BLOCK_N)
            p, alpha, l_i = _pv_sum(p, m_i, m_safe, l_i, qk_scale, pbuf.dtype)
            m_i = m_new
            # the running sum stored first anchors the wait after the softmax: ptxas schedules the wgmma wait
            # (no register operands in PTX) as early as it may, and without a shared-memory store before it
            # put it at the top of the max (Triton 3.9, sm_90 SASS), so the softmax waited for the product
            # it is meant to run under; the value warpgroup reads mlbuf only after `done` (the end's store wins)
            mlbuf.index(1).store(l_i)
            o = warpgroup_mma_wait(0, deps=[oa])
            mbarrier.arrive(free_l.index(sp), count=1)  # tile i - 1's left half: its scores and products done
            _pv_store_p(p, alpha, i, pbuf, abuf, p_ready, p_free)
        if n_tiles > 0:  # the last tile's left value half
            o = o * gl.convert_layout(alpha, o_row)[:, None]
            oa = warpgroup_mma(pbuf.index(0), kbuf0.index((n_tiles - 1) % STAGES), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[oa])
        _wg0_finish(o, m_i, l_i, qk_scale, mlbuf, done, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split,
                    stride_ot, stride_oh, stride_pt, stride_ph, o_layout, SPLIT, HALF, LORA)

    # ------------------------------------------------------------------ dense, "seesaw" schedule
    # FlashMLA's dense decode schedule (DeepSeek 2025; facts only, own code): the two warpgroups take
    # the key tiles in pairs (A = 2j, B = 2j + 1). Warpgroup 0 owns A's scores and softmax, warpgroup 1
    # B's; each accumulates its own value half (0: left 256 columns, 1: right 256) over BOTH tiles,
    # its own tile's P from registers and the other's from shared memory. The running max passes
    # A -> B -> next A through shared memory, so one warpgroup's softmax runs under the other's
    # products. Opt-in (DENSE_SCHEDULE): the later refills cost more than the overlap gains unless
    # the keys are in L2 (BENCHMARKS.md, 2026-12-04).

    @gluon.jit
    def _seesaw_scores(qbuf, z, q_rope, kbuf0, kbuf1, kbufr, ready_l, ready_r, s, phase, s_layout: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """``Q K^T`` of the tile in slot ``s`` (issued async, 3 wgmma groups), each key half once it
        has landed: the left half (refilled first), then the right half + rope. ``z`` is a zero the
        compiler cannot prove: indexing the query halves by it keeps their 36 wgmma descriptors from
        being hoisted out of the loop, where they would hold ~70 registers a thread for its whole
        length (ptxas spilled)."""
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(ready_l.index(s), phase)
        sc = warpgroup_mma(qbuf.index(z), kbuf0.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
        mbarrier.wait(ready_r.index(s), phase)
        sc = warpgroup_mma(qbuf.index(z + 1), kbuf1.index(s).permute((1, 0)), sc, is_async=True)
        return warpgroup_mma(q_rope, kbufr.index(s).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _full_keys(ctx, rb, k_hi, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr):
        """Dense: the keys below this one are seen by every row of row block ``rb`` (before ``k_hi``
        and at or before the block's first query position ``ctx + rb * BLOCK_M // NUM_HEADS``; the
        later rows, padding rows too, see more), so a tile below it needs no mask."""
        return gl.minimum(k_hi, ctx + (rb * BLOCK_M) // NUM_HEADS + 1)

    @gluon.jit
    def _causal_scores(sc, start, k_full, k_hi, row_ok, q_pos, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """Causally masked raw (unscaled) scores of the dense tile at key ``start``: -inf past ``k_hi``,
        after a row's query position and in padding rows, on a tile that reaches past ``k_full`` (the
        last one or two of a program, :func:`_full_keys`); the other tiles unmasked (FlashMLA masks
        only its last tiles: ~130 instructions a tile a warp of iota / compare / select saved). Every
        key of an unmasked tile is a real cache row (finite), and a padding row's zero query gives it
        finite scores whose output is never stored; both schedules."""
        if start + BLOCK_N > k_full:
            offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = row_ok[:, None] & (offs_n[None, :] < k_hi) & (offs_n[None, :] <= q_pos[:, None])
            sc = gl.where(ok, sc, float("-inf"))
        return sc

    @gluon.jit
    def _exp_scaled(s, m_new, qk_scale):
        """``(exp2((s - m_new) qk_scale), m_new qk_scale)`` a row, the running max ``m_new`` kept in raw
        score units and the scale folded into the exponent's argument: one FMA an element
        (``s * qk_scale - m``) instead of a multiply and a subtract (FlashMLA's form); a row whose
        max is still -inf (every key masked) takes 0 as its scaled max (its ``p`` are 0). ``qk_scale``
        > 0 (softmax scale x log2 e), so the raw max is the max of the scaled scores."""
        ms = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
        return gl.exp2(s * qk_scale - ms[:, None]), ms

    @gluon.jit
    def _zero_tail(buf, start, k_hi, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
        """Zero the value rows of a split's partial last tile past ``k_hi`` (stale cache slots may
        hold NaN, and 0 x NaN is NaN in ``P V``); ``buf``: one ``[BLOCK_N, HALF]`` latent half of a
        key slot, zeroed by the warpgroup that calls this (both schedules)."""
        if start + BLOCK_N > k_hi:  # 64 columns at a time: 16 registers a thread, not 64
            zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            keep = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl)) < k_hi)[:, None]
            for c in gl.static_range(HALF // 64):
                part = buf.slice(c * 64, 64, dim=1)
                x = part.load(zl)
                part.store(gl.where(keep, x, gl.zeros_like(x)))
            fence_async_shared()

    @gluon.jit
    def _q_rope_regs(qp_ptr, row, head, row_ok, stride_qpt, stride_qph, layout: gl.constexpr, ROPE: gl.constexpr):
        """The query's rope part ``[BLOCK_M, ROPE]`` as a register (dot-operand) tensor: its shared
        memory holds the second P buffer."""
        r = gl.convert_layout(row, gl.SliceLayout(1, layout))
        h = gl.convert_layout(head, gl.SliceLayout(1, layout))
        ok = gl.convert_layout(row_ok, gl.SliceLayout(1, layout))
        cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, layout))
        return gl.load(qp_ptr + r[:, None] * stride_qpt + h[:, None] * stride_qph + cols[None, :], mask=ok[:, None],
                       other=0.0)

    @gluon.jit
    def _seesaw_wg0(qbuf, qp_ptr, kbuf0, kbuf1, kbufr, pbuf, sm0, ss0, sm1, ss1, sl0, sl1, ready_l,
                    ready_r, a_ready, b_ready, p0_free, pa_ready, l0_ready, l1_ready, k0_desc, k1_desc, kr_desc, bt_row,
                    out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi, n_tiles,
                    qk_scale, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                    NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr,
                    LORA: gl.constexpr, ROPE: gl.constexpr, SPLIT: gl.constexpr, CACHE_BLOCK: gl.constexpr,
                    ONE_RESCALE: gl.constexpr):
        """Warpgroup 0: scores + softmax of tiles A = 2j, the left value half of every tile.
        ``ONE_RESCALE``: ``P_A`` goes to shared memory only once B's softmax is known, at B's max
        (``P_A sc1``, FlashMLA's order), so warpgroup 1 rescales its half of O once a pair."""
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(HALF)
        qr_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = pbuf.dtype
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, False, row_l)
        k_full = _full_keys(ctx, rb, k_hi, NUM_HEADS, BLOCK_M)
        q_rope = _q_rope_regs(qp_ptr, row, head, row_ok, stride_qpt, stride_qph, qr_layout, ROPE)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_l)  # raw score units (_exp_scaled)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_l)
        o = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if n_tiles > 0:
            sc = _seesaw_scores(qbuf, 0, q_rope, kbuf0, kbuf1, kbufr, ready_l, ready_r, 0, 0, s_layout, BLOCK_M,
                                BLOCK_N)
            sc = warpgroup_mma_wait(0, deps=[sc])
        for j in range(gl.cdiv(n_tiles, 2)):
            z = j >> 24  # 0 (see _seesaw_scores)
            ph = j & 1
            start_a = k_lo + 2 * j * BLOCK_N
            has_b = 2 * j + 1 < n_tiles
            # softmax of A against the running max m_i (after the previous pair's B)
            sa = _causal_scores(sc, start_a, k_full, k_hi, row_ok, q_pos, s_layout, BLOCK_N)
            m0 = gl.maximum(m_i, gl.max(sa, axis=1))
            p0, m0s = _exp_scaled(sa, m0, qk_scale)
            sc0 = gl.exp2(m_i * qk_scale - m0s)
            l_i = l_i * sc0 + gl.sum(p0, axis=1)
            pb = p0.to(dtype)
            mbarrier.wait(p0_free, ph ^ 1)  # warpgroup 1's products of the previous P_A are done
            if not ONE_RESCALE:
                pbuf.index(z).store(pb)
            sm0.store(m0)
            ss0.store(sc0)
            fence_async_shared()
            mbarrier.arrive(a_ready, count=1)
            # O_L = sc0 O_L + P_A V_L(A), P_A from registers
            o = o * gl.convert_layout(sc0, orow_l)[:, None]
            _zero_tail(kbuf0.index(z), start_a, k_hi, BLOCK_N, HALF)
            pa = gl.convert_layout(pb, pa_layout)
            o = warpgroup_mma(pa, kbuf0.index(z), o, is_async=True)
            o, pa = warpgroup_mma_wait(0, deps=[o, pa])
            _seesaw_load(k0_desc, k0_desc, bt_row, k_lo, 2 * j + 2, n_tiles, kbuf0, kbuf0, ready_l, 0, 0, BLOCK_N,
                         CACHE_BLOCK, False)
            m_i = m0
            if ONE_RESCALE:  # P_A at B's max for warpgroup 1 (sc1 = 1 without B), then as below
                sc1 = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_l)
                if has_b:
                    mbarrier.wait(b_ready, ph)
                    sc1 = ss1.load(row_l)
                    m_i = sm1.load(row_l)
                pbuf.index(z).store((p0 * sc1[:, None]).to(dtype))
                fence_async_shared()
                mbarrier.arrive(pa_ready, count=1)
                if has_b:
                    l_i = l_i * sc1
                    o = o * gl.convert_layout(sc1, orow_l)[:, None]
                    _zero_tail(kbuf0.index(z + 1), start_a + BLOCK_N, k_hi, BLOCK_N, HALF)
            elif has_b:  # O_L = sc1 O_L + P_B V_L(B), P_B from shared memory
                mbarrier.wait(b_ready, ph)
                sc1 = ss1.load(row_l)
                m_i = sm1.load(row_l)
                l_i = l_i * sc1
                o = o * gl.convert_layout(sc1, orow_l)[:, None]
                _zero_tail(kbuf0.index(z + 1), start_a + BLOCK_N, k_hi, BLOCK_N, HALF)
            if 2 * j + 2 < n_tiles:  # ... with the next A's scores under it
                o = warpgroup_mma(pbuf.index(z + 1), kbuf0.index(z + 1), o, is_async=True)
                sc = _seesaw_scores(qbuf, z, q_rope, kbuf0, kbuf1, kbufr, ready_l, ready_r, z, (j + 1) & 1,
                                    s_layout, BLOCK_M, BLOCK_N)
                o = warpgroup_mma_wait(3, deps=[o])  # P_B V_L(B) done: the 3 score groups retire after it
                _seesaw_load(k0_desc, k0_desc, bt_row, k_lo, 2 * j + 3, n_tiles, kbuf0, kbuf0, ready_l, 0, 0, BLOCK_N,
                             CACHE_BLOCK, False)
                sc = warpgroup_mma_wait(0, deps=[sc])
            elif has_b:
                o = warpgroup_mma(pbuf.index(z + 1), kbuf0.index(z + 1), o, is_async=True)
                o = warpgroup_mma_wait(0, deps=[o])
        # l = both warpgroups' sums, at the final max
        sl0.store(l_i)
        mbarrier.arrive(l0_ready, count=1)
        mbarrier.wait(l1_ready, 0)
        l_i = l_i + sl1.load(row_l)
        _store_half(o, m_i * qk_scale, l_i, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split, 0,
                    stride_ot, stride_oh, stride_pt, stride_ph, o_layout, SPLIT, True, HALF, LORA)

    @gluon.jit
    def _seesaw_wg1(qbuf, qp_ptr, kbuf0, kbuf1, kbufr, pbuf, sm0, ss0, sm1, ss1, sl0, sl1, ready_l,
                    ready_r, a_ready, b_ready, p0_free, pa_ready, l0_ready, l1_ready, k0_desc, k1_desc, kr_desc, bt_row,
                    out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi, n_tiles,
                    qk_scale, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                    NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr,
                    LORA: gl.constexpr, ROPE: gl.constexpr, SPLIT: gl.constexpr, CACHE_BLOCK: gl.constexpr,
                    ONE_RESCALE: gl.constexpr):
        """Warpgroup 1: scores + softmax of tiles B = 2j + 1, the right value half of every tile.
        ``ONE_RESCALE``: B's softmax first, then ``O_R = sc0 sc1 O_R + P_B V_R(B) + (P_A sc1)
        V_R(A)`` (one rescale of the 64 x 256 accumulator a pair, not two; ``P_A sc1`` from
        warpgroup 0, ``pa_ready``); otherwise ``P_A V_R(A)`` at A's max runs under B's softmax and
        O_R is rescaled by ``sc0`` and again by ``sc1``."""
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(HALF)
        qr_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, False, row_l)
        k_full = _full_keys(ctx, rb, k_hi, NUM_HEADS, BLOCK_M)
        q_rope = _q_rope_regs(qp_ptr, row, head, row_ok, stride_qpt, stride_qph, qr_layout, ROPE)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_l)
        o = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if n_tiles > 1:
            sc = _seesaw_scores(qbuf, 0, q_rope, kbuf0, kbuf1, kbufr, ready_l, ready_r, 1, 0, s_layout, BLOCK_M,
                                BLOCK_N)
            sc = warpgroup_mma_wait(0, deps=[sc])
        for j in range(gl.cdiv(n_tiles, 2)):
            z = j >> 24  # 0 (see _seesaw_scores)
            ph = j & 1
            start_a = k_lo + 2 * j * BLOCK_N
            has_b = 2 * j + 1 < n_tiles
            mbarrier.wait(a_ready, ph)
            m0 = sm0.load(row_l)
            sc0 = ss0.load(row_l)
            if ONE_RESCALE:
                if has_b:  # B's softmax against A's max first: warpgroup 0 waits for it
                    p1, sc1, pb = _seesaw_b_softmax(sc, start_a + BLOCK_N, k_full, k_hi, row_ok, q_pos, m0, qk_scale,
                                                    pbuf.index(z + 1), sm1, ss1, b_ready, s_layout, BLOCK_N)
                    # O_R = sc0 sc1 O_R + P_B V_R(B) (P_B from registers) + (P_A sc1) V_R(A) (from warpgroup 0);
                    # A is a full tile here (only a program's last tile is partial)
                    sc01 = sc0 * sc1
                    l_i = l_i * sc01 + gl.sum(p1, axis=1)
                    o = o * gl.convert_layout(sc01, orow_l)[:, None]
                    _zero_tail(kbuf1.index(z + 1), start_a + BLOCK_N, k_hi, BLOCK_N, HALF)
                    pa = gl.convert_layout(pb, pa_layout)
                    o = warpgroup_mma(pa, kbuf1.index(z + 1), o, is_async=True)
                    mbarrier.wait(pa_ready, ph)
                    o = warpgroup_mma(pbuf.index(z), kbuf1.index(z), o, is_async=True)
                    pa = warpgroup_mma_wait(1, deps=[pa])  # P_B V_R(B) done: B's right half is free
                    _seesaw_load(k1_desc, kr_desc, bt_row, k_lo, 2 * j + 3, n_tiles, kbuf1, kbufr, ready_r, HALF, LORA,
                                 BLOCK_N, CACHE_BLOCK, True)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(p0_free, count=1)
                    _seesaw_load(k1_desc, kr_desc, bt_row, k_lo, 2 * j + 2, n_tiles, kbuf1, kbufr, ready_r, HALF, LORA,
                                 BLOCK_N, CACHE_BLOCK, True)
                else:  # a last tile A alone: O_R = sc0 O_R + P_A V_R(A)
                    l_i = l_i * sc0
                    o = o * gl.convert_layout(sc0, orow_l)[:, None]
                    _zero_tail(kbuf1.index(z), start_a, k_hi, BLOCK_N, HALF)
                    mbarrier.wait(pa_ready, ph)
                    o = warpgroup_mma(pbuf.index(z), kbuf1.index(z), o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(p0_free, count=1)
            else:  # O_R = sc0 O_R + P_A V_R(A), P_A from warpgroup 0 ...
                l_i = l_i * sc0
                o = o * gl.convert_layout(sc0, orow_l)[:, None]
                _zero_tail(kbuf1.index(z), start_a, k_hi, BLOCK_N, HALF)
                if has_b:  # ... under B's softmax against A's max
                    o = warpgroup_mma(pbuf.index(z), kbuf1.index(z), o, is_async=True)
                    p1, sc1, pb = _seesaw_b_softmax(sc, start_a + BLOCK_N, k_full, k_hi, row_ok, q_pos, m0, qk_scale,
                                                    pbuf.index(z + 1), sm1, ss1, b_ready, s_layout, BLOCK_N)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(p0_free, count=1)
                    _seesaw_load(k1_desc, kr_desc, bt_row, k_lo, 2 * j + 2, n_tiles, kbuf1, kbufr, ready_r, HALF, LORA,
                                 BLOCK_N, CACHE_BLOCK, True)
                    # O_R = sc1 O_R + P_B V_R(B), P_B from registers
                    l_i = l_i * sc1 + gl.sum(p1, axis=1)
                    o = o * gl.convert_layout(sc1, orow_l)[:, None]
                    _zero_tail(kbuf1.index(z + 1), start_a + BLOCK_N, k_hi, BLOCK_N, HALF)
                    pa = gl.convert_layout(pb, pa_layout)
                    o = warpgroup_mma(pa, kbuf1.index(z + 1), o, is_async=True)
                    o, pa = warpgroup_mma_wait(0, deps=[o, pa])
                    _seesaw_load(k1_desc, kr_desc, bt_row, k_lo, 2 * j + 3, n_tiles, kbuf1, kbufr, ready_r, HALF, LORA,
                                 BLOCK_N, CACHE_BLOCK, True)
                else:
                    o = warpgroup_mma(pbuf.index(z), kbuf1.index(z), o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(p0_free, count=1)
            if 2 * j + 3 < n_tiles:  # the next B's scores
                sc = _seesaw_scores(qbuf, z, q_rope, kbuf0, kbuf1, kbufr, ready_l, ready_r, z + 1, (j + 1) & 1,
                                    s_layout, BLOCK_M, BLOCK_N)
                sc = warpgroup_mma_wait(0, deps=[sc])
        sl1.store(l_i)
        mbarrier.arrive(l1_ready, count=1)
        mbarrier.wait(l0_ready, 0)
        l_i = l_i + sl0.load(row_l)
        _store_half(o, l_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, row, head, row_ok, split, HALF, stride_ot,
                    stride_oh, stride_pt, stride_ph, o_layout, SPLIT, False, HALF, LORA)

    @gluon.jit
    def _seesaw_b_softmax(sc, start_b, k_full, k_hi, row_ok, q_pos, m0, qk_scale, p_slot, sm1, ss1, b_ready,
                          s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """Warpgroup 1's softmax of a pair's tile B (scores ``sc``, keys from ``start_b``) against A's max
        ``m0``: P_B into ``p_slot``, B's max and A -> B rescale into ``sm1`` / ``ss1``, then ``b_ready``;
        returns ``(p1, sc1, P_B in the cache dtype)`` (both seesaw orders)."""
        sb = _causal_scores(sc, start_b, k_full, k_hi, row_ok, q_pos, s_layout, BLOCK_N)
        m1 = gl.maximum(m0, gl.max(sb, axis=1))
        p1, m1s = _exp_scaled(sb, m1, qk_scale)
        sc1 = gl.exp2(m0 * qk_scale - m1s)
        pb = p1.to(p_slot.dtype)
        p_slot.store(pb)
        sm1.store(m1)
        ss1.store(sc1)
        fence_async_shared()
        mbarrier.arrive(b_ready, count=1)
        return p1, sc1, pb

    @gluon.jit
    def _seesaw_load(desc_a, desc_b, bt_row, k_lo, tile, n_tiles, buf_a, buf_b, ready, col_a, col_b,
                     BLOCK_N: gl.constexpr, CACHE_BLOCK: gl.constexpr, TWO: gl.constexpr):
        """Bulk-copy one half of key tile ``tile`` (if it exists) into slot ``tile % 2``: the left
        latent half (``TWO`` false), or the right half and the rope part, completing ``ready``."""
        if tile < n_tiles:
            s = tile % 2
            r0 = _tile_row(bt_row, k_lo + tile * BLOCK_N, CACHE_BLOCK)
            if TWO:
                mbarrier.expect(ready.index(s), desc_a.block_type.nbytes + desc_b.block_type.nbytes)
                _tma_load(desc_a, [r0, col_a], ready.index(s), buf_a.index(s))
                _tma_load(desc_b, [r0, col_b], ready.index(s), buf_b.index(s))
            else:
                mbarrier.expect(ready.index(s), desc_a.block_type.nbytes)
                _tma_load(desc_a, [r0, col_a], ready.index(s), buf_a.index(s))

    @gluon.jit
    def _mla_seesaw_kernel(ql_ptr, qp_ptr, k0_desc, k1_desc, kr_desc, out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr,
                           seq_lens_ptr, bt_ptr, qk_scale, num_splits, stride_qlt, stride_qlh, stride_qpt,
                           stride_qph, stride_ot, stride_oh, stride_bt, stride_pt, stride_ph,
                           NUM_HEADS: gl.constexpr, CACHE_BLOCK: gl.constexpr, SPLIT: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr,
                           ROPE: gl.constexpr, WG1_REGS: gl.constexpr, ONE_RESCALE: gl.constexpr):
        # program (row block rb, key split, sequence), as _mla_ws_kernel
        rb = gl.program_id(0)
        split = gl.program_id(1)
        seq = gl.program_id(2)
        q_start = gl.load(qsl_ptr + seq).to(gl.int32)
        q_len = gl.load(qsl_ptr + seq + 1).to(gl.int32) - q_start
        if rb * BLOCK_M >= q_len * NUM_HEADS:  # past this sequence's rows (padding sequences: all)
            return
        ctx, k_lo, k_hi = _dense_keys(seq_lens_ptr, seq, rb, split, num_splits, q_len, NUM_HEADS, BLOCK_M, BLOCK_N)
        n_tiles = gl.maximum(gl.cdiv(k_hi - k_lo, BLOCK_N), 0)
        dtype: gl.constexpr = ql_ptr.dtype.element_ty
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        qbuf = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], nvmma)  # the query's latent halves
        kbuf0 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], nvmma)
        kbuf1 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], nvmma)
        kbufr = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], nvmma)
        pbuf = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], nvmma)  # P_A, P_B
        sm0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        ss0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        sm1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        ss1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        sl0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        sl1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        ready_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        ready_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        a_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        b_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        p0_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        pa_ready = gl.allocate_shared_memory(gl.int64, [1], bar)  # ONE_RESCALE: P_A (at B's max) stored
        l0_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        l1_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        for i in gl.static_range(2):
            mbarrier.init(ready_l.index(i), count=1)
            mbarrier.init(ready_r.index(i), count=1)
        mbarrier.init(a_ready, count=1)
        mbarrier.init(b_ready, count=1)
        mbarrier.init(p0_free, count=1)
        mbarrier.init(pa_ready, count=1)
        mbarrier.init(l0_ready, count=1)
        mbarrier.init(l1_ready, count=1)
        # the query's latent rows, once (zero past the program's real rows); m = -inf for warpgroup 1
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row, head, row_ok, q_pos = _row_info(rb, q_start, q_len, ctx, NUM_HEADS, BLOCK_M, False,
                                             gl.SliceLayout(1, ld))
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
        ql_rows = ql_ptr + row[:, None] * stride_qlt + head[:, None] * stride_qlh
        qbuf.index(0).store(gl.load(ql_rows + cols[None, :], mask=row_ok[:, None], other=0.0))
        qbuf.index(1).store(gl.load(ql_rows + HALF + cols[None, :], mask=row_ok[:, None], other=0.0))
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        for t in gl.static_range(2):  # the first two tiles; then each warpgroup refills the halves it read last
            _seesaw_load(k0_desc, k0_desc, bt_row, k_lo, t, n_tiles, kbuf0, kbuf0, ready_l, 0, 0, BLOCK_N, CACHE_BLOCK,
                         False)
            _seesaw_load(k1_desc, kr_desc, bt_row, k_lo, t, n_tiles, kbuf1, kbufr, ready_r, HALF, LORA, BLOCK_N,
                         CACHE_BLOCK, True)
        fence_async_shared()
        gl.warp_specialize([
            (_seesaw_wg0, (qbuf, qp_ptr, kbuf0, kbuf1, kbufr, pbuf, sm0, ss0, sm1, ss1, sl0, sl1,
                           ready_l, ready_r, a_ready, b_ready, p0_free, pa_ready, l0_ready, l1_ready, k0_desc,
                           k1_desc, kr_desc,
                           bt_row, out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi,
                           n_tiles, qk_scale, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                           NUM_HEADS, BLOCK_M, BLOCK_N, HALF, LORA, ROPE, SPLIT, CACHE_BLOCK, ONE_RESCALE)),
            (_seesaw_wg1, (qbuf, qp_ptr, kbuf0, kbuf1, kbufr, pbuf, sm0, ss0, sm1, ss1, sl0, sl1,
                           ready_l, ready_r, a_ready, b_ready, p0_free, pa_ready, l0_ready, l1_ready, k0_desc,
                           k1_desc, kr_desc,
                           bt_row, out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi,
                           n_tiles, qk_scale, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                           NUM_HEADS, BLOCK_M, BLOCK_N, HALF, LORA, ROPE, SPLIT, CACHE_BLOCK, ONE_RESCALE)),
        ], [4], [WG1_REGS])

    @gluon.jit
    def _gather_producer(kv_ptr, slots_row, n_slots, k_lo, k_hi, n_tiles, kbuf0, kbuf1, kbufr, k_ready, k_free,
                         stride_kb, stride_ks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CACHE_BLOCK: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr,
                         AHEAD: gl.constexpr):
        """Sparse: a 4-warp producer gathers each tile's selected cache rows (16-byte ``cp.async``,
        unused entries and entries past the split zero-filled) and completes ``k_ready`` of a tile
        once its copies are in shared memory: ``AHEAD`` 0, each thread's copies arrive on it as they
        land (the barrier counts the 128 gathering threads; the consumers fence before ``wgmma``
        reads them); ``AHEAD`` >= 1, the producer waits for the tile ``AHEAD`` behind the one it
        issued (``AHEAD <= STAGES - 1``: a slot is refilled only after its tile was ready and consumed)."""
        big: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        small: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, big))
        rcols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, small))
        for i in range(n_tiles):
            s = i % STAGES
            offs = k_lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, big))
            slot = gl.load(slots_row + offs, mask=offs < k_hi, other=-1).to(gl.int64)  # in flight while waiting
            ok = (slot >= 0) & (slot < n_slots)
            base = gl.where(ok, (slot // CACHE_BLOCK) * stride_kb + (slot % CACHE_BLOCK) * stride_ks, 0)
            base = gl.multiple_of(base, 8)  # rows 16-byte aligned (sparse_supported): 16-byte copies
            mbarrier.wait(k_free.index(s), ((i // STAGES) & 1) ^ 1)
            _cp_async(kbuf0.index(s), kv_ptr + base[:, None] + cols[None, :], mask=ok[:, None])
            _cp_async(kbuf1.index(s), kv_ptr + base[:, None] + HALF + cols[None, :], mask=ok[:, None])
            base_r = gl.convert_layout(base, gl.SliceLayout(1, small))
            ok_r = gl.convert_layout(ok, gl.SliceLayout(1, small))
            _cp_async(kbufr.index(s), kv_ptr + base_r[:, None] + LORA + rcols[None, :], mask=ok_r[:, None])
            if AHEAD == 0:  # each thread's copies complete the tile's barrier as they land (no waits here)
                _cp_arrive(k_ready.index(s), increment_count=False)
            else:
                cp.commit_group()
                if i >= AHEAD:  # groups complete in order: tile i - AHEAD has landed
                    cp.wait_group(AHEAD)
                    fence_async_shared()
                    mbarrier.arrive(k_ready.index((i - AHEAD) % STAGES), count=1)
        if AHEAD > 0:
            cp.wait_group(0)
            fence_async_shared()
            for j in range(gl.maximum(n_tiles - AHEAD, 0), n_tiles):
                mbarrier.arrive(k_ready.index(j % STAGES), count=1)

    @gluon.jit
    def _load_partition(k0_desc, k1_desc, kr_desc, bt_row, kv_ptr, slots_row, n_slots, k_lo, k_hi, n_tiles, kbuf0,
                        kbuf1, kbufr, k_ready, k_free, stride_kb, stride_ks, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CACHE_BLOCK: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr,
                        ROPE: gl.constexpr, SPARSE: gl.constexpr, AHEAD: gl.constexpr):
        """The producer partition: :func:`_gather_producer` (sparse, 4 warps; ``AHEAD``: the tiles its
        copies run behind their issue) or :func:`_producer` (dense, 1 warp; ``AHEAD``: its L2
        prefetch distance in tiles, 0 none)."""
        if SPARSE:
            _gather_producer(kv_ptr, slots_row, n_slots, k_lo, k_hi, n_tiles, kbuf0, kbuf1, kbufr, k_ready, k_free,
                             stride_kb, stride_ks, BLOCK_N, STAGES, CACHE_BLOCK, HALF, LORA, ROPE, AHEAD)
        else:
            _producer(k0_desc, k1_desc, kr_desc, kv_ptr, bt_row, k_lo, n_tiles, kbuf0, kbuf1, kbufr, k_ready, k_free,
                      BLOCK_N, STAGES, CACHE_BLOCK, HALF, LORA, ROPE, AHEAD)

    @gluon.jit
    def _attend(ql_ptr, qp_ptr, k0_desc, k1_desc, kr_desc, kv_ptr, slots_row, n_slots, bt_row, out_ptr, part_acc_ptr,
                part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi, qk_scale, stride_qlt, stride_qlh, stride_qpt,
                stride_qph, stride_kb, stride_ks, stride_ot, stride_oh, stride_pt, stride_ph,
                NUM_HEADS: gl.constexpr, CACHE_BLOCK: gl.constexpr, SPLIT: gl.constexpr, SPARSE: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, P_BUFS: gl.constexpr,
                HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, WG1_REGS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, AHEAD: gl.constexpr, PV_LAG: gl.constexpr):
        """One program over keys ``[k_lo, k_hi)`` (dense: cache positions; sparse: entries of the
        token row's selection): shared memory, barriers, then the partitions (the softmax one loads the query rows)
        (``PV_LAG``, dense only: the ``"split-pv"`` schedule's; ``AHEAD``: :func:`_load_partition`'s)."""
        n_tiles = gl.maximum(gl.cdiv(k_hi - k_lo, BLOCK_N), 0)
        dtype: gl.constexpr = ql_ptr.dtype.element_ty
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BLOCK_N, element_bitwidth=16, rank=2)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        qbuf0 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], nvmma)
        qbuf1 = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], nvmma)
        qbufr = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], nvmma)
        kbuf0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], nvmma)
        kbuf1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], nvmma)
        kbufr = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], nvmma)
        pbuf = gl.allocate_shared_memory(dtype, [P_BUFS, BLOCK_M, BLOCK_N], p_layout)
        abuf = gl.allocate_shared_memory(gl.float32, [P_BUFS, BLOCK_M], vec_layout)
        mlbuf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):  # sparse, AHEAD 0: every gathering thread arrives
            mbarrier.init(k_ready.index(i), count=128 if SPARSE and AHEAD == 0 else 1)
            mbarrier.init(k_free.index(i), count=2)  # both warpgroups read every slot
        for i in gl.static_range(P_BUFS):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(done, count=1)
        if PV_LAG:  # the left latent half's own ready / free barriers (k_ready / k_free: the right half + rope)
            ready_l = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free_l = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready_l.index(i), count=1)
                mbarrier.init(free_l.index(i), count=1)

        # (the query rows: loaded by the softmax warpgroup, _load_q, while the producer's first copies fly)
        if PV_LAG:
            gl.warp_specialize([
                (_pv_softmax_wg, (ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, abuf, mlbuf, k_ready,
                                  k_free, ready_l, free_l, p_ready, p_free, done, out_ptr, part_acc_ptr, part_ml_ptr,
                                  rb, split, q_start, q_len, ctx, k_lo, k_hi, n_tiles, qk_scale, stride_qlt,
                                  stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                                  NUM_HEADS, BLOCK_M, BLOCK_N, STAGES, HALF, LORA, ROPE, SPLIT)),
                (_value_wg, (kbuf1, pbuf, abuf, mlbuf, k_ready, k_free, p_ready, p_free, done, out_ptr, part_acc_ptr,
                             part_ml_ptr, rb, split, q_start, q_len, ctx, n_tiles, stride_ot, stride_oh, stride_pt,
                             stride_ph, NUM_HEADS, BLOCK_M, STAGES, P_BUFS, HALF, LORA, SPLIT, False)),
                (_pv_producer, (k0_desc, k1_desc, kr_desc, kv_ptr, bt_row, k_lo, n_tiles, kbuf0, kbuf1, kbufr, k_ready,
                                k_free, ready_l, free_l, BLOCK_N, STAGES, CACHE_BLOCK, HALF, LORA, ROPE, AHEAD)),
            ], [4, 1], [WG1_REGS, PRODUCER_REGS])
            return
        gl.warp_specialize([  # (one call: its arguments must be literal tuples to stay constexpr)
            (_softmax_wg, (ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, abuf, mlbuf, k_ready,
                           k_free, p_ready, p_free, done, out_ptr, part_acc_ptr, part_ml_ptr, slots_row, n_slots, rb,
                           split, q_start, q_len, ctx, k_lo, k_hi, n_tiles, qk_scale, stride_qlt, stride_qlh,
                           stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                           NUM_HEADS, BLOCK_M, BLOCK_N, STAGES, P_BUFS, HALF, LORA, ROPE, SPLIT, SPARSE)),
            (_value_wg, (kbuf1, pbuf, abuf, mlbuf, k_ready, k_free, p_ready, p_free, done, out_ptr, part_acc_ptr,
                         part_ml_ptr, rb, split, q_start, q_len, ctx, n_tiles, stride_ot, stride_oh, stride_pt,
                         stride_ph, NUM_HEADS, BLOCK_M, STAGES, P_BUFS, HALF, LORA, SPLIT, SPARSE)),
            (_load_partition, (k0_desc, k1_desc, kr_desc, bt_row, kv_ptr, slots_row, n_slots, k_lo, k_hi, n_tiles,
                               kbuf0, kbuf1, kbufr, k_ready, k_free, stride_kb, stride_ks, BLOCK_N, STAGES,
                               CACHE_BLOCK, HALF, LORA, ROPE, SPARSE, AHEAD)),
        ], [4, 4 if SPARSE else 1], [WG1_REGS, PRODUCER_REGS])

    @gluon.jit
    def _mla_ws_kernel(ql_ptr, qp_ptr, k0_desc, k1_desc, kr_desc, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr,
                       seq_lens_ptr, bt_ptr, qk_scale, num_splits, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                       stride_ot, stride_oh, stride_bt, stride_pt, stride_ph,
                       NUM_HEADS: gl.constexpr, CACHE_BLOCK: gl.constexpr, SPLIT: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, P_BUFS: gl.constexpr,
                       HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, WG1_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, PV_LAG: gl.constexpr, L2_AHEAD: gl.constexpr):
        # dense: program (row block rb, key split, sequence); keys = the causal context of its rows
        rb = gl.program_id(0)
        split = gl.program_id(1)
        seq = gl.program_id(2)
        q_start = gl.load(qsl_ptr + seq).to(gl.int32)
        q_len = gl.load(qsl_ptr + seq + 1).to(gl.int32) - q_start
        if rb * BLOCK_M >= q_len * NUM_HEADS:  # past this sequence's rows (padding sequences: all)
            return
        ctx, k_lo, k_hi = _dense_keys(seq_lens_ptr, seq, rb, split, num_splits, q_len, NUM_HEADS, BLOCK_M, BLOCK_N)
        _attend(ql_ptr, qp_ptr, k0_desc, k1_desc, kr_desc, kv_ptr, qsl_ptr, 0, bt_ptr + seq.to(gl.int64) * stride_bt,
                out_ptr, part_acc_ptr, part_ml_ptr, rb, split, q_start, q_len, ctx, k_lo, k_hi, qk_scale, stride_qlt,
                stride_qlh, stride_qpt, stride_qph, 0, 0, stride_ot, stride_oh, stride_pt, stride_ph, NUM_HEADS,
                CACHE_BLOCK, SPLIT, False, BLOCK_M, BLOCK_N, STAGES, P_BUFS, HALF, LORA, ROPE, WG1_REGS,
                PRODUCER_REGS, L2_AHEAD, PV_LAG)

    @gluon.jit
    def _sparse_mla_ws_kernel(ql_ptr, qp_ptr, kv_ptr, slots_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                              num_topk, n_slots, num_splits, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                              stride_kb, stride_ks, stride_st, stride_ot, stride_oh, stride_pt, stride_ph,
                              NUM_HEADS: gl.constexpr, CACHE_BLOCK: gl.constexpr, SPLIT: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              P_BUFS: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr,
                              WG1_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, AHEAD: gl.constexpr):
        # sparse: program (head block hb, split of the selection, token row t)
        hb = gl.program_id(0)
        split = gl.program_id(1)
        t = gl.program_id(2)
        chunk = gl.cdiv(gl.cdiv(num_topk, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        k_hi = gl.minimum(k_lo + chunk, num_topk)
        _attend(ql_ptr, qp_ptr, 0, 0, 0, kv_ptr, slots_ptr + t.to(gl.int64) * stride_st, n_slots, slots_ptr,
                out_ptr, part_acc_ptr, part_ml_ptr, hb, split, t, 1, 0, k_lo, k_hi, qk_scale, stride_qlt,
                stride_qlh, stride_qpt, stride_qph, stride_kb, stride_ks, stride_ot, stride_oh, stride_pt, stride_ph,
                NUM_HEADS, CACHE_BLOCK, SPLIT, True, BLOCK_M, BLOCK_N, STAGES, P_BUFS, HALF, LORA, ROPE, WG1_REGS,
                PRODUCER_REGS, AHEAD, False)


def descriptors(kv_cache: torch.Tensor, block_n: int = BLOCK_N):
    """The three bulk-copy descriptors over a contiguous 16-bit cache ``[num_blocks, block_size, 576]``
    viewed as ``[num_blocks * block_size, 576]``: latent halves ``[block_n, 256]`` (read at columns 0
    and 256) and rope ``[block_n, 64]`` (at 512), 128-byte swizzled as the kernel's shared tiles."""
    flat = kv_cache.view(-1, kv_cache.shape[2])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    shape, strides = list(flat.shape), list(flat.stride())
    return (GluonTensorDescriptor(flat, shape, strides, [block_n, HALF], layout),
            GluonTensorDescriptor(flat, shape, strides, [block_n, HALF], layout),
            GluonTensorDescriptor(flat, shape, strides, [block_n, ROPE], layout))


def launch(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
           part_acc: torch.Tensor, part_ml: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           block_tables: torch.Tensor, qk_scale: float, row_blocks: int, num_splits: int, block_n: int = BLOCK_N,
           stages: int = STAGES, p_bufs: int = P_BUFS, schedule: Optional[str] = None,
           l2_ahead: Optional[int] = None) -> None:
    """Launch the dense kernel over ``(row_blocks, num_splits, num_seqs)`` programs (64 (query row,
    head) pairs each). Tensors as :func:`mtpspec.ops.mla_attention.mla_attention` takes them:
    ``q_latent [T, H, 512]`` / ``q_pe [T, H, 64]`` fp16 or bf16, ``kv_cache [num_blocks, block_size,
    576]`` of that dtype, ``query_start_loc [num_seqs + 1]`` / ``seq_lens [num_seqs]`` / ``block_tables
    [num_seqs, max_blocks]`` int32 or int64; ``qk_scale`` = softmax scale x log2(e). ``out [T, H,
    512]`` / ``part_acc [T, H, num_splits, 512]`` fp32 / ``part_ml [T, H, num_splits, 2]`` fp32 as
    :func:`mtpspec.ops.paged_common.split_outputs` makes them. The caller checked :func:`supported`
    and runs the combine. No host sync.
    ``block_n`` / ``stages`` / ``p_bufs``: tuning overrides (keys per tile, key-tile ring slots, P
    buffers; the ``"split"`` schedule's); they must fit the 227 KB of shared memory (the compile
    fails otherwise). ``l2_ahead``: the L2 prefetch distance in tiles (split / split-pv; default
    :data:`L2_AHEAD`, 0 none). ``schedule``: ``"auto"`` (:func:`dense_schedule`), ``"split"``, ``"split-pv"`` (2
    stages, 1 P buffer), ``"seesaw"`` or ``"seesaw-r1"`` (default :data:`DENSE_SCHEDULE`).

    Raises:
        ValueError: an unknown ``schedule``, ``"split-pv"`` with other than 2 stages and 1 P buffer, or a
            negative ``l2_ahead`` (each before any launch)."""
    nh = q_latent.shape[1]
    l2_ahead = L2_AHEAD if l2_ahead is None else int(l2_ahead)
    if l2_ahead < 0:
        raise ValueError(f"launch: l2_ahead must be >= 0 (key tiles), got {l2_ahead}")
    schedule = dense_schedule(row_blocks, DENSE_SCHEDULE if schedule is None else schedule,
                              pv_shape=stages == 2 and p_bufs == 1)
    if schedule in ("seesaw", "seesaw-r1"):
        k0, k1, kr = descriptors(kv_cache, BLOCK_N)
        _mla_seesaw_kernel[(row_blocks, num_splits, seq_lens.shape[0])](
            q_latent, q_pe, k0, k1, kr, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables, qk_scale,
            num_splits, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
            out.stride(1), block_tables.stride(0), nh * num_splits, num_splits,
            NUM_HEADS=nh, CACHE_BLOCK=kv_cache.shape[1], SPLIT=num_splits > 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            HALF=HALF, LORA=LORA, ROPE=ROPE, WG1_REGS=SEESAW_WG1_REGS, ONE_RESCALE=schedule == "seesaw-r1",
            num_warps=4)
        return
    if schedule not in ("split", "split-pv"):
        raise ValueError(f"launch: schedule must be 'auto', 'split', 'split-pv', 'seesaw' or 'seesaw-r1', "
                         f"got {schedule!r}")
    if schedule == "split-pv" and (stages != 2 or p_bufs != 1):
        raise ValueError(f"launch: the 'split-pv' schedule takes 2 stages and 1 P buffer, got {stages} and {p_bufs}")
    k0, k1, kr = descriptors(kv_cache, block_n)
    _mla_ws_kernel[(row_blocks, num_splits, seq_lens.shape[0])](
        q_latent, q_pe, k0, k1, kr, kv_cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables, qk_scale,
        num_splits, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), nh * num_splits, num_splits,
        NUM_HEADS=nh, CACHE_BLOCK=kv_cache.shape[1], SPLIT=num_splits > 1, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        STAGES=stages, P_BUFS=p_bufs, HALF=HALF, LORA=LORA, ROPE=ROPE, WG1_REGS=WG1_REGS, PRODUCER_REGS=PRODUCER_REGS,
        PV_LAG=schedule == "split-pv", L2_AHEAD=l2_ahead, num_warps=4)


def dense_schedule(row_blocks: int, schedule: str = "auto", pv_shape: bool = True) -> str:
    """The dense schedule :func:`launch` runs: ``schedule`` itself unless ``"auto"``, then ``"split-pv"``
    for ``row_blocks >= PV_ROW_BLOCKS`` (query rows x heads of a sequence > 192: the tensor cores'
    time above the keys' read, where overlapping the value product with the softmax pays) and
    ``"split"`` below or where the launch shape is not split-pv's (``pv_shape`` False: other than 2
    key slots and 1 P buffer). See :data:`DENSE_SCHEDULE` for the timings."""
    if schedule != "auto":
        return schedule
    return "split-pv" if pv_shape and row_blocks >= PV_ROW_BLOCKS else "split"


def dense_plan(num_seqs: int, max_query_len: int, num_heads: int, max_seq_len: int, sms: int,
               num_splits: Optional[int] = None) -> dict:
    """``dict(row_blocks, num_splits)`` of :func:`launch` from static sizes (CUDA-graph safe):
    ``ceil(max_query_len * num_heads / 64)`` row blocks (fewer than 64 pairs, e.g. 16 heads x 1 row:
    one padded block; the kernel is memory-bound there, the padding rows cost tensor-core time only);
    unless given, the splits that fill one wave of programs, ``sms // (num_seqs * row_blocks)``, at
    most ``ceil(max_seq_len / 256)`` and 32, at least 1 (a second, partial wave cost 20-25% in the
    Triton kernel's sweeps; 16 x 4 on the H200: 1 / 2 / 4 splits 0.247 / 0.164 / 0.179 ms).

    Raises:
        ValueError: a given ``num_splits`` below 1."""
    row_blocks = -(-max(1, max_query_len * num_heads) // BLOCK_M)
    if num_splits is None:
        num_splits = max(1, min(sms // max(1, num_seqs * row_blocks), -(-max(1, max_seq_len) // 256), 32))
    elif int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return dict(row_blocks=row_blocks, num_splits=int(num_splits))


def sparse_supported(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     topk_slots: torch.Tensor) -> bool:
    """Whether :func:`launch_sparse` can run these tensors: any cache strides whose rows are 16-byte
    aligned (rows are gathered by 16-byte copies), int32 / int64 slot ids on the GPU with unit
    stride, and what :func:`supported` needs but the contiguity and block size."""
    return (_hopper_latent(q_latent, q_pe, kv_cache) and topk_slots.is_cuda
            and topk_slots.dtype in (torch.int32, torch.int64)
            and (topk_slots.shape[1] <= 1 or topk_slots.stride(1) == 1))


def sparse_plan(num_tokens: int, num_heads: int, topk: int, sms: int, num_splits: Optional[int] = None) -> dict:
    """``dict(head_blocks, num_splits)`` of :func:`launch_sparse` from static sizes: ``ceil(num_heads
    / 64)`` head blocks; unless given, the splits that fill one wave of programs (one per SM:
    ``sms // (num_tokens * head_blocks)``), at most ``ceil(topk / 256)`` and 32, at least 1.

    Raises:
        ValueError: a given ``num_splits`` below 1."""
    head_blocks = -(-max(1, num_heads) // BLOCK_M)
    if num_splits is None:
        num_splits = max(1, min(sms // max(1, num_tokens * head_blocks), -(-max(1, topk) // 256), 32))
    elif int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return dict(head_blocks=head_blocks, num_splits=int(num_splits))


def launch_sparse(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor,
                  out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, qk_scale: float, head_blocks: int,
                  num_splits: int, block_n: int = SPARSE_BLOCK_N, stages: int = SPARSE_STAGES,
                  p_bufs: int = SPARSE_P_BUFS, ahead: int = SPARSE_AHEAD) -> None:
    """Sparse MLA (DeepSeek-V3.2 paper, sec. 2.1; :func:`mtpspec.ops.sparse_mla_attention.sparse_mla_attention`'s
    operation): ``(head_blocks, num_splits, T)`` programs of 64 heads of one token row over a split
    of its selected slots, gathered into shared memory by a 4-warp producer. ``q_latent [T, H, 512]``
    / ``q_pe [T, H, 64]`` fp16 or bf16, ``kv_cache [num_blocks, block_size, 576]`` of that dtype,
    ``topk_slots [T, K]`` int32 / int64 global slots (``< 0`` or past the cache: unused);
    ``qk_scale`` = softmax scale x log2(e); ``out`` / ``part_acc`` / ``part_ml`` as
    :func:`~mtpspec.ops.paged_common.split_outputs` makes them for ``BLOCK_L = 512``.
    The caller checked :func:`sparse_supported` and runs the combine. ``block_n`` / ``stages`` /
    ``p_bufs``: tuning overrides, as :func:`launch`; ``ahead``: ``0``, each gathering thread's copies
    arrive on the tile's barrier as they land (``cp.async.mbarrier.arrive``: every slot in flight),
    or the producer waits for the tile ``ahead`` behind the one it issued before completing its
    barrier; ``0 <= ahead <= stages - 1``, else ValueError (a slot is refilled only once consumed)."""
    if not 0 <= ahead <= stages - 1:
        raise ValueError(f"launch_sparse: need 0 <= ahead <= stages - 1, got ahead {ahead}, stages {stages}")
    t, nh = q_latent.shape[0], q_latent.shape[1]
    _sparse_mla_ws_kernel[(head_blocks, num_splits, t)](
        q_latent, q_pe, kv_cache, topk_slots, out, part_acc, part_ml, qk_scale, topk_slots.shape[1],
        kv_cache.shape[0] * kv_cache.shape[1], num_splits, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0),
        q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1), topk_slots.stride(0), out.stride(0), out.stride(1),
        nh * num_splits, num_splits, NUM_HEADS=nh, CACHE_BLOCK=kv_cache.shape[1], SPLIT=num_splits > 1,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages, P_BUFS=p_bufs, HALF=HALF, LORA=LORA, ROPE=ROPE,
        WG1_REGS=SPARSE_WG1_REGS, PRODUCER_REGS=SPARSE_PRODUCER_REGS, AHEAD=ahead, num_warps=4)
