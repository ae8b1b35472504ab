"""MTP input norm: zero position-0 embeddings, ``enorm`` | ``hnorm``, concatenated, in one kernel.

An MTP module (DeepSeek-V3 technical report, section 2.2, eq. 21) combines, for the token at
position ``i``, the embedding of token ``i + 1`` with the previous depth's hidden state at ``i``:
``h' = M [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]``. vLLM's DeepSeek/GLM MTP layers (``enorm``,
``hnorm``, ``eh_proj``) order the halves ``[enorm(inputs_embeds), hnorm(previous_hidden_states)]``
and zero ``inputs_embeds`` where ``positions == 0`` (there is no previous token there); this
module follows vLLM. RMSNorm as in :mod:`mtpspec.ops.rms_norm` (fp32 statistics, result cast to
the activation dtype; the arithmetic is :mod:`mtpspec.ops.triton_helpers`' ``rms_rstd`` /
``rms_normed``, shared with it); a zeroed row normalises to zeros since ``eps > 0``.

Kernel layout: a 2-D grid, axis 0 over blocks of rows, axis 1 over the two halves (0: embeds
with ``enorm``, 1: hidden states with ``hnorm``). Embedding rows at position 0 are never read.
"""

import torch

from mtpspec.ops.rms_norm import rms_norm_ref
from mtpspec.ops.triton_utils import (HAS_TRITON, LazyKernel, as_rows, check_device, check_eps,
                                      check_float_dtype, check_weight, interpreting, row_launch,
                                      tl, use_triton)

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import rms_normed, rms_rstd
    from mtpspec.ops.triton_utils import device_function


