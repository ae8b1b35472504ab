"""FP8 block-scaled weights: block (de)quantisation and the w8a8 block-scaled GEMM.

Recipe (DeepSeek-V3 technical report, arXiv:2412.19437, sec. 3.3 "FP8 Training", "Fine-Grained
Quantization"; the format of DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 ``-FP8`` checkpoints and of
``transformers``' ``FineGrainedFP8Config``):

* weights ``W [N, K]`` are stored as E4M3 (``torch.float8_e4m3fn``) with one float32 scale per
  ``block_n x block_k`` block (128 x 128 in the released checkpoints):
  ``weight_scale_inv [ceil(N / block_n), ceil(K / block_k)]``, and
  ``W ~= float(weight) * weight_scale_inv`` broadcast per block. Quantising a block:
  ``scale_inv = amax(|W_block|) / 448`` (1.0 for an all-zero block, as ``transformers``),
  ``weight = e4m3(clamp(W / scale_inv, -448, 448))`` (nearest even);
* activations ``x [M, K]`` are quantised on the fly per token and per ``block_k``-channel group:
  ``s = max(amax(|x_group|), 1e-10) / 448``, ``x_q = e4m3(clamp(x / s, +-448))``;
* ``y[m, n] = sum_kb s_x[m, kb] * s_w[n // block_n, kb] * sum_{k in kb} x_q[m, k] w[n, k]``:
  each (token-group, weight-block) partial product accumulated in fp32, its two scales applied
  inside the K loop; the output in the activation dtype.

A layer may keep one scale row per weight row (``scale_block_n = 1``): mtpspec does this where
a tensor-parallel shard or a merged layer (gate | up) does not cut on ``block_n`` row boundaries
(:mod:`mtpspec.layers.linear`); the kernel takes the scale row of column ``n`` as
``n // scale_block_n`` either way.

Few rows (``M <= SWAP_AB_MAX_M``, decode) take a "swap AB" kernel: it computes ``out^T = W x^T``
with the weight tile as stored (``[BLOCK_N, BLOCK_K]``, K contiguous) as the dot's A operand
and the activations, quantised once in a pass of their own (or in its K loop:
``swap_fused``), as a 16-column B operand, split over K with the fp32 partials summed in a
fixed order; more rows take ``[BLOCK_M, BLOCK_N]`` output tiles. Same codes, scales and
per-group scaling either way: the paths differ in fp32 summation order only.

Dispatch (:func:`~mtpspec.ops.triton_utils.use_triton`): the Triton kernel on CUDA (fp8 tensor
cores where the GPU has them, sm_89+; an fp32 dot of the same fp8 values elsewhere) and on CPU
under ``TRITON_INTERPRET=1``; otherwise :func:`fp8_block_linear_ref`, which dequantises the
weight to the activation dtype and calls ``torch.nn.functional.linear`` (no activation
quantisation: the CPU path is the dequantised-weight model's math exactly). Experts
(:func:`fp8_moe_experts`): where the kernel runs, an expert-grouped variant of the same kernel
over :func:`mtpspec.ops.moe_gemm.moe_align`'s grouping (sync-free, CUDA-graph capturable: gate |
up for every (token, expert) pair, SiLU-and-mul in torch, down times the routing weight, a fixed
order sum); elsewhere :func:`fp8_experts_loop`, a loop over the routed experts calling the
dense op per expert (one host sync).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mtpspec.ops.argmax import num_sms
from mtpspec.ops.triton_utils import (FLOAT_DTYPES, HAS_TRITON, LazyKernel, cdiv, device_function, interpreting, tl,
                                     use_triton)

#: The stored weight dtype.
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3 value.
FP8_MAX = 448.0
#: Floor of an activation group's amax (an all-zero group gets a tiny, finite scale).
ACT_AMAX_EPS = 1e-10
#: The released checkpoints' block.
DEFAULT_BLOCK = (128, 128)


# ------------------------------------------------------------------------------------------- torch side
def scale_grid(shape: Sequence[int], block: Sequence[int]) -> Tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (``[..., N, K]``): leading dims kept,
    ``ceil(N / block_n), ceil(K / block_k)``."""
    *lead, n, k = shape
    return (*lead, cdiv(n, block[0]), cdiv(k, block[1]))


