"""Few-row 16-bit GEMM ``out = x W^T (+ b)`` for decode and verify (``M <= 16`` rows): a swap-AB
Triton kernel, the bf16 / fp16 counterpart of :mod:`mtpspec.ops.fp8_gemm`'s FP8 swap path.

At a few rows a linear layer only streams its weight: the work is ``N x K`` weight reads and the
floor is their bytes over the read bandwidth. The kernel computes ``out^T [BLOCK_N, BLOCK_T] = W
x^T`` per program: a tile of ``BLOCK_N`` weight rows loaded as stored (K contiguous, the dot's A
operand) times the activations transposed (``BLOCK_T = 16`` token rows, the dot's N), over a K
range; the K axis is split across programs when the column tiles alone leave SMs idle
(:func:`skinny_launch`), fp32 partials then summed in split order by ``fp8_gemm``'s split-sum
kernel (deterministic, rounded once). fp32 accumulation as cuBLAS; bias added once, in fp32.

Status: **on** for up to 16 rows (:data:`SKINNY_MAX_M`; env ``MTPSPEC_SKINNY_GEMM_MAX_M``, 0 turns it
off) since its first H200 run (``benchmarks/bench_skinny_gemm.py``, BENCHMARKS.md 2026-12-04, session
14): at 1-16 rows it matched or beat cuBLAS on 21 of 24 (shape, rows) points of GLM-4.5-Air and
DeepSeek-V3 widths (Air o_proj 1.33 -> 1.22x its bytes at 1 row, the LM head 0.99 -> 0.94x), lost
at most 3% on the other three, and plain decoding of the 8-layer Air model went 1.762 -> 1.717 ms a
token in the same call. Dispatch: :func:`linear` (CUDA, or CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, cdiv, interpreting, tl, use_triton

#: Rows up to which :func:`linear` runs the kernel (0: never).
SKINNY_MAX_M = int(os.environ.get("MTPSPEC_SKINNY_GEMM_MAX_M", "16"))
#: Token rows per program (the dot's N; ``M`` above it is not taken).
BLOCK_T = 16
#: Programs per SM the split aims at (80 KB of shared memory each at the default shape: 2 fit).
PROGRAMS_PER_SM = 2
#: Each split covers at least this many BLOCK_K steps.
MIN_K_STEPS_PER_SPLIT = 4

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import pdl_begin, store_swap_tile

    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       k_per_split, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                       BF16_BY_BITS: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # out^T tile [BLOCK_N, BLOCK_T] of weight rows pid_n * BLOCK_N .. over K in [pid_k *
        # k_per_split, + k_per_split). SPLIT: fp32 partials to part_ptr [splits, M, N] (bias in
        # split 0), else rounded into out [M, N] (row stride stride_om).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_t = tl.arange(0, BLOCK_T)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        t_ok = offs_t < M
        cols = offs_n.to(tl.int64)
        rows = offs_t.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_hi
            w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptr + rows[None, :] * stride_xm + k[:, None], mask=t_ok[None, :] & k_ok[:, None],
                         other=0.0)
            if DOT_FP32:  # the interpreter's 16-bit dot is wrong: fp32 products of the same values
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        store_swap_tile(acc, b_ptr, out_ptr, part_ptr, pid_k, offs_n, cols, rows, n_ok, t_ok, M, N, stride_om,
                        HAS_BIAS, SPLIT, BF16_BY_BITS)

    _skinny = LazyKernel(_skinny_kernel, pdl=True)


def skinny_launch(n: int, k: int, sms: int, block_n: int = 64, block_k: int = 128) -> Tuple[int, int]:
    """``(splits, k_per_split)`` for ``N = n`` weight rows and ``K = k``: enough K splits that the
    ``ceil(n / block_n)`` column tiles times the splits reach :data:`PROGRAMS_PER_SM` per SM, each
    split at least :data:`MIN_K_STEPS_PER_SPLIT` BLOCK_K steps (whole steps); 1 when the tiles
    alone fill the machine."""
    tiles, steps = cdiv(n, block_n), cdiv(k, block_k)
    want = max(1, min(PROGRAMS_PER_SM * sms // max(1, tiles), steps // MIN_K_STEPS_PER_SPLIT))
    per = cdiv(steps, want) * block_k
    return cdiv(k, per), per


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
                  splits: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``M <= BLOCK_T`` (16) through the kernel.

    Args:
        x: ``[M, K]`` bf16 / fp16, unit stride in K.
        weight: ``[N, K]`` of x's dtype, contiguous rows (unit stride in K).
        bias: ``[N]`` or None.
        block_n, block_k, num_warps, num_stages: launch shape (benchmark sweeps).
        splits: K splits (default :func:`skinny_launch`).
        out: a contiguous ``[M, N]`` of x's dtype to write into (default: a new tensor).

    Returns:
        ``[M, N]`` of x's dtype (fp32 accumulation, rounded once).

    Raises:
        ValueError: more than 16 rows, mismatched shapes, strides or dtypes.
    """
    from mtpspec.ops.argmax import num_sms
    from mtpspec.ops.fp8_gemm import SPLIT_SUM_BLOCK, _split_sum
    m, k = x.shape
    n = weight.shape[0]
    if m > BLOCK_T or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 \
            or weight.dtype != x.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"skinny_linear: x {list(x.shape)} {x.dtype}, weight {list(weight.shape)} {weight.dtype}, "
                         f"bias {None if bias is None else list(bias.shape)}: needs M <= {BLOCK_T}, unit stride in K "
                         "and one dtype")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"skinny_linear: out {list(out.shape)} {out.dtype} stride {out.stride()}: needs a "
                         f"contiguous [{m}, {n}] {x.dtype}")
    if m == 0 or n == 0:
        return out
    if splits is None:
        splits, per = skinny_launch(n, k, num_sms(x.device), block_n, block_k)
    else:
        per = cdiv(cdiv(k, block_k), splits) * block_k
        splits = cdiv(k, per)
    interp = interpreting()
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    extra = {} if interp else {"num_warps": num_warps, "num_stages": num_stages}
    bf16_bits = interp and x.dtype == torch.bfloat16
    _skinny[(cdiv(n, block_n), splits)](
        x, weight, bias if bias is not None else weight, out, part, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), per, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_T=BLOCK_T, BLOCK_K=block_k,
        SPLIT=splits > 1, DOT_FP32=interp, BF16_BY_BITS=bf16_bits, **extra)
    if splits > 1:
        _split_sum[(cdiv(m * n, SPLIT_SUM_BLOCK),)](part, out, m * n, splits, BLOCK=SPLIT_SUM_BLOCK,
                                                   BF16_BY_BITS=bf16_bits)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None ->
    ``[..., N]`` of x's dtype), through :func:`skinny_linear` where it is switched on: at most
    :data:`SKINNY_MAX_M` rows (leading dims flattened), 16-bit x and weight of one dtype, unit
    stride in K, no bias or a contiguous 1-D one of x's dtype, where
    :func:`~mtpspec.ops.triton_utils.use_triton` holds. ``out``: for 2-D ``x`` only, written in
    place (contiguous ``[M, N]`` of x's dtype) and returned; elsewhere ``torch.mm`` /
    ``torch.addmm`` into it (F.linear's own 2-D calls).

    Raises:
        RuntimeError: what ``F.linear`` / ``torch.mm`` raise for shapes or dtypes that do not fit."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if SKINNY_MAX_M <= 0 or not (
            0 < rows <= min(SKINNY_MAX_M, BLOCK_T) and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1 and x.stride(-1) == 1
            and (bias is None or (bias.dim() == 1 and bias.dtype == x.dtype and bias.is_contiguous()))
            and (out is None or (out.dtype == x.dtype and out.is_contiguous()))
            and use_triton(x, weight, bias)):
        if out is None:  # switched off, or not a call the kernel takes: every linear layer's call passes here
            return F.linear(x, weight, bias)
        return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)
    if out is not None:
        return skinny_linear(x, weight, bias, out=out)
    return skinny_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


__all__ = ["SKINNY_MAX_M", "linear", "skinny_launch", "skinny_linear"]
