"""Sparse MLA for few heads with the keys as the MMA's M dimension (Hopper, Gluon): DeepSeek-V3.2 at tp 8.

:func:`mtpspec.ops.mla_gluon.launch_sparse` puts a token row's heads on the warpgroup MMA's M
dimension, whose smallest size is 64: with 16 heads (DeepSeek-V3.2's 128 at tensor parallelism 8,
every MTP draft step and every decode) 48 of a program's 64 matrix rows are zeros, so each 64-key
tile costs the tensor cores what 64 heads would (~1.5 us of an SM) while its gather at the
bandwidth's pace takes 1.1 to 2.3 us: one program per token row and split leaves too little room to
cover the fixed costs, and fewer splits would make the tensor cores the limit. Here the operands
swap sides (the transposed products, same arithmetic)::

    S^T [keys, heads] = K [keys, 576] . Q^T [576, heads]        (m64 nH k16 warpgroup MMAs)
    P^T = softmax over the keys (per head: a column of S^T), online
    O^T [512, heads] += V^T [512, keys] . P^T [keys, heads]     (V^T: the key tile read transposed)

so the MMA's N is the head count padded to 16 or 32 (:data:`KM_MAX_HEADS`) and a 64-key tile costs
the tensor cores a quarter (16 heads) of the 64-row product. Operands: the gathered key tile
(shared memory, the latent halves and the rope part, as the other sparse kernel's producer
:func:`mtpspec.ops.mla_gluon._gather_producer` fills them) is the A operand of the scores and,
read transposed (16-bit wgmma takes an MN-major A from shared memory), of the values; Q (read
K-major) and P^T (stored ``[keys, heads]``, read MN-major) are the B operands. One consumer warpgroup (scores, softmax,
values; the O^T accumulator is 4 x heads fp32 registers a thread) and the 4-warp gathering
producer; programs ``(token row, split)`` (the splits: :func:`mtpspec.ops.mla_gluon.sparse_plan` for one
head block); the split partials and :func:`combine_splits` as the
other sparse kernel. The online softmax is FlashAttention-2's (Dao 2023, Algorithm 1) with its
statistics per column; the scores' mask is the selection (an entry ``< 0`` or past the cache is
unused; the producer zero-fills its row).

Opt-in until measured on a GPU (``MTPSPEC_MLA_SPARSE_KM=1``, or ``sparse_mla_attention(...,
impl="gluon-km")``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mtpspec.ops import mla_gluon as mg
from mtpspec.ops.triton_utils import next_power_of_2

#: Head counts this kernel takes (the MMA's N, padded to a power of two >= 16); above it the
#: O^T accumulator (4 x N fp32 registers a thread) would not fit beside the scores.
KM_MAX_HEADS = 32
KM_BLOCK_N = 64
KM_STAGES = 2
KM_PRODUCER_REGS = mg.SPARSE_PRODUCER_REGS
#: Sparse MLA at <= KM_MAX_HEADS heads takes this kernel where it is supported (opt-in: not yet run on a GPU).
USE_KM = os.environ.get("MTPSPEC_MLA_SPARSE_KM", "0") == "1"


def padded_heads(num_heads: int) -> int:
    """The MMA's N for ``num_heads`` heads: a power of two >= 16."""
    return max(16, next_power_of_2(num_heads))


def km_supported(num_heads: int) -> bool:
    """Whether :func:`launch_sparse_km` takes ``num_heads`` heads (1 to :data:`KM_MAX_HEADS`)."""
    return mg.HAS_GLUON and 1 <= num_heads <= KM_MAX_HEADS


