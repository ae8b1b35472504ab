"""FP8 block-scaled weights in the layers: the construction context and the scale loaders.

The loader builds a model of an FP8 checkpoint (``quantization_config.quant_method == "fp8"``,
:class:`~mtpspec.config.Fp8WeightConfig`) inside :func:`fp8_weights`; while it is active, every
linear layer built with ``quantize=True`` (the default: every ``*_proj`` of attention, MLP, MoE
experts and shared experts, MLA's ``q_a_proj`` / ``q_b_proj`` / ``kv_a_proj_with_mqa`` /
``o_proj``, the DSA indexer's ``wq_b`` / ``wk``, MTP's ``eh_proj``) and :class:`FusedMoE` hold

* ``weight``: ``torch.float8_e4m3fn`` ``[rows, cols]`` (this rank's shard), and
* ``weight_scale_inv`` (experts: ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``): float32
  ``[ceil(rows / scale_block_n), ceil(cols / block_k)]``,

and run :func:`mtpspec.ops.fp8_gemm.fp8_block_linear`. What stays in the model dtype (as in
``transformers``, whose FP8 swap converts only plain ``nn.Linear`` and expert modules, and in
the released checkpoints): embeddings, ``lm_head`` / ``shared_head.head``, norms, the MoE router
(``mlp.gate.weight``, fp32) and ``e_score_correction_bias``, the DSA indexer's
``weights_proj`` (fp32), and ``kv_b_proj``, whose weight MLA uses in absorbed form (``W_UK`` /
``W_UV`` views, :class:`~mtpspec.models.deepseek_v3.DeepseekV3Attention`): the loader dequantises
its FP8 tensor once, at load, into the model dtype. A layer whose checkpoint weight is not FP8
(``modules_to_not_convert``) is turned back into a plain one before loading
(:meth:`LinearBase.unquantize <mtpspec.layers.linear.LinearBase.unquantize>`).

Tensor parallelism: the scales are sliced with the weight. Output rows (column-parallel
layers, merged gate | up, q / k / v, expert gate | up) keep the checkpoint's block rows when
every shard starts and ends on a ``block_n`` boundary (the released checkpoints at the usual tp);
otherwise the layer keeps one scale row per weight row (``scale_block_n = 1``, copied from its
block's scale: exact, 4 / block_k bytes per weight more). Input columns (row-parallel layers,
expert down projections) must cut on ``block_k`` boundaries at tp > 1, since an activation group
would otherwise straddle two ranks: a :class:`ValueError` names the layer, the size and tp.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Tuple

import torch

from mtpspec.ops.fp8_gemm import FP8_WEIGHT_DTYPE
from mtpspec.ops.triton_utils import cdiv

_state = threading.local()


@contextlib.contextmanager
def fp8_weights(block: Optional[Tuple[int, int]]) -> Iterator[None]:
    """Build layers with FP8 block-scaled weights of ``block = (block_n, block_k)`` inside
    (``None``: plain weights, the default)."""
    saved = getattr(_state, "block", None)
    _state.block = None if block is None else (int(block[0]), int(block[1]))
    try:
        yield
    finally:
        _state.block = saved


def current_fp8_block() -> Optional[Tuple[int, int]]:
    """The ``(block_n, block_k)`` of the active :func:`fp8_weights` context, or None."""
    return getattr(_state, "block", None)


def fp8_param(*shape: int) -> torch.nn.Parameter:
    """An uninitialised ``torch.float8_e4m3fn`` parameter."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=FP8_WEIGHT_DTYPE), requires_grad=False)


def scale_param(*shape: int) -> torch.nn.Parameter:
    """An uninitialised float32 scale parameter."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def rows_aligned(shards, block_n: int, rows: int) -> bool:
    """Whether row shards ``(full_size, src_start, size, dst_start)`` all start on ``block_n``
    boundaries and end on one or at the end of both the full tensor and the local ``rows``."""
    for full, src, size, dst in shards:
        if src % block_n or dst % block_n:
            return False
        if size % block_n and not (src + size == full and dst + size == rows):
            return False
    return True


@torch.no_grad()
def copy_scale_rows(dst: torch.Tensor, dst_start: int, full: torch.Tensor, src_start: int, size: int,
                    block_n: int, scale_block_n: int) -> None:
    """Copy the scales of weight rows ``[src_start, src_start + size)`` (full block scales
    ``full [ceil(N / block_n), C]``) to local weight rows ``[dst_start, dst_start + size)`` of
    ``dst [ceil(rows / scale_block_n), C]`` (``scale_block_n``: ``block_n`` (aligned) or 1)."""
    if scale_block_n == 1:
        idx = torch.div(torch.arange(src_start, src_start + size), block_n, rounding_mode="floor")
        dst[dst_start:dst_start + size].copy_(full.index_select(0, idx.to(full.device)).to(dst.device))
    else:
        n = cdiv(size, block_n)
        r0, s0 = dst_start // block_n, src_start // block_n
        dst[r0:r0 + n].copy_(full[s0:s0 + n].to(dst.device))


def check_column_cut(layer: str, cols: int, full_cols: int, tp: int, block_k: int) -> None:
    """Raise ValueError when a rank's input-column shard of ``cols`` (of ``full_cols``) does not
    cut on ``block_k`` boundaries (tp > 1)."""
    if tp > 1 and cols % block_k:
        raise ValueError(f"{layer}: FP8 block-scaled weight: the input dimension {full_cols} split over "
                         f"tp={tp} gives {cols} columns per rank, not a multiple of the weight block "
                         f"{block_k}; the scales cannot be cut with it. Use a tp that divides "
                         f"{full_cols} / {block_k}, or a dequantised (bfloat16) checkpoint")
