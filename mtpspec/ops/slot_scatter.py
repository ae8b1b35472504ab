"""Rows written into a paged cache at their slots, padding rows (slot ``-1``) skipped: one launch.

The deferred-MTP hidden-state cache (:mod:`mtpspec.spec_decode.deferred_mtp`) is written inside the
adaptive engine's CUDA-graphed verify units, every pure-decode step, whatever the step proposes. Its
torch form (:func:`scatter_rows_to_slots_ref`: a ``where`` over the slots and two ``index_copy_``)
is 3-4 kernels; on an H100 they added 19 us to a batch-1 step of the GLM-5 demo model (4 kernels
more than the fixed-k engine's step, 1.533 against 1.514 ms of kernels,
``benchmarks/profile_decode_gpu.py``, 2026-12-07). This is one kernel: program ``i`` copies row ``i``
when its slot is real.
"""

import torch

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, next_power_of_2, tl, use_triton

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import pdl_begin

#: Columns a program copies per loop iteration.
BLOCK_COLS = 2048


def scatter_rows_to_slots_ref(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Torch form of :func:`scatter_rows_to_slots`, with no host sync (fit for graph capture): a
    padding row is written at row 0's slot, then row 0 again (``index_copy_`` with repeated indices
    keeps any one of their rows), so only the real rows' values remain. Needs row 0 real."""
    first = slots[:1]
    src = rows if rows.dtype == cache.dtype else rows.to(cache.dtype)
    cache.index_copy_(0, torch.where(slots >= 0, slots, first), src)
    cache.index_copy_(0, first, src[:1])


if HAS_TRITON:
    def _scatter_rows_kernel(cache_ptr, rows_ptr, slots_ptr, n_cols, stride_cache, stride_rows,
                             BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        i = tl.program_id(0)
        slot = tl.load(slots_ptr + i)
        if slot >= 0:
            cols = tl.arange(0, BLOCK_N)
            src = rows_ptr + i.to(tl.int64) * stride_rows
            dst = cache_ptr + slot * stride_cache
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                m = c < n_cols
                tl.store(dst + c, tl.load(src + c, mask=m), mask=m)

    _kernel = LazyKernel(_scatter_rows_kernel, pdl=True)


def scatter_rows_to_slots(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache[slots[i]] = rows[i]`` for every ``i`` with ``slots[i] >= 0``; rows of slot ``-1``
    (padding) are skipped. In place, no host sync (fit for CUDA-graph capture).

    Args:
        cache: ``[num_slots, H]``, unit stride along ``H``.
        rows: ``[n, H]`` (unit stride along ``H``); another float dtype than ``cache``'s is cast
            (torch form then).
        slots: ``[n]`` int64, each ``-1`` or in ``[0, num_slots)``; row 0's must be real (the torch
            form relies on it). A slot out of range is not checked (the kernel writes out of bounds,
            the torch form raises or trips a device assert), as in any paged-cache write.

    Raises:
        ValueError: shapes that do not match, or a non-unit inner stride.
    """
    if cache.dim() != 2 or rows.dim() != 2 or slots.dim() != 1 or rows.shape[0] != slots.shape[0] \
            or rows.shape[1] != cache.shape[1] or cache.stride(1) != 1 or rows.stride(1) != 1:
        raise ValueError(f"scatter_rows_to_slots needs cache [num_slots, H], rows [n, H] and slots [n] with unit "
                         f"inner strides, got {list(cache.shape)}, {list(rows.shape)}, {list(slots.shape)}")
    n = rows.shape[0]
    if n == 0:
        return
    if rows.dtype != cache.dtype or slots.dtype != torch.int64 or not use_triton(cache, rows, slots):
        scatter_rows_to_slots_ref(cache, rows, slots)
        return
    h = rows.shape[1]
    block = min(BLOCK_COLS, next_power_of_2(h))
    _kernel[(n,)](cache, rows, slots, h, cache.stride(0), rows.stride(0), BLOCK_N=block,
                  num_warps=4 if block * rows.element_size() >= 2048 else 1)
