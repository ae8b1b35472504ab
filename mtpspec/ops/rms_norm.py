"""RMSNorm and fused residual-add + RMSNorm: Triton kernel and torch references.

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4):
``y = x / sqrt(mean(x**2) + eps) * weight``, statistics in fp32, result cast to ``x.dtype``.

Residual convention (docs/structures.md): ``fused_add_rms_norm(x, residual, w, eps)`` returns
``(rms_norm(s), s)`` with ``s = round_to_dtype(x + residual)``: the sum is formed in fp32 and
rounded once to ``x.dtype``, and the norm is taken of that rounded sum (vLLM's kernel and
Hugging Face models keep the residual stream in the model dtype).

Kernel layout: one program normalises ``BLOCK_M`` rows (several when rows are short). A row
of up to ``triton_utils.MAX_FUSED_HIDDEN`` elements stays in registers, so memory is touched
once: read ``x``, ``residual``, ``weight``; write ``out``, ``residual_out``. Longer rows take
two passes over column blocks (the second reads back ``residual_out``, or ``x``).
"""

from typing import Optional, Tuple

import torch

from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, as_rows, check_device, check_eps,
                                      check_float_dtype, check_weight, interpreting, row_launch,
                                      tl, use_triton)

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import (pdl_begin, rms_norm_pass2, rms_rstd, store_rms_norm_rows,
                                            store_rounded)
    from mtpspec.ops.triton_utils import device_function

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm. ``x``: ``[num_tokens, hidden_size]``; returns ``x``'s shape and dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                           eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(rms_norm(x + residual), x + residual)``.

    The sum is formed in fp32 and rounded once to ``x.dtype``; the norm is applied to that
    rounded sum (the convention of vLLM's kernel and of Hugging Face models, whose residual
    stream is stored in the model dtype), with fp32 statistics. ``residual=None`` means no
    add: returns ``(rms_norm(x), x)``.
    """
    if residual is None:
        return rms_norm_ref(x, weight, eps), x
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps), s


if HAS_TRITON:
    @device_function
    def _sum_block(x_ptr, res_ptr, res_out_ptr, rows, cols, mask, stride_x, stride_res, stride_out,
                   HAS_RESIDUAL: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        # Columns `cols` of rows `rows` in fp32: x, or x + residual rounded once to the dtype and
        # written to residual_out.
        s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            s = store_rounded(res_out_ptr, rows, stride_out, cols, s, mask, BF16_BY_BITS)
        return s

    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_cols,
                         stride_x, stride_res, stride_out, eps,
                         HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BF16_BY_BITS: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # out and res_out are fresh contiguous [n_rows, n_cols] tensors sharing stride_out.
        # BF16_BY_BITS: round fp32 -> bf16 to nearest-even with integer ops (Triton's interpreter
        # truncates in .to(tl.bfloat16); triton_helpers.round_to_dtype); compiled kernels use the
        # native conversion.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        rows = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        if ONE_PASS:
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            s = _sum_block(x_ptr, res_ptr, res_out_ptr, rows, cols, mask, stride_x, stride_res,
                           stride_out, HAS_RESIDUAL, BF16_BY_BITS)
            store_rms_norm_rows(out_ptr, w_ptr, rows, stride_out, cols, col_mask, mask, s, n_cols,
                                eps, BF16_BY_BITS)
        else:
            # Pass 1: sum of squares of the (rounded) sum; write residual_out.
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                s = _sum_block(x_ptr, res_ptr, res_out_ptr, rows, c, mask, stride_x, stride_res,
                               stride_out, HAS_RESIDUAL, BF16_BY_BITS)
                acc += s * s
            rstd = rms_rstd(acc, n_cols, eps)
            # Pass 2: read the rounded sum (this block's own writes) or x back; normalise.
            if HAS_RESIDUAL:
                rms_norm_pass2(res_out_ptr, stride_out, out_ptr, w_ptr, rows, row_mask, stride_out,
                               cols, n_cols, rstd, BLOCK_N, BF16_BY_BITS)
            else:
                rms_norm_pass2(x_ptr, stride_x, out_ptr, w_ptr, rows, row_mask, stride_out,
                               cols, n_cols, rstd, BLOCK_N, BF16_BY_BITS)

    _kernel = LazyKernel(_rms_norm_kernel, pdl=True)


def _check(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
           eps: float) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Validate the inputs; return ``x`` and ``residual`` as ``[num_tokens, hidden_size]`` views."""
    x2 = as_rows(x, "x")
    check_float_dtype(x, "x")
    check_weight(weight, "weight", x2.shape[1], x, "x")
    check_eps(eps, positive=False)
    if residual is None:
        return x2, None
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, "
                         f"got {list(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}; "
                        "the residual stream must be in the activation dtype")
    check_device(residual, "residual", x, "x")
    return x2, as_rows(residual, "residual")


