"""Routed SwiGLU experts as two expert-grouped GEMMs (Triton), with no host sync.

``out[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t))`` with ``e = topk_ids[t, j]``
(Shazeer 2020, "GLU Variants Improve Transformer", eq. 5, per expert; the mixture as in
Shazeer et al. 2017, "Outrageously Large Neural Networks", eq. 1).

Plan (the grouping idea of fused MoE GEMM kernels such as vLLM's ``fused_moe``; written here from
the description, not from its code):

1. :func:`moe_align`, on the device, sync-free (one Triton program up to
   ``ALIGN_KERNEL_MAX_PAIRS`` pairs: a histogram, its prefix sum and each pair's rank among the
   earlier pairs of its expert; a chain of torch ops above, about 20 launches): the
   ``N = num_tokens * top_k`` (token, expert) pairs are ordered by expert (stable), and each
   expert's run is padded to a multiple of ``BLOCK_M`` with the sentinel ``N``. The padded
   length has the static bound
   ``P = N + min(N, E) * (BLOCK_M - 1)`` (at most ``min(N, E)`` experts are non-empty), so the
   grid is fixed by shapes; ``block_expert[b]`` is the expert of block ``b`` (``E`` past the end:
   the program exits).
2. Kernel 1, grid ``(P / BLOCK_M, ceil(I / BLOCK_N))``: one block of pairs of one expert times a
   column tile of its gate and up rows, ``silu(gate) * up`` in fp32, stored per pair
   (``[N, I]``, weight dtype).
3. Kernel 2, grid ``(P / BLOCK_M, ceil(H / BLOCK_N))``: the down projection of the same pairs,
   times the pair's routing weight, stored per pair in fp32 (``[N, H]``).
4. ``out = y.view(T, top_k, H).sum(1)`` (fixed order j = 0, 1, ..: deterministic), cast to x's dtype,
   in one Triton launch (:func:`sum_pairs`; torch's sum + cast were two).

Each program reads its expert's weight tiles once for up to ``BLOCK_M`` pairs, so a decode batch
reads only the experts it routes to (about ``min(N, E)`` of them), unlike an all-experts dense
pass. The launch shape depends only on ``(num_tokens, top_k, E, H, I)``: CUDA-graph capturable.

Dispatch: Triton on CUDA tensors and on CPU tensors under ``TRITON_INTERPRET=1``
(:func:`~mtpspec.ops.triton_utils.use_triton`); :func:`moe_experts_ref` otherwise.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from mtpspec.ops.triton_utils import FLOAT_DTYPES, HAS_TRITON, LazyKernel, cdiv, interpreting, tl, triton, use_triton

#: Pair-block height: 16 when experts average fewer than ``LARGE_BLOCK_M`` pairs, else 64.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
#: Launch shapes ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of the two kernels, per pair-block
#: height: output columns and reduction depth per tile. 16-row blocks are decode and verify sizes,
#: where the kernels stream expert weights (memory-bound); their shapes are the best geometric mean
#: over GLM-4.5-Air and DeepSeek-V3 widths at 1, 4 and 16 tokens of
#: ``benchmarks/bench_moe_decode.py --sweep`` on an H200 (2026-12-04, BENCHMARKS.md): gate_up 5%,
#: down 1% below (64, 64, 4, 3). 64-row blocks keep that older shape (not swept).
LAUNCH = {
    ("gate_up", SMALL_BLOCK_M): (32, 128, 4, 3),
    ("down", SMALL_BLOCK_M): (64, 128, 4, 3),
    ("gate_up", LARGE_BLOCK_M): (64, 64, 4, 3),
    ("down", LARGE_BLOCK_M): (64, 64, 4, 3),
}
#: :func:`moe_align` runs as one Triton program up to this many pairs (its two passes over them
#: take :func:`align_chunk` pairs a step), as torch ops above.
ALIGN_KERNEL_MAX_PAIRS = 4096


def align_chunk(num_pairs: int) -> int:
    """Pairs per step of the align kernel's passes (a power of two, 16..128): its rank step
    compares each pair of a chunk with the chunk's others, ``CHUNK^2`` per step."""
    return max(16, min(128, triton.next_power_of_2(num_pairs))) if HAS_TRITON else 128


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Pair-block height for ``num_pairs`` pairs over ``num_experts`` experts (static)."""
    return SMALL_BLOCK_M if num_pairs < LARGE_BLOCK_M * num_experts else LARGE_BLOCK_M


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the ``N = topk_ids.numel()`` pairs by expert, each expert padded to ``block_m`` rows.

    Args:
        topk_ids: ``[num_tokens, top_k]`` int, values in ``[0, num_experts)``.
        num_experts: ``E``.
        block_m: block height.

    Returns:
        ``(sorted_pairs [P] int32, block_expert [P / block_m] int32)`` with ``P = ceil((N +
        min(N, E) * (block_m - 1)) / block_m) * block_m``: pair indices (``t * top_k + j``)
        grouped by expert in ascending expert order (``N`` = padding), and each block's expert
        (``E`` for blocks past the last expert's run). Sync-free (fixed shapes).
    """
    n = topk_ids.numel()
    p = cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    if 0 < n <= ALIGN_KERNEL_MAX_PAIRS and use_triton(topk_ids):
        return _moe_align_kernel(topk_ids, num_experts, block_m, p)
    flat = topk_ids.reshape(-1).long()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    before = torch.cumsum(counts, 0) - counts  # pairs of lower experts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat.index_select(0, order)
    dest = (ends - padded).index_select(0, e_sorted) + torch.arange(n, device=dev) - before.index_select(0, e_sorted)
    sorted_pairs = torch.full((p,), n, dtype=torch.int32, device=dev)
    sorted_pairs.index_copy_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, p, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def _moe_align_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int, p: int
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_align` as one Triton program (same outputs, bit for bit)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int32)
    flat = flat.contiguous()
    n = flat.shape[0]
    sorted_pairs = torch.empty(p, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(p // block_m, dtype=torch.int32, device=flat.device)
    _align[(1,)](flat, sorted_pairs, block_expert, n, num_experts, p, p // block_m, BLOCK_M=block_m,
                 CHUNK=align_chunk(n), E_P2=triton.next_power_of_2(num_experts + 1), FILL=1024, num_warps=8)
    return sorted_pairs, block_expert


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference (sync-free gather form): each pair's expert weights are gathered
    (``w13[topk_ids]``, ``w2[topk_ids]``) and applied with batched matmuls; fp32 combine.
    Memory ``O(num_tokens * top_k * expert_size)``: for small batches only."""
    t, k = topk_ids.shape
    h = x.shape[1]
    n = t * k
    if n == 0:
        return x.new_zeros(t, h)
    flat = topk_ids.reshape(-1)
    xr = x.unsqueeze(1).expand(t, k, h).reshape(n, h, 1)
    gate_up = torch.bmm(w13.index_select(0, flat), xr).squeeze(-1)  # [n, 2 I]
    d = gate_up.shape[1] // 2
    act = F.silu(gate_up[:, :d]) * gate_up[:, d:]
    y = torch.bmm(w2.index_select(0, flat), act.unsqueeze(-1)).squeeze(-1)  # [n, H]
    return (y.float().view(t, k, h) * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)


if HAS_TRITON:
    from mtpspec.ops.triton_helpers import pdl_begin, round_to_dtype

    def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_slots, num_blocks,
                      BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr,
                      PDL: tl.constexpr):
        pdl_begin(PDL)
        # One program, the pairs taken CHUNK at a time. Padding pairs count in bin num_experts (< E_P2),
        # past every real expert. Pass 1: blocks per expert; pass 2: each pair's rank among the earlier
        # pairs of its expert = pairs of it in earlier chunks (running histogram) + in its own chunk.
        ex = tl.arange(0, E_P2)
        cq = tl.arange(0, CHUNK)
        counts = tl.zeros([E_P2], dtype=tl.int32)
        for q0 in range(0, num_pairs, CHUNK):
            idq = tl.load(ids_ptr + q0 + cq, mask=q0 + cq < num_pairs, other=num_experts).to(tl.int32)
            counts += tl.histogram(idq, E_P2)
        nblk = tl.where(ex < num_experts, (counts + BLOCK_M - 1) // BLOCK_M, 0)
        first = tl.cumsum(nblk, 0) - nblk  # each expert's first block
        for s0 in range(0, num_slots, FILL):  # padding everywhere, then the real entries over it
            sl = s0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + sl, tl.full([FILL], 0, tl.int32) + num_pairs, mask=sl < num_slots)
        for b0 in range(0, num_blocks, FILL):
            bl = b0 + tl.arange(0, FILL)
            tl.store(block_expert_ptr + bl, tl.full([FILL], 0, tl.int32) + num_experts, mask=bl < num_blocks)
        tl.debug_barrier()
        for j in range(0, tl.max(nblk, 0)):  # each expert's j-th block
            tl.store(block_expert_ptr + first + j, ex, mask=j < nblk)
        seen = tl.zeros([E_P2], dtype=tl.int32)  # pairs of each expert in earlier chunks
        for q0 in range(0, num_pairs, CHUNK):
            q = q0 + cq
            idq = tl.load(ids_ptr + q, mask=q < num_pairs, other=num_experts).to(tl.int32)
            same = (idq[None, :] == idq[:, None]) & (cq[None, :] < cq[:, None])
            rank = tl.sum(same.to(tl.int32), 1) + tl.gather(seen, idq, 0)
            tl.store(sorted_ptr + tl.gather(first, idq, 0) * BLOCK_M + rank, q, mask=q < num_pairs)
            seen += tl.histogram(idq, E_P2)

    def _gate_up_kernel(x_ptr, w_ptr, inter_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, hidden,
                        inter_size, stride_xt, stride_we, stride_wn, stride_it,
                        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_BITS: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= num_experts:  # past the last expert's run
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok_m = pair < num_pairs
        tok = (pair // TOPK).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_n = offs_n < inter_size
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok_k = offs_k < hidden
            a = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :], mask=ok_m[:, None] & ok_k[None, :],
                        other=0.0)
            wk = ok_k[:, None] & ok_n[None, :]
            wg = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=wk, other=0.0)
            wu = tl.load(w_base + (inter_size + offs_n[None, :]).to(tl.int64) * stride_wn + offs_k[:, None],
                         mask=wk, other=0.0)
            if DOT_FP32:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g += tl.dot(a, wg, input_precision=PRECISION)
            acc_u += tl.dot(a, wu, input_precision=PRECISION)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        # BF16_BY_BITS: round to nearest even by integer ops (the interpreter truncates)
        act_low = round_to_dtype(act, inter_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(inter_ptr + pair[:, None].to(tl.int64) * stride_it + offs_n[None, :], act_low,
                 mask=ok_m[:, None] & ok_n[None, :])

    def _down_kernel(inter_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr, num_pairs, num_experts,
                     hidden, inter_size, stride_it, stride_we, stride_wn, stride_yt,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= num_experts:
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok_m = pair < num_pairs
        row = pair.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_n = offs_n < hidden
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok_k = offs_k < inter_size
            a = tl.load(inter_ptr + row[:, None] * stride_it + offs_k[None, :], mask=ok_m[:, None] & ok_k[None, :],
                        other=0.0)
            w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=ok_k[:, None] & ok_n[None, :], other=0.0)
            if DOT_FP32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        wt = tl.load(topk_w_ptr + row, mask=ok_m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row[:, None] * stride_yt + offs_n[None, :], acc * wt[:, None],
                 mask=ok_m[:, None] & ok_n[None, :])

    def _sum_pairs_kernel(y_ptr, out_ptr, hidden, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
                          BF16_BY_BITS: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # out[t, cols] = sum_j y[t * TOPK + j, cols] in fp32, j in order, cast to out's dtype
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (t * TOPK + j) * hidden + cols, mask=ok, other=0.0)
        # BF16_BY_BITS: round to nearest even by integer ops (the interpreter truncates)
        tl.store(out_ptr + t * hidden + cols, round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS), mask=ok)

    _sum_pairs = LazyKernel(_sum_pairs_kernel, pdl=True)
    _align = LazyKernel(_align_kernel, pdl=True)
    _gate_up = LazyKernel(_gate_up_kernel, pdl=True)
    _down = LazyKernel(_down_kernel, pdl=True)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, launch_gate_up: Optional[Tuple[int, int, int, int]] = None,
                launch_down: Optional[Tuple[int, int, int, int]] = None) -> torch.Tensor:
    """Routed SwiGLU experts of this rank (see the module docstring).

    Args:
        x: ``[num_tokens, H]`` fp16/bf16/fp32, unit stride in ``H``.
        w13: ``[E, 2 I, H]`` per expert ``[gate | up]`` rows, x's dtype, unit stride in ``H``.
        w2: ``[E, H, I]``, x's dtype, unit stride in ``I``.
        topk_weights: ``[num_tokens, top_k]`` (any float; used in fp32).
        topk_ids: ``[num_tokens, top_k]`` int in ``[0, E)`` (out-of-range ids are undefined behaviour).
        launch_gate_up, launch_down: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` overriding
            :data:`LAUNCH` (benchmark sweeps).

    Returns:
        ``[num_tokens, H]`` in x's dtype.

    Raises:
        ValueError / TypeError: inconsistent shapes, dtypes or strides.

    Scratch: ``[N, I]`` (weight dtype) and ``[N, H]`` fp32 with ``N = num_tokens * top_k``.
    """
    t, h = x.shape
    e, two_i, h2 = w13.shape
    if h2 != h or two_i % 2 or w2.shape != (e, h, two_i // 2) or topk_ids.shape != topk_weights.shape \
            or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"moe_experts: x {list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)}, topk_weights "
                         f"{list(topk_weights.shape)}, topk_ids {list(topk_ids.shape)} do not fit together")
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"moe_experts: x, w13, w2 must share one of float16/bfloat16/float32, got {x.dtype}, "
                        f"{w13.dtype}, {w2.dtype}")
    if not use_triton(x, w13, w2):
        return moe_experts_ref(x, w13, w2, topk_weights, topk_ids)
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_experts: x, w13 and w2 need unit stride in their last dimension")
    k = topk_ids.shape[1]
    n = t * k
    if n == 0:
        return x.new_zeros(t, h)
    i = two_i // 2
    block_m = moe_block_m(n, e)
    sorted_pairs, block_expert = moe_align(topk_ids, e, block_m)
    inter = torch.empty(n, i, dtype=x.dtype, device=x.device)
    y = torch.empty(n, h, dtype=torch.float32, device=x.device)
    bf16_interp = interpreting() and x.dtype == torch.bfloat16  # interpreter: bf16 tl.dot is wrong
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    n_blocks = block_expert.shape[0]
    bn, bk, warps, stages = launch_gate_up or LAUNCH["gate_up", block_m]
    _gate_up[(n_blocks, cdiv(i, bn))](
        x, w13, inter, sorted_pairs, block_expert, n, e, h, i, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOPK=k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=bf16_interp,
        PRECISION=precision, BF16_BY_BITS=bf16_interp, num_warps=warps, num_stages=stages)
    bn, bk, warps, stages = launch_down or LAUNCH["down", block_m]
    _down[(n_blocks, cdiv(h, bn))](
        inter, w2, y, sorted_pairs, block_expert, topk_weights.float().contiguous(), n, e, h, i, inter.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        DOT_FP32=bf16_interp, PRECISION=precision, num_warps=warps, num_stages=stages)
    return sum_pairs(y, t, k, x.dtype)


def sum_pairs(y: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """``y.view(T, top_k, H).sum(1).to(dtype)`` for contiguous fp32 ``y [T * top_k, H]``, summed in
    the order j = 0 .. top_k - 1 in fp32; one Triton launch where :func:`use_triton` (torch's sum
    and cast otherwise). Returns ``[T, H]`` of ``dtype``."""
    h = y.shape[1]
    if not use_triton(y) or not y.is_contiguous():
        return y.view(num_tokens, top_k, h).sum(1).to(dtype)
    out = torch.empty(num_tokens, h, dtype=dtype, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(h))
        _sum_pairs[(num_tokens, cdiv(h, block))](y, out, h, TOPK=top_k, BLOCK_H=block,
                                                 BF16_BY_BITS=interpreting() and dtype == torch.bfloat16, num_warps=4)
    return out


__all__ = ["moe_align", "moe_block_m", "moe_experts", "moe_experts_ref", "sum_pairs"]