def fused_eh_norm_ref(positions: torch.Tensor, inputs_embeds: torch.Tensor,
                      previous_hidden_states: torch.Tensor, enorm_weight: torch.Tensor,
                      hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: ``cat([rms_norm(where(positions == 0, 0, inputs_embeds), enorm_weight),
    rms_norm(previous_hidden_states, hnorm_weight)], -1)`` with fp32 statistics.

    Shapes as in :func:`fused_eh_norm`; returns ``[num_tokens, 2 * hidden_size]`` in
    ``inputs_embeds.dtype``. Differentiable.
    """
    embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
    return torch.cat([rms_norm_ref(embeds, enorm_weight, eps),
                      rms_norm_ref(previous_hidden_states, hnorm_weight, eps)], dim=-1)


if HAS_TRITON:
    @device_function
    def _load_half(e_base, h_base, cols, e_rows, row_mask, e_cols, h_cols, is_e):
        # Columns `cols` of this program's half in fp32: embeddings (rows with pos == 0 masked
        # off) or hidden states; the other half's load is masked off by its zero column limit.
        e_mask = e_rows[:, None] & (cols < e_cols)[None, :]
        h_mask = row_mask[:, None] & (cols < h_cols)[None, :]
        return tl.where(is_e,
                        tl.load(e_base + cols[None, :], mask=e_mask, other=0.0).to(tl.float32),
                        tl.load(h_base + cols[None, :], mask=h_mask, other=0.0).to(tl.float32))

    @device_function
    def _half_weight(we_ptr, wh_ptr, cols, e_cols, h_cols, is_e):
        # Columns `cols` of this half's weight (enorm or hnorm) in fp32.
        return tl.where(is_e,
                        tl.load(we_ptr + cols, mask=cols < e_cols, other=0.0).to(tl.float32),
                        tl.load(wh_ptr + cols, mask=cols < h_cols, other=0.0).to(tl.float32))

    @device_function
    def _store_normed_half(out_base, w, cols, row_mask, n_cols, v, rstd, BF16_BY_BITS: tl.constexpr):
        # Normalise columns `cols` with this half's weight columns `w` and store them.
        y_low = rms_normed(v, rstd, w, out_base.dtype.element_ty, BF16_BY_BITS)
        tl.store(out_base + cols[None, :], y_low,
                 mask=row_mask[:, None] & (cols < n_cols)[None, :])

    def _eh_norm_kernel(pos_ptr, e_ptr, h_ptr, we_ptr, wh_ptr, out_ptr, n_rows, n_cols,
                        stride_pos, stride_e, stride_h, stride_out, eps,
                        ONE_PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BF16_BY_BITS: tl.constexpr):
        # Axis 1 picks the half; the other half's loads are masked off (no memory traffic) by
        # zero row/column limits (integer limits, not broadcast scalar booleans, which Triton's
        # interpreter mishandles in masks).
        # BF16_BY_BITS: round fp32 -> bf16 to nearest-even with integer ops (Triton's
        # interpreter truncates in .to(tl.bfloat16); triton_helpers.round_to_dtype); compiled
        # kernels use the native conversion.
        half = tl.program_id(1)
        is_e = half == 0
        e_cols = n_cols * (1 - half)
        h_cols = n_cols * half
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        rows = rows.to(tl.int64)
        # Positions are read for the embedding half only; its pos == 0 rows are zeros (one pass:
        # loaded and zeroed; two passes: never loaded).
        pos = tl.load(pos_ptr + rows * stride_pos, mask=rows < n_rows * (1 - half), other=0)
        e_base = e_ptr + rows[:, None] * stride_e
        h_base = h_ptr + rows[:, None] * stride_h
        out_base = out_ptr + rows[:, None] * stride_out + half * n_cols
        cols = tl.arange(0, BLOCK_N)
        if ONE_PASS:
            # one memory round trip before the sum of squares: the weight and every row loaded at
            # once (the embedding rows not masked by their positions but zeroed after, so the
            # loads need not wait for the positions), then the reduction, then the stores
            w = _half_weight(we_ptr, wh_ptr, cols, e_cols, h_cols, is_e)
            v = _load_half(e_base, h_base, cols, row_mask, row_mask, e_cols, h_cols, is_e)
            v = tl.where((row_mask & (pos == 0) & is_e)[:, None], 0.0, v)
            _store_normed_half(out_base, w, cols, row_mask, n_cols, v, rms_rstd(v * v, n_cols, eps), BF16_BY_BITS)
        else:
            e_rows = row_mask & (pos != 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                v = _load_half(e_base, h_base, c, e_rows, row_mask, e_cols, h_cols, is_e)
                acc += v * v
            rstd = rms_rstd(acc, n_cols, eps)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                v = _load_half(e_base, h_base, c, e_rows, row_mask, e_cols, h_cols, is_e)
                _store_normed_half(out_base, _half_weight(we_ptr, wh_ptr, c, e_cols, h_cols, is_e), c, row_mask,
                                   n_cols, v, rstd, BF16_BY_BITS)

    _kernel = LazyKernel(_eh_norm_kernel)


def _check(positions: torch.Tensor, inputs_embeds: torch.Tensor,
           previous_hidden_states: torch.Tensor, enorm_weight: torch.Tensor,
           hnorm_weight: torch.Tensor, eps: float) -> None:
    for name, t in (("positions", positions), ("inputs_embeds", inputs_embeds),
                    ("previous_hidden_states", previous_hidden_states)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if inputs_embeds.dim() != 2:
        raise ValueError("inputs_embeds must be [num_tokens, hidden_size], got shape "
                         f"{list(inputs_embeds.shape)}")
    as_rows(inputs_embeds, "inputs_embeds")
    check_float_dtype(inputs_embeds, "inputs_embeds")
    num_tokens, hidden = inputs_embeds.shape
    if previous_hidden_states.shape != inputs_embeds.shape:
        raise ValueError("previous_hidden_states must have inputs_embeds' shape "
                         f"{list(inputs_embeds.shape)}, got {list(previous_hidden_states.shape)}")
    as_rows(previous_hidden_states, "previous_hidden_states")
    if previous_hidden_states.dtype != inputs_embeds.dtype:
        raise TypeError(f"previous_hidden_states dtype {previous_hidden_states.dtype} differs from "
                        f"inputs_embeds dtype {inputs_embeds.dtype}")
    check_device(previous_hidden_states, "previous_hidden_states", inputs_embeds, "inputs_embeds")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must have shape [num_tokens] = [{num_tokens}], "
                         f"got {list(positions.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    check_device(positions, "positions", inputs_embeds, "inputs_embeds")
    check_weight(enorm_weight, "enorm_weight", hidden, inputs_embeds, "inputs_embeds")
    check_weight(hnorm_weight, "hnorm_weight", hidden, inputs_embeds, "inputs_embeds")
    check_eps(eps, positive=True)


def fused_eh_norm(positions: torch.Tensor, inputs_embeds: torch.Tensor,
                  previous_hidden_states: torch.Tensor, enorm_weight: torch.Tensor,
                  hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[enorm(inputs_embeds with position-0 rows zeroed), hnorm(previous_hidden_states)]``.

    Args:
        positions: ``[num_tokens]`` int32/int64 token positions; rows with ``positions == 0``
            take a zero embedding (their ``inputs_embeds`` row is never read).
        inputs_embeds: ``[num_tokens, hidden_size]`` fp16/bf16/fp32, embeddings of the next
            tokens; rows may be strided or offset, last dim unit stride.
        previous_hidden_states: ``[num_tokens, hidden_size]``, same dtype and device, the
            target's (or previous MTP step's) hidden states.
        enorm_weight, hnorm_weight: ``[hidden_size]`` fp16/bf16/fp32 RMSNorm weights.
        eps: finite, > 0 (so the zeroed position-0 rows normalise to zeros, not NaN).

    Returns:
        A new contiguous ``[num_tokens, 2 * hidden_size]`` tensor in ``inputs_embeds.dtype``;
        columns ``[:hidden_size]`` are the normed embeddings, ``[hidden_size:]`` the normed
        hidden states. The inputs are never written.

    Runs the Triton kernel or :func:`fused_eh_norm_ref` by
    :func:`~mtpspec.ops.triton_utils.use_triton`.

    Raises:
        ValueError: bad shape, stride, device or eps. TypeError: bad dtype or non-tensor input.
    """
    _check(positions, inputs_embeds, previous_hidden_states, enorm_weight, hnorm_weight, eps)
    if not use_triton(inputs_embeds, previous_hidden_states, enorm_weight, hnorm_weight):
        return fused_eh_norm_ref(positions, inputs_embeds, previous_hidden_states, enorm_weight,
                                 hnorm_weight, eps)
    return _launch(positions, inputs_embeds, previous_hidden_states, enorm_weight, hnorm_weight,
                   eps)


def _launch(positions: torch.Tensor, e: torch.Tensor, h: torch.Tensor, we: torch.Tensor,
            wh: torch.Tensor, eps: float) -> torch.Tensor:
    n_rows, n_cols = e.shape
    out = torch.empty((n_rows, 2 * n_cols), dtype=e.dtype, device=e.device)
    if n_rows == 0:
        return out
    cfg = row_launch(n_rows, n_cols, e.element_size())
    _kernel[(cfg.grid_rows, 2)](
        positions, e, h, we, wh, out, n_rows, n_cols, positions.stride(0), e.stride(0),
        h.stride(0), 2 * n_cols, float(eps), ONE_PASS=cfg.one_pass, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BF16_BY_BITS=interpreting() and e.dtype == torch.bfloat16,
        num_warps=cfg.num_warps)
    return out