if mg.HAS_GLUON:
    gl, gluon, mbarrier = mg.gl, mg.gluon, mg.mbarrier
    fence_async_shared, warpgroup_mma = mg.fence_async_shared, mg.warpgroup_mma
    warpgroup_mma_wait = mg.warpgroup_mma_wait

    @gluon.jit
    def _km_consumer(ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, k_ready, k_free, out_ptr,
                     part_acc_ptr, part_ml_ptr, slots_row, n_slots, t, split, k_lo, k_hi, n_tiles, qk_scale,
                     stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt, stride_ph,
                     NUM_HEADS: gl.constexpr, NH: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     HALF: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, SPLIT: gl.constexpr):
        """The consumer warpgroup: the token row's query (heads past ``NUM_HEADS`` zero) into shared
        memory under the producer's first gathers, then per key tile the transposed scores, the
        column-wise online softmax and the transposed value products; then O^T / l (or the split's
        partials) stored."""
        dtype: gl.constexpr = ql_ptr.dtype.element_ty
        # the token row's NH query rows (heads past NUM_HEADS zero): the heads-as-M kernel's sparse rows
        mg._load_q(qbuf0, qbuf1, qbufr, ql_ptr, qp_ptr, 0, t, 1, 0, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                   NUM_HEADS, NH, True, HALF, ROPE)

        # one accumulator layout for S^T [BLOCK_N, NH] and O^T [HALF, NH]: rows (keys / latent
        # columns) over the 4 warps, heads along N, so the softmax's per-head factors need no shuffle
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
        key_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        head_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        m_i = gl.full([NH], float("-inf"), gl.float32, layout=head_l)  # raw score units
        # the running sums stay per key row (summed over the keys once, after the loop): one cross-warp
        # reduction a tile (the max), not two
        l_rows = gl.zeros([BLOCK_N, NH], gl.float32, layout=acc_l)
        o0 = gl.zeros([HALF, NH], gl.float32, layout=acc_l)
        o1 = gl.zeros([HALF, NH], gl.float32, layout=acc_l)
        for i in range(n_tiles):
            s = i % STAGES
            offs = k_lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
            slot = gl.load(slots_row + offs, mask=offs < k_hi, other=-1)  # in flight under the wait
            mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
            fence_async_shared()  # gathered by cp.async (generic proxy), read by wgmma (async proxy)
            sc = gl.zeros([BLOCK_N, NH], gl.float32, layout=acc_l)
            sc = warpgroup_mma(kbuf0.index(s), qbuf0.permute((1, 0)), sc, use_acc=False, is_async=True)
            sc = warpgroup_mma(kbuf1.index(s), qbuf1.permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma(kbufr.index(s), qbufr.permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(0, deps=[sc])
            ok = (slot >= 0) & (slot < n_slots)
            sc = gl.where(ok[:, None], sc, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)  # a head with no key yet: p = 0
            p = gl.exp2(sc * qk_scale - m_safe[None, :])
            alpha = gl.exp2(m_i * qk_scale - m_safe)
            l_rows = l_rows * alpha[None, :] + p
            m_i = m_new
            pbuf.store(p.to(dtype))  # P^T [keys, heads]: the B operand, heads contiguous (MN-major)
            fence_async_shared()
            o0 = o0 * alpha[None, :]
            o1 = o1 * alpha[None, :]
            o0 = warpgroup_mma(kbuf0.index(s).permute((1, 0)), pbuf, o0, is_async=True)
            o1 = warpgroup_mma(kbuf1.index(s).permute((1, 0)), pbuf, o1, is_async=True)
            o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
            mbarrier.arrive(k_free.index(s), count=1)

        # O^T [512, heads] -> out[t, head, :] (or the split's partials): through a layout whose
        # threads hold consecutive latent columns of one head, so the stores are 16-byte and coalesced
        st_l: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        hh = gl.arange(0, NH, layout=gl.SliceLayout(0, st_l))
        cc = gl.arange(0, HALF, layout=gl.SliceLayout(1, st_l))
        h_ok = hh < NUM_HEADS
        l_st = gl.convert_layout(gl.sum(l_rows, axis=0), gl.SliceLayout(0, st_l))
        if SPLIT:
            pbase = t.to(gl.int64) * stride_pt + hh * stride_ph + split
            dst = part_acc_ptr + pbase[None, :] * LORA + cc[:, None]
            gl.store(dst, gl.convert_layout(o0, st_l), mask=h_ok[None, :])
            gl.store(dst + HALF, gl.convert_layout(o1, st_l), mask=h_ok[None, :])
            gl.store(part_ml_ptr + 2 * pbase, gl.convert_layout(m_i * qk_scale, gl.SliceLayout(0, st_l)), mask=h_ok)
            gl.store(part_ml_ptr + 2 * pbase + 1, l_st, mask=h_ok)
        else:
            inv = 1.0 / gl.where(l_st > 0, l_st, 1.0)
            dst = out_ptr + t.to(gl.int64) * stride_ot + hh[None, :] * stride_oh + cc[:, None]
            gl.store(dst, (gl.convert_layout(o0, st_l) * inv[None, :]).to(dtype), mask=h_ok[None, :])
            gl.store(dst + HALF, (gl.convert_layout(o1, st_l) * inv[None, :]).to(dtype), mask=h_ok[None, :])

    @gluon.jit
    def _sparse_km_kernel(ql_ptr, qp_ptr, kv_ptr, slots_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                          num_topk, n_slots, num_splits, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                          stride_kb, stride_ks, stride_st, stride_ot, stride_oh, stride_pt, stride_ph,
                          NUM_HEADS: gl.constexpr, NH: gl.constexpr, CACHE_BLOCK: gl.constexpr, SPLIT: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr, LORA: gl.constexpr,
                          ROPE: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        # program (token row t, split of its selection): all of the row's heads (rows on the grid's x,
        # whose limit is 2^31 - 1: prefill-sized batches)
        t = gl.program_id(0)
        split = gl.program_id(1)
        chunk = gl.cdiv(gl.cdiv(num_topk, num_splits), BLOCK_N) * BLOCK_N
        k_lo = split * chunk
        k_hi = gl.minimum(k_lo + chunk, num_topk)
        n_tiles = gl.maximum(gl.cdiv(k_hi - k_lo, BLOCK_N), 0)
        dtype: gl.constexpr = ql_ptr.dtype.element_ty
        nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * NH, element_bitwidth=16, rank=2)
        qbuf0 = gl.allocate_shared_memory(dtype, [NH, HALF], nvmma)
        qbuf1 = gl.allocate_shared_memory(dtype, [NH, HALF], nvmma)
        qbufr = gl.allocate_shared_memory(dtype, [NH, ROPE], nvmma)
        kbuf0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], nvmma)
        kbuf1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], nvmma)
        kbufr = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], nvmma)
        pbuf = gl.allocate_shared_memory(dtype, [BLOCK_N, NH], p_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=128)  # every gathering thread's copies arrive (AHEAD 0)
            mbarrier.init(k_free.index(i), count=1)  # one consumer warpgroup
        slots_row = slots_ptr + t.to(gl.int64) * stride_st
        gl.warp_specialize([
            (_km_consumer, (ql_ptr, qp_ptr, qbuf0, qbuf1, qbufr, kbuf0, kbuf1, kbufr, pbuf, k_ready, k_free, out_ptr,
                            part_acc_ptr, part_ml_ptr, slots_row, n_slots, t, split, k_lo, k_hi, n_tiles, qk_scale,
                            stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_pt,
                            stride_ph, NUM_HEADS, NH, BLOCK_N, STAGES, HALF, LORA, ROPE, SPLIT)),
            (mg._gather_producer, (kv_ptr, slots_row, n_slots, k_lo, k_hi, n_tiles, kbuf0, kbuf1, kbufr, k_ready,
                                   k_free, stride_kb, stride_ks, BLOCK_N, STAGES, CACHE_BLOCK, HALF, LORA, ROPE, 0)),
        ], [4], [PRODUCER_REGS])