def _launch(x2: torch.Tensor, r2: Optional[torch.Tensor], weight: torch.Tensor,
            eps: float) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the kernel on ``[num_tokens, hidden_size]`` views; returns fresh contiguous tensors."""
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    r_out = torch.empty_like(out) if r2 is not None else None
    if n_rows == 0:
        return out, r_out
    cfg = row_launch(n_rows, n_cols, x2.element_size())
    # Without a residual, x stands in for the residual pointers, which are then never used.
    _kernel[(cfg.grid_rows,)](
        x2, r2 if r2 is not None else x2, weight, out, r_out if r_out is not None else out,
        n_rows, n_cols, x2.stride(0), r2.stride(0) if r2 is not None else 0, n_cols, float(eps),
        HAS_RESIDUAL=r2 is not None, ONE_PASS=cfg.one_pass, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BF16_BY_BITS=interpreting() and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps)
    return out, r_out


def fused_add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = round_to_dtype(x + residual)`` (sum in fp32, rounded once).

    Args:
        x: ``[num_tokens, hidden_size]`` (or ``[..., hidden_size]`` whose leading dims flatten
            without a copy), fp16/bf16/fp32; rows may be strided or offset, the last dim must have
            unit stride.
        residual: ``None`` (no add, never read) or a tensor of ``x``'s shape, dtype and device.
        weight: ``[hidden_size]`` fp16/bf16/fp32 on ``x``'s device.
        eps: finite, >= 0 (with eps > 0 a zero row, e.g. padding, normalises to zeros, not NaN).

    Returns:
        ``(out, residual_out)``, both of ``x``'s shape and dtype. ``out`` is a new contiguous
        tensor; ``residual_out`` is a new contiguous tensor holding ``s``, or ``x`` itself when
        ``residual`` is None. The inputs are never written.

    Runs the Triton kernel or the torch reference by :func:`use_triton`; statistics are fp32.

    Raises:
        ValueError: bad shape, stride, device or eps. TypeError: bad dtype or non-tensor input.
    """
    x2, r2 = _check(x, residual, weight, eps)
    if not use_triton(x, residual, weight):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    out, r_out = _launch(x2, r2, weight, eps)
    if r_out is None:
        r_out = x
    elif x.dim() != 2:
        r_out = r_out.view(x.shape)
    return (out if x.dim() == 2 else out.view(x.shape)), r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row: ``x / sqrt(mean(x**2) + eps) * weight`` in fp32, cast to ``x.dtype``.

    Args:
        x: ``[num_tokens, hidden_size]`` (or ``[..., hidden_size]`` whose leading dims flatten
            without a copy), fp16/bf16/fp32; rows may be strided or offset, the last dim must have
            unit stride.
        weight: ``[hidden_size]`` fp16/bf16/fp32 on ``x``'s device.
        eps: finite, >= 0 (with eps > 0 a zero row normalises to zeros, not NaN).

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype (``x`` is not written).

    Raises:
        ValueError: bad shape, stride, device or eps. TypeError: bad dtype or non-tensor input.
    """
    x2, _ = _check(x, None, weight, eps)
    if not use_triton(x, weight):
        return rms_norm_ref(x, weight, eps)
    out = _launch(x2, None, weight, eps)[0]
    return out if x.dim() == 2 else out.view(x.shape)