def expand_scales(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """Block scales ``[..., ceil(n / block_n), ceil(k / block_k)]`` repeated to ``[..., n, k]``.

    A block larger than its dim is repeated only ``n`` (``k``) times: the same result, without
    a ``block_n``-row (``block_k``-column) intermediate."""
    block_n, block_k = min(block_n, max(n, 1)), min(block_k, max(k, 1))
    return scale.repeat_interleave(block_n, dim=-2)[..., :n, :].repeat_interleave(block_k, dim=-1)[..., :k]


@torch.no_grad()
def quantize_weight_blocks(w: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise a weight (the writer's and the loader's on-the-fly recipe, module docstring).

    Args:
        w: ``[..., N, K]`` floating tensor (any leading dims, e.g. experts).
        block: ``(block_n, block_k)``.

    Returns:
        ``(weight [..., N, K] float8_e4m3fn, weight_scale_inv [..., ceil(N / bn), ceil(K / bk)]
        float32)``; partial edge blocks are quantised over the rows / columns they hold (a block
        dim at least the weight's is one block over the whole dim: scales ``[..., 1, ...]``, and
        memory as for a block of exactly that dim, however large the block asked for).

    Raises:
        ValueError: fewer than 2 dims or a non-positive block.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_weight_blocks: expected a [..., N, K] weight, got shape {list(w.shape)}")
    bn, bk = int(block[0]), int(block[1])
    if bn < 1 or bk < 1:
        raise ValueError(f"quantize_weight_blocks: block must be positive, got {list(block)}")
    *lead, n, k = w.shape
    gn, gk = cdiv(n, bn), cdiv(k, bk)
    # a block over a whole dim pads nothing: clamping it to the dim keeps gn / gk (both 1) and every value
    bn, bk = min(bn, max(n, 1)), min(bk, max(k, 1))
    wf = w.float()
    pad = F.pad(wf, (0, gk * bk - k, 0, gn * bn - n))
    amax = pad.abs().reshape(*lead, gn, bn, gk, bk).amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (wf / expand_scales(scale, n, k, bn, bk)).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
    return q, scale


def dequantize_weight_blocks(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(weight) * scale`` broadcast per block (in float32), converted to ``dtype``.

    Args:
        weight: ``[..., N, K]`` fp8 (or any float) tensor.
        scale: ``[..., ceil(N / block_n), ceil(K / block_k)]`` float32 (``block_n = 1``: a scale
            row per weight row).

    Raises:
        ValueError: ``scale``'s shape does not fit.
    """
    *lead, n, k = weight.shape
    want = (*lead, cdiv(n, block_n), cdiv(k, block_k))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_weight_blocks: weight {list(weight.shape)} with blocks ({block_n}, {block_k}) "
                         f"needs scales {list(want)}, got {list(scale.shape)}")
    return (weight.float() * expand_scales(scale.float(), n, k, block_n, block_k)).to(dtype)


def quantize_activations(x: torch.Tensor, block_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-``block_k``-group E4M3 quantisation (what the kernel does in its K loop).

    Args:
        x: ``[M, K]`` float.

    Returns:
        ``(x_q [M, K] float8_e4m3fn, s [M, ceil(K / block_k)] float32)`` with
        ``s = max(amax(|group|), 1e-10) / 448`` and ``x_q = e4m3(clamp(x / s, +-448))``.
    """
    m, k = x.shape
    g = cdiv(k, block_k)
    block_k = min(block_k, max(k, 1))  # one group over all of K either way (see quantize_weight_blocks)
    xf = x.float()
    amax = F.pad(xf.abs(), (0, g * block_k - k)).reshape(m, g, block_k).amax(-1)
    s = amax.clamp_min(ACT_AMAX_EPS) / FP8_MAX
    xq = (xf / s.repeat_interleave(block_k, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
    return xq, s


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch path: ``F.linear(x, dequantize(weight) in x.dtype, bias)`` (weights dequantised,
    activations not quantised)."""
    return F.linear(x, dequantize_weight_blocks(weight, scale, block_n, block_k, x.dtype), bias)


def fp8_block_linear_w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                              block_k: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The kernel's quantised math in ``dtype`` (default float64): :func:`quantize_activations`,
    both sides dequantised, one matmul; for tests and error budgets. ``x [M, K]`` -> ``[M, N]``."""
    xq, s = quantize_activations(x, block_k)
    k = x.shape[1]
    xd = xq.to(dtype) * s.to(dtype).repeat_interleave(block_k, dim=1)[:, :k]
    wd = weight.to(dtype) * expand_scales(scale.to(dtype), weight.shape[0], k, block_n, block_k)
    return xd @ wd.t()


# ------------------------------------------------------------------------------------------- kernel
if HAS_TRITON:
    from mtpspec.ops.triton_helpers import pdl_begin, quant_fp8, round_to_dtype, store_swap_tile

    @device_function
    def _group_scale(x, axis: tl.constexpr):
        """The E4M3 scale of activation groups (fp32 ``x``): ``max(amax, 1e-10) / 448`` along ``axis``,
        correctly rounded (``div_rn``: Triton's ``/`` is an approximate division on GPUs, which gave
        scales one ulp off torch's and, through them, other codes)."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=axis), 1e-10)
        return tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))

    @device_function
    def _k_step(acc, x_rows, xs_rows, w_cols, ws_rows, kb, offs_k, K, m_ok, n_ok, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, PREQ: tl.constexpr, FP8_DOT: tl.constexpr, FP8_BY_BITS: tl.constexpr):
        """One K group of both kernels: the activation rows' group quantised (amax / 448 per row;
        ``PREQ``: already quantised by :func:`_act_quant_kernel`, ``x_rows`` fp8 and the scales at
        ``xs_rows + kb``), times the weight block column (``W^T`` tile ``[BLOCK_K, BLOCK_N]`` and
        its scales), both scales applied to the fp32 partial, added to ``acc`` (returned)."""
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        if PREQ:
            xq = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            sa = tl.load(xs_rows + kb, mask=m_ok, other=0.0)
        else:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            sa = _group_scale(x, 1)
            xq = quant_fp8(x, tl.broadcast_to(sa[:, None], (BLOCK_M, BLOCK_K)), FP8_BY_BITS)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sw = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        if FP8_DOT:
            d = tl.dot(xq, w)
        else:
            d = tl.dot(xq.to(tl.float32), w.to(tl.float32))
        return acc + d * sa[:, None] * sw[None, :]

    def _act_quant_kernel(x_ptr, xq_ptr, xs_ptr, K, stride_xm, stride_qm, n_kb, BLOCK_K: tl.constexpr,
                          FP8_BY_BITS: tl.constexpr):
        # One (row, group): the group's E4M3 codes and scale, exactly as _k_step computes them.
        row = tl.program_id(0).to(tl.int64)
        kb = tl.program_id(1)
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        sa = _group_scale(x[None, :], 1)
        xq = quant_fp8(x[None, :], tl.broadcast_to(sa[:, None], (1, BLOCK_K)), FP8_BY_BITS)
        tl.store(xq_ptr + row * stride_qm + k[None, :], xq, mask=ok[None, :])
        tl.store(xs_ptr + row * n_kb + kb + tl.arange(0, 1), sa)

    _act_quant = LazyKernel(_act_quant_kernel)

    def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_xs,
                         stride_wn, stride_wsn, stride_om, n_kb, kb_per_split, SCALE_BN, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         PREQ: tl.constexpr, FP8_DOT: tl.constexpr, FP8_BY_BITS: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr):
        # One [BLOCK_M, BLOCK_N] output tile over K groups [pid_k * kb_per_split, +kb_per_split);
        # BLOCK_K is the quantisation group (= block_k), so every K step is one activation group
        # times one weight block column. SPLIT: fp32 partial tiles to part_ptr [splits, M, N]
        # (split-K for few rows: enough programs to keep the weight reads in flight).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        x_rows = x_ptr + rows[:, None] * stride_xm
        xs_rows = xs_ptr + rows * stride_xs
        w_cols = w_ptr + cols[None, :] * stride_wn  # the tile is loaded as W^T [BLOCK_K, BLOCK_N]
        ws_rows = ws_ptr + (cols // SCALE_BN) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        kb_lo = pid_k * kb_per_split
        kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)
        for kb in range(kb_lo, kb_hi):
            acc = _k_step(acc, x_rows, xs_rows, w_cols, ws_rows, kb, offs_k, K, m_ok, n_ok, BLOCK_M, BLOCK_K, PREQ,
                          FP8_DOT, FP8_BY_BITS)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SPLIT:
            dst = part_ptr + pid_k.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
            tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            y = round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=m_ok[:, None] & n_ok[None, :])

    _kernel = LazyKernel(_fp8_gemm_kernel)

    @device_function
    def _xt_group(x_cols, xs_rows, kb, k, k_ok, t_ok, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  PREQ: tl.constexpr, FP8_BY_BITS: tl.constexpr):
        """One K group of the activations transposed for the swap kernels: ``(xq^T [BLOCK_K,
        BLOCK_T] fp8, sa [BLOCK_T] fp32)``; ``PREQ``: loaded as _act_quant_kernel wrote them,
        else the group quantised here (the same functions, so the same codes and scales)."""
        if PREQ:
            xq = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)
            sa = tl.load(xs_rows + kb, mask=t_ok, other=0.0)
        else:
            x = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
            sa = _group_scale(x, 0)
            xq = quant_fp8(x, tl.broadcast_to(sa[None, :], (BLOCK_K, BLOCK_T)), FP8_BY_BITS)
        return xq, sa

    def _fp8_swap_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_qm, stride_xs,
                         stride_wn, stride_wsn, stride_om, n_kb, kb_per_split, SCALE_BN, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         PREQ: tl.constexpr, FP8_DOT: tl.constexpr, FP8_BY_BITS: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr):
        # Swap AB (few rows): the transposed product out^T [BLOCK_N, BLOCK_T] = W x^T, one tile of
        # BLOCK_N weight rows and BLOCK_T token rows over K groups [pid_k * kb_per_split,
        # +kb_per_split). The weight tile is loaded as stored, W [BLOCK_N, BLOCK_K] with K
        # contiguous (the dot's A operand); the activations come quantised by _act_quant_kernel
        # (xq [M, K] fp8, xs [M, n_kb] fp32) and are loaded as xq^T [BLOCK_K, BLOCK_T] (not PREQ:
        # xq_ptr is x [M, K], each group quantised here, xs_ptr unused). Each group's fp32
        # partial gets both scales in the dense kernel's order (d * sa * sw). SPLIT: fp32
        # partials to part_ptr [splits, M, N] (summed by _split_sum_kernel).
        pid_n = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        t_ok = offs_t < M
        cols = offs_n.to(tl.int64)
        rows = offs_t.to(tl.int64)
        w_rows = w_ptr + cols[:, None] * stride_wn
        ws_rows = ws_ptr + (cols // SCALE_BN) * stride_wsn
        xq_cols = xq_ptr + rows[None, :] * stride_qm
        xs_rows = xs_ptr + rows * stride_xs
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        kb_lo = pid_k * kb_per_split
        kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)
        for kb in range(kb_lo, kb_hi):
            k = kb * BLOCK_K + offs_k
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xq, sa = _xt_group(xq_cols, xs_rows, kb, k, k_ok, t_ok, BLOCK_K, BLOCK_T, PREQ, FP8_BY_BITS)
            sw = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
            if FP8_DOT:
                d = tl.dot(w, xq)
            else:
                d = tl.dot(w.to(tl.float32), xq.to(tl.float32))
            acc += d * sa[None, :] * sw[:, None]
        store_swap_tile(acc, b_ptr, out_ptr, part_ptr, pid_k, offs_n, cols, rows, n_ok, t_ok, M, N, stride_om,
                        HAS_BIAS, SPLIT, BF16_BY_BITS)

    _swap = LazyKernel(_fp8_swap_kernel)

    def _split_sum_kernel(part_ptr, out_ptr, MN, splits, BLOCK: tl.constexpr, BF16_BY_BITS: tl.constexpr,
                          PDL: tl.constexpr):
        pdl_begin(PDL)
        # out.flat[i] = round(sum_s part[s].flat[i]) over the splits in order (fp32), rounded once to
        # out's dtype; part [splits, M, N] fp32, out [M, N] contiguous.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        src = part_ptr + offs
        acc = tl.load(src, mask=ok, other=0.0)
        for _ in range(1, splits):
            src += MN
            acc += tl.load(src, mask=ok, other=0.0)
        tl.store(out_ptr + offs, round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS), mask=ok)

    _split_sum = LazyKernel(_split_sum_kernel, pdl=True)

    def _fp8_grouped_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, rw_ptr, num_pairs,
                            num_experts, N, K, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                            n_kb, SCALE_BN, A_ROW_DIV: tl.constexpr, HAS_RW: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_DOT: tl.constexpr,
                            FP8_BY_BITS: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        # The dense kernel's K loop over one block of (token, expert) pairs of one expert
        # (moe_align's grouping): A row of pair p is row p // A_ROW_DIV (x by token, or the
        # pair's own intermediate row), W = w[e]; the output row is the pair's, times its
        # routing weight when HAS_RW.
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= num_experts:  # past the last expert's run
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pair < num_pairs
        prow = pair.to(tl.int64)
        arow = (pair // A_ROW_DIV).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        cols = offs_n.to(tl.int64)
        ee = e.to(tl.int64)
        a_rows = a_ptr + arow[:, None] * stride_am
        w_cols = w_ptr + ee * stride_we + cols[None, :] * stride_wn
        ws_rows = ws_ptr + ee * stride_wse + (cols // SCALE_BN) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, n_kb):
            acc = _k_step(acc, a_rows, a_rows, w_cols, ws_rows, kb, offs_k, K, m_ok, n_ok, BLOCK_M, BLOCK_K, False,
                          FP8_DOT, FP8_BY_BITS)
        if HAS_RW:
            acc = acc * tl.load(rw_ptr + prow, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(out_ptr + prow[:, None] * stride_om + cols[None, :], y, mask=m_ok[:, None] & n_ok[None, :])

    _grouped_kernel = LazyKernel(_fp8_grouped_kernel)

    def _fp8_grouped_swap_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, rw_ptr,
                                 num_pairs, num_experts, N, K, stride_qm, stride_xs, stride_we, stride_wn, stride_wse,
                                 stride_wsn, stride_om, n_kb, SCALE_BN, A_ROW_DIV: tl.constexpr, HAS_RW: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 PREQ: tl.constexpr, FP8_DOT: tl.constexpr, FP8_BY_BITS: tl.constexpr,
                                 BF16_BY_BITS: tl.constexpr):
        # _fp8_grouped_kernel swapped (few pairs per expert): out^T [BLOCK_N, BLOCK_T] = W_e x^T for
        # one block of BLOCK_T (token, expert) pairs of expert e, the weight tile loaded as stored
        # (W_e [BLOCK_N, BLOCK_K], K contiguous), the activations pre-quantised by
        # _act_quant_kernel (xq [rows, K] fp8, xs [rows, n_kb]; pair p reads row p // A_ROW_DIV)
        # and loaded as xq^T [BLOCK_K, BLOCK_T] (not PREQ: xq_ptr is the activations, quantised
        # here); scales applied per group as the dense kernel.
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= num_experts:  # past the last expert's run
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_T + tl.arange(0, BLOCK_T))
        t_ok = pair < num_pairs
        prow = pair.to(tl.int64)
        arow = (pair // A_ROW_DIV).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        cols = offs_n.to(tl.int64)
        ee = e.to(tl.int64)
        w_rows = w_ptr + ee * stride_we + cols[:, None] * stride_wn
        ws_rows = ws_ptr + ee * stride_wse + (cols // SCALE_BN) * stride_wsn
        xq_cols = xq_ptr + arow[None, :] * stride_qm
        xs_rows = xs_ptr + arow * stride_xs
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for kb in range(0, n_kb):
            k = kb * BLOCK_K + offs_k
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xq, sa = _xt_group(xq_cols, xs_rows, kb, k, k_ok, t_ok, BLOCK_K, BLOCK_T, PREQ, FP8_BY_BITS)
            sw = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
            if FP8_DOT:
                d = tl.dot(w, xq)
            else:
                d = tl.dot(w.to(tl.float32), xq.to(tl.float32))
            acc += d * sa[None, :] * sw[:, None]
        if HAS_RW:
            acc = acc * tl.load(rw_ptr + prow, mask=t_ok, other=0.0).to(tl.float32)[None, :]
        y = round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(out_ptr + prow[None, :] * stride_om + cols[:, None], y, mask=n_ok[:, None] & t_ok[None, :])

    _grouped_swap = LazyKernel(_fp8_grouped_swap_kernel)


#: The largest group the kernel takes: one ``tl.dot`` K step of ``BLOCK_K`` columns a group, so a
#: huge group (``fp8_writer --block`` accepts any) would be a huge tile; such groups take the torch path.
KERNEL_MAX_BLOCK_K = 256


def kernel_supports(block_k: int) -> bool:
    """Whether the kernel takes this group size (a power of two in ``16 .. KERNEL_MAX_BLOCK_K``:
    one ``tl.dot`` K step)."""
    return 16 <= block_k <= KERNEL_MAX_BLOCK_K and block_k & (block_k - 1) == 0


def _fp8_dot(device: torch.device) -> bool:
    """fp8 tensor-core dots: CUDA sm_89+ (Ada, Hopper, Blackwell); not under the interpreter. An fp8
    ``tl.dot`` needs K >= 32: callers dot groups of fewer columns in fp32."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


#: Split-K target: at least this many programs per SM for few-row GEMMs (weight-read bound).
SPLIT_K_PROGRAMS_PER_SM = 2


def split_k(m: int, n_tiles_mn: int, n_kb: int, sms: int) -> int:
    """K splits for an ``m``-row GEMM of ``n_tiles_mn`` output tiles and ``n_kb`` K groups: up to
    64 rows (weight-read bound), enough splits for :data:`SPLIT_K_PROGRAMS_PER_SM` programs per
    SM, each with at least 4 K groups; 1 otherwise."""
    if m > 64 or n_kb < 8:
        return 1
    want = cdiv(SPLIT_K_PROGRAMS_PER_SM * sms, n_tiles_mn)
    return max(1, min(want, n_kb // 4))


def launch_config(m: int, n: int) -> Tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``m`` rows, ``n`` columns."""
    if m <= 16:
        return 16, 64 if n <= 4096 else 128, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


#: Rows up to which :func:`fp8_block_linear` takes the swap-AB path by default (``small_m=None``);
#: 0 turns it off. To tune on a GPU (``benchmarks/bench_fp8_gemm.py`` times the paths side by side).
SWAP_AB_MAX_M = 16
#: The swap-AB variant taken by default: ``"swap"`` (activations quantised in a pass of their own,
#: one more launch) or ``"swap_fused"`` (each program quantises its token rows' groups in its K
#: loop: the same codes and scales, so the same result bit for bit).
SWAP_AB_DEFAULT = "swap"
#: The expert-grouped swap kernel quantises its activation rows in a pass of their own (else in
#: its K loop; same bits).
GROUPED_SWAP_PREQUANT = True
#: Swap-AB split-K target: at most this many programs per SM, so that all are resident at once
#: (one wave, no tail: 3 programs of 74 KB shared memory, 4 stages of 128 x 128 + 128 x 16 bytes,
#: fit an sm_90 SM's 228 KB).
SWAP_PROGRAMS_PER_SM = 3
#: Shared memory per SM that resident programs share (sm_90: 228 KB, 1 KB of it reserved per block).
SMEM_PER_SM = 227 * 1024
#: Swap-AB split-K: at least this many K groups per split.
SWAP_MIN_KB_PER_SPLIT = 2
#: Swap-AB: most token rows per program (the token tile is the dot's N: 16 .. this, a power of two).
SWAP_MAX_BLOCK_T = 64
#: Elements per program of the split-K sum.
SPLIT_SUM_BLOCK = 1024


#: :func:`fp8_block_linear`'s kernels (``small_m``).
SMALL_M_PATHS = ("swap", "swap_fused", "tile")


def small_m_path(m: int, small_m: Optional[str] = None) -> str:
    """The kernel :func:`fp8_block_linear` runs for ``m`` rows, one of :data:`SMALL_M_PATHS`.
    ``small_m`` forces one (any ``m``); None picks :data:`SWAP_AB_DEFAULT` for
    ``m <= SWAP_AB_MAX_M``, else ``"tile"``.

    Raises:
        ValueError: ``small_m`` neither None nor one of :data:`SMALL_M_PATHS`.
    """
    if small_m is not None and small_m not in SMALL_M_PATHS:
        raise ValueError(f"fp8_block_linear: small_m must be None or one of {SMALL_M_PATHS}, got {small_m!r}")
    if small_m is not None:
        return small_m
    return SWAP_AB_DEFAULT if m <= SWAP_AB_MAX_M else "tile"


def swap_launch_config(m: int, n: int) -> Tuple[int, int, int, int]:
    """Swap-AB ``(BLOCK_N, BLOCK_T, num_warps, num_stages)`` for ``m`` rows, ``n`` columns:
    BLOCK_N weight rows (64 up to ``n = 4096``, else 128: the dot's M, one or two wgmma m64),
    BLOCK_T = ``m`` rounded up to a power of two in [16, SWAP_MAX_BLOCK_T] (the dot's N); 8 warps
    for a 128 x 64 accumulator (4 warps: 246 registers on sm_90), else 4; 4 stages (sm_90,
    128 x 16: wgmma m64n16k32 e4m3, cp.async pipeline, 74 KB shared memory, 96 registers)."""
    bt = min(SWAP_MAX_BLOCK_T, max(16, 1 << (max(m, 1) - 1).bit_length()))
    bn = 64 if n <= 4096 else 128
    return bn, bt, 8 if bn * bt >= 128 * 64 else 4, 4


def swap_programs_per_sm(block_n: int, block_t: int, block_k: int, stages: int) -> int:
    """Swap-AB programs resident per SM: :data:`SWAP_PROGRAMS_PER_SM`, fewer where ``stages`` fp8
    tiles ``[block_n, block_k]`` + ``[block_k, block_t]`` per program do not fit
    :data:`SMEM_PER_SM` that many times (128 x 64 tokens: 96 KB, 2 per SM)."""
    smem = stages * block_k * (block_n + block_t)
    return max(1, min(SWAP_PROGRAMS_PER_SM, SMEM_PER_SM // smem))


def swap_split_k(n_tiles: int, n_kb: int, sms: int, per_sm: Optional[int] = None) -> int:
    """Swap-AB K splits for ``n_tiles`` output tiles and ``n_kb`` K groups: as many as fit
    ``n_tiles * splits <= per_sm * sms`` (``per_sm``: :data:`SWAP_PROGRAMS_PER_SM` by default;
    one wave: rounding up would leave a tail wave of a few programs reading at a fraction of the
    bandwidth), each split with at least :data:`SWAP_MIN_KB_PER_SPLIT` groups; 1 when the tiles
    alone fill the wave. The caller evens them out (``per = cdiv(n_kb, splits)``,
    ``cdiv(n_kb, per)`` splits)."""
    want = (SWAP_PROGRAMS_PER_SM if per_sm is None else per_sm) * sms // max(1, n_tiles)
    return max(1, min(want, n_kb // SWAP_MIN_KB_PER_SPLIT))


def _quantise_rows(x2: torch.Tensor, block_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations` on the device by ``_act_quant_kernel`` (one program per row and
    group): ``(xq [M, K] fp8, xs [M, ceil(K / block_k)] fp32)``, the dense kernel's codes bit for bit."""
    m, k = x2.shape
    n_kb = cdiv(k, block_k)
    xq = torch.empty((m, k), dtype=FP8_WEIGHT_DTYPE, device=x2.device)
    xs = torch.empty((m, n_kb), dtype=torch.float32, device=x2.device)
    _act_quant[(m, n_kb)](x2, xq, xs, k, x2.stride(0), xq.stride(0), n_kb, BLOCK_K=block_k,
                          FP8_BY_BITS=interpreting())
    return xq, xs


def _swap_linear(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor],
                 out: torch.Tensor, block_n: int, block_k: int, prequant: bool = True) -> None:
    """The swap-AB path into ``out [M, N]`` (contiguous): activations quantised once
    (:func:`_quantise_rows`; not ``prequant``: in the K loop), ``_fp8_swap_kernel`` over (column
    tiles, token tiles, K splits), then, split, ``_split_sum_kernel`` (fp32 partials summed in
    split order, rounded once)."""
    m, k = x2.shape
    n = w.shape[0]
    n_kb = cdiv(k, block_k)
    xq, xs = _quantise_rows(x2, block_k) if prequant else (x2, s)
    bn, bt, warps, stages = swap_launch_config(m, n)
    per_sm = swap_programs_per_sm(bn, bt, block_k, stages)
    per = cdiv(n_kb, swap_split_k(cdiv(n, bn) * cdiv(m, bt), n_kb, num_sms(x2.device), per_sm))
    splits = cdiv(n_kb, per)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device) if splits > 1 else out
    extra = {} if interpreting() else {"num_warps": warps, "num_stages": stages}
    bf16_bits = interpreting() and out.dtype == torch.bfloat16
    _swap[(cdiv(n, bn), cdiv(m, bt), splits)](
        xq, xs, w, s, bias if bias is not None else s, out, part, m, n, k, xq.stride(0), xs.stride(0), w.stride(0),
        s.stride(0), out.stride(0), n_kb, per, block_n, HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_T=bt,
        BLOCK_K=block_k, SPLIT=splits > 1, PREQ=prequant, FP8_DOT=_fp8_dot(x2.device) and block_k >= 32,
        FP8_BY_BITS=interpreting(), BF16_BY_BITS=bf16_bits, **extra)
    if splits > 1:
        _split_sum[(cdiv(m * n, SPLIT_SUM_BLOCK),)](part, out, m * n, splits, BLOCK=SPLIT_SUM_BLOCK,
                                                    BF16_BY_BITS=bf16_bits)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                     bias: Optional[torch.Tensor] = None, prequant: bool = True,
                     small_m: Optional[str] = None) -> torch.Tensor:
    """``y = x W^T (+ bias)`` with ``W`` block-scaled FP8 (module docstring).

    Args:
        x: ``[..., K]`` float16 / bfloat16 / float32 activations.
        weight: ``[N, K]`` ``torch.float8_e4m3fn``.
        scale: ``[ceil(N / block_n), ceil(K / block_k)]`` float32 (``weight_scale_inv``).
        block_n: weight rows per scale row (128, or 1 for per-row scales).
        block_k: weight columns per scale column = the activation group size.
        bias: ``[N]`` or None.
        prequant: quantise the activations in a pass of their own (one program per row and group)
            instead of inside every column tile's K loop (which redoes it ``ceil(N / BLOCK_N)``
            times); same codes and scales, so the same result bit for bit. On by default: on an
            H200 it is 3.2-3.6x faster at 8,192 rows (o_proj 14.0 -> 4.05 ms) and mostly at 256
            (BENCHMARKS.md); ``False`` keeps the in-loop quantisation. The tile kernel only:
            the swap kernels' quantisation is part of ``small_m``.
        small_m: the kernel (:func:`small_m_path`): None picks :data:`SWAP_AB_DEFAULT` (swap AB:
            weight tiles ``[BLOCK_N, BLOCK_K]`` as stored times ``xq^T``, split-K, for few rows;
            ``"swap"`` quantises in a pass of its own, ``"swap_fused"`` in its K loop) up to
            :data:`SWAP_AB_MAX_M` rows and ``"tile"`` (``[BLOCK_M, BLOCK_N]`` output tiles) above;
            a string forces one (the benchmark times them side by side). Swap and tile differ
            only in fp32 summation order (same codes, scales and per-group scaling).

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: mismatched shapes. TypeError: a weight that is not fp8 or activations not
        fp16 / bf16 / fp32.
    """
    if weight.dtype != FP8_WEIGHT_DTYPE:
        raise TypeError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"fp8_block_linear: activations must be float16, bfloat16 or float32, got {x.dtype}")
    small_m_path(0, small_m)  # a bad small_m is an error on every device
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_block_linear: input [..., {x.shape[-1]}] does not match weight [{n}, {k}]")
    if tuple(scale.shape) != (cdiv(n, block_n), cdiv(k, block_k)):
        raise ValueError(f"fp8_block_linear: weight [{n}, {k}] with blocks ({block_n}, {block_k}) needs scales "
                         f"[{cdiv(n, block_n)}, {cdiv(k, block_k)}], got {list(scale.shape)}")
    if not (use_triton(x, weight, scale, bias) and kernel_supports(block_k)):
        return fp8_block_linear_ref(x, weight, scale, block_n, block_k, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    s = scale.float().contiguous()
    path = small_m_path(m, small_m)
    if path != "tile":
        _swap_linear(x2, w, s, bias, out, block_n, block_k, prequant=path == "swap")
        return out.reshape(*lead, n)
    bm, bn, warps, stages = launch_config(m, n)
    extra = {} if interpreting() else {"num_warps": warps, "num_stages": stages}
    n_kb = cdiv(k, block_k)
    per = cdiv(n_kb, split_k(m, cdiv(m, bm) * cdiv(n, bn), n_kb, num_sms(x.device)))
    splits = cdiv(n_kb, per)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    xa, xs = x2, s  # xs: unused without prequant
    if prequant:
        xa, xs = _quantise_rows(x2, block_k)
    _kernel[(cdiv(m, bm), cdiv(n, bn), splits)](
        xa, xs, w, s, bias if bias is not None else s, out, part, m, n, k, xa.stride(0), xs.stride(0), w.stride(0),
        s.stride(0), out.stride(0), n_kb, per, block_n, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=block_k, SPLIT=splits > 1, PREQ=prequant, FP8_DOT=_fp8_dot(x.device) and block_k >= 32,
        FP8_BY_BITS=interpreting(), BF16_BY_BITS=interpreting() and x.dtype == torch.bfloat16, **extra)
    if splits > 1:  # the K splits' fp32 partials, summed in a fixed order, then rounded once
        out.copy_(part.sum(dim=0))
    return out.reshape(*lead, n)


def fp8_experts_loop(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     block_n13: int, block_n2: int, block_k: int) -> torch.Tensor:
    """Routed SwiGLU experts with FP8 block-scaled weights: a loop over the routed experts, each
    running :func:`fp8_block_linear` on its tokens (gate | up, SiLU-and-mul, down), weighted and
    summed per token in fp32. One host sync (the per-expert counts), so not CUDA-graph capturable.

    Args:
        x: ``[T, H]``; w13 ``[E, 2 I, H]`` fp8 with w13_scale ``[E, ceil(2 I / block_n13),
        ceil(H / block_k)]``; w2 ``[E, H, I]`` fp8 with w2_scale ``[E, ceil(H / block_n2),
        ceil(I / block_k)]``; topk_weights ``[T, top_k]`` fp32, topk_ids ``[T, top_k]`` int64.

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    t, top_k = topk_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    if t == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # host sync
    token_of = order // top_k
    wflat = topk_weights.reshape(-1).float()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel, tok = order[start:start + c], token_of[start:start + c]
        start += c
        gu = fp8_block_linear(x.index_select(0, tok), w13[e], w13_scale[e], block_n13, block_k)
        half = gu.shape[-1] // 2
        h = F.silu(gu[:, :half]) * gu[:, half:]
        y = fp8_block_linear(h, w2[e], w2_scale[e], block_n2, block_k)
        out.index_add_(0, tok, y.float() * wflat.index_select(0, sel).unsqueeze(-1))
    return out.to(x.dtype)


#: Pair blocks up to this height (:func:`mtpspec.ops.moe_gemm.moe_block_m`: 16 at decode, 64
#: above) run the expert-grouped swap-AB kernel (weight tiles as stored, activations quantised
#: once per row); 0 turns it off. No split-K: at decode every routed pair is a block of its own
#: (8 pairs x 56 column tiles = 448 programs for DeepSeek-V3's down projection at one token).
GROUPED_SWAP_MAX_BLOCK_M = 16


def _grouped_launch(a: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                    block_expert: torch.Tensor, routing: Optional[torch.Tensor], num_pairs: int, row_div: int,
                    block_m: int, scale_block_n: int, block_k: int) -> None:
    e, n, k = w.shape
    bn = 64 if n <= 4096 else 128
    if block_m <= GROUPED_SWAP_MAX_BLOCK_M:
        # a's rows quantised once (x by token, or one per pair), or in the K loop
        aq, xs = _quantise_rows(a, block_k) if GROUPED_SWAP_PREQUANT else (a, ws)
        extra = {} if interpreting() else {"num_warps": 4, "num_stages": 4}
        _grouped_swap[(block_expert.shape[0], cdiv(n, bn))](
            aq, xs, w, ws, out, sorted_pairs, block_expert, routing if routing is not None else ws, num_pairs, e, n,
            k, aq.stride(0), xs.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
            cdiv(k, block_k), scale_block_n, A_ROW_DIV=row_div, HAS_RW=routing is not None, BLOCK_T=block_m,
            BLOCK_N=bn, BLOCK_K=block_k, PREQ=GROUPED_SWAP_PREQUANT, FP8_DOT=_fp8_dot(a.device) and block_k >= 32,
            FP8_BY_BITS=interpreting(), BF16_BY_BITS=interpreting() and out.dtype == torch.bfloat16, **extra)
        return
    extra = {} if interpreting() else {"num_warps": 4, "num_stages": 3}
    _grouped_kernel[(block_expert.shape[0], cdiv(n, bn))](
        a, w, ws, out, sorted_pairs, block_expert, routing if routing is not None else ws, num_pairs, e, n, k,
        a.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0), cdiv(k, block_k),
        scale_block_n, A_ROW_DIV=row_div, HAS_RW=routing is not None, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_K=block_k, FP8_DOT=_fp8_dot(a.device) and block_k >= 32, FP8_BY_BITS=interpreting(),
        BF16_BY_BITS=interpreting() and out.dtype == torch.bfloat16, **extra)


def fp8_moe_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    block_n13: int, block_n2: int, block_k: int) -> torch.Tensor:
    """Routed SwiGLU experts with FP8 block-scaled weights (arguments and result as
    :func:`fp8_experts_loop`).

    Where the kernel runs (:func:`~mtpspec.ops.triton_utils.use_triton` and a kernel group size):
    the pairs are grouped by expert on the device (:func:`mtpspec.ops.moe_gemm.moe_align`, no
    host sync), one expert-grouped launch computes gate | up of every pair (activations quantised
    per row and group, as the dense kernel), SiLU-and-mul runs in torch, a second launch the
    down projection times the routing weight (fp32), and the pairs are summed per token in a fixed
    order. Blocks of up to :data:`GROUPED_SWAP_MAX_BLOCK_M` pairs (decode) run the swap-AB
    variant (:data:`GROUPED_SWAP_PREQUANT`: after a pass quantising the activation rows once).
    Scratch ``[N, 2 I]`` (x's dtype) + ``[N, I]`` + ``[N, H]`` fp32, ``N = T * top_k``.
    Otherwise :func:`fp8_experts_loop`.
    """
    from mtpspec.ops.moe_gemm import moe_align, moe_block_m, sum_pairs
    if not (use_triton(x, w13, w2) and kernel_supports(block_k)):
        return fp8_experts_loop(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block_n13, block_n2,
                                block_k)
    t, top_k = topk_ids.shape
    e, two_i, h = w13.shape
    n = t * top_k
    if n == 0:
        return x.new_zeros(t, h)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = moe_block_m(n, e)
    sorted_pairs, block_expert = moe_align(topk_ids, e, block_m)
    gate_up = torch.empty(n, two_i, dtype=x.dtype, device=x.device)
    _grouped_launch(x, w13, w13_scale.float().contiguous(), gate_up, sorted_pairs, block_expert, None, n, top_k,
                    block_m, block_n13, block_k)
    i = two_i // 2
    act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
    y = torch.empty(n, h, dtype=torch.float32, device=x.device)
    _grouped_launch(act, w2, w2_scale.float().contiguous(), y, sorted_pairs, block_expert,
                    topk_weights.reshape(-1).float().contiguous(), n, 1, block_m, block_n2, block_k)
    return sum_pairs(y, t, top_k, x.dtype)