def launch_sparse_km(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, topk_slots: torch.Tensor,
                     out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, qk_scale: float,
                     num_splits: int, stages: Optional[int] = None) -> None:
    """Sparse MLA of ``T`` token rows of at most :data:`KM_MAX_HEADS` heads, keys on the MMA's M
    dimension: ``(T, num_splits)`` programs. Tensors as :func:`mtpspec.ops.mla_gluon.launch_sparse`
    takes them (``q_latent [T, H, 512]`` / ``q_pe [T, H, 64]`` fp16 or bf16, ``kv_cache [num_blocks,
    block_size, 576]`` of that dtype, ``topk_slots [T, K]`` int32 / int64 global slots, ``< 0`` or
    past the cache unused; ``out`` / ``part_acc`` / ``part_ml`` from
    :func:`~mtpspec.ops.paged_common.split_outputs` with ``BLOCK_L = 512``); ``qk_scale`` = softmax
    scale x log2(e). The caller checked :func:`~mtpspec.ops.mla_gluon.sparse_supported` and runs the
    combine for ``num_splits > 1``. ``stages``: key-tile slots (default :data:`KM_STAGES`; 1 leaves
    room for two programs an SM).

    Raises:
        ValueError: more than :data:`KM_MAX_HEADS` heads, ``num_splits < 1``, ``stages`` not 1 or 2, or
            no Gluon."""
    t, nh = q_latent.shape[0], q_latent.shape[1]
    stages = KM_STAGES if stages is None else stages
    if not 1 <= nh <= KM_MAX_HEADS:
        raise ValueError(f"launch_sparse_km: 1 to {KM_MAX_HEADS} heads, got {nh}")
    if num_splits < 1 or stages not in (1, 2):
        raise ValueError(f"launch_sparse_km: need num_splits >= 1 and stages 1 or 2 (three 72 KiB key tiles "
                         f"overflow shared memory), got {num_splits}, {stages}")
    if not mg.HAS_GLUON:
        raise ValueError("launch_sparse_km: needs Triton's Gluon (Hopper API)")
    _sparse_km_kernel[(t, num_splits)](
        q_latent, q_pe, kv_cache, topk_slots, out, part_acc, part_ml, qk_scale, topk_slots.shape[1],
        kv_cache.shape[0] * kv_cache.shape[1], num_splits, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0),
        q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1), topk_slots.stride(0), out.stride(0), out.stride(1),
        nh * num_splits, num_splits, NUM_HEADS=nh, NH=padded_heads(nh), CACHE_BLOCK=kv_cache.shape[1],
        SPLIT=num_splits > 1, BLOCK_N=KM_BLOCK_N, STAGES=stages, HALF=mg.HALF, LORA=mg.LORA, ROPE=mg.ROPE,
        PRODUCER_REGS=KM_PRODUCER_REGS, num_warps=4)
