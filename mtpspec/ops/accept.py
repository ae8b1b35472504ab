"""Greedy acceptance of draft tokens in one launch: ``a`` = the length of the prefix where each
draft equals the target's argmax at its position, then the emitted block ``[B, k + 1]``: the
target's tokens up to slot ``a`` (the accepted drafts equal them, slot ``a`` is the recovered or
bonus token), :data:`~mtpspec.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID` after (speculative
decoding's greedy rule: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", sec. 2.3, with a one-hot target distribution).

The torch form (:func:`greedy_accept_ref`) is about ten elementwise launches (compare, cumulative
product, sum, two selects, padding); at decode sizes each is a launch's latency, paid every
engine step on the host's critical path. Triton: one program per sequence.
"""

from __future__ import annotations

from typing import Tuple

import torch

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, next_power_of_2, tl, use_triton

#: What the emitted block holds past the recovered / bonus token (the rejection sampler's value).
PLACEHOLDER = -1

if HAS_TRITON:
    def _greedy_accept_kernel(d_ptr, t_ptr, out_ptr, acc_ptr, stride_d, stride_t, stride_o, K: tl.constexpr,
                              K1_P2: tl.constexpr, PAD: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, K1_P2)
        tgt = tl.load(t_ptr + b * stride_t + j, mask=j < K + 1, other=0)
        d = tl.load(d_ptr + b * stride_d + j, mask=j < K, other=0)
        miss = (j >= K) | (d != tgt)  # slot K always ends the prefix (the bonus token)
        a = tl.min(tl.where(miss, j, K1_P2), 0)
        tl.store(out_ptr + b * stride_o + j, tl.where(j <= a, tgt, PAD), mask=j < K + 1)
        tl.store(acc_ptr + b, a.to(tl.int64))

    _greedy_accept = LazyKernel(_greedy_accept_kernel)


def greedy_accept_ref(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`greedy_accept` (same arguments and results)."""
    b, k = draft_ids.shape
    a = (draft_ids == target_ids[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
    slots = torch.arange(k + 1, device=draft_ids.device).unsqueeze(0)
    out = torch.where(slots <= a.unsqueeze(1), target_ids, torch.full_like(target_ids, PLACEHOLDER))
    return out, a


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification's result from the target's argmax tokens (module docstring).

    Args:
        draft_ids: ``[B, k]`` int64 drafts.
        target_ids: ``[B, k + 1]`` int64, the target's argmax at each verified row.

    Returns:
        ``(tokens [B, k + 1] int64, num_accepted [B] int64 in [0, k])``.

    Raises:
        ValueError: shapes that do not fit (``[B, k]`` and ``[B, k + 1]``) or dtypes other than int64.
    """
    b, k = draft_ids.shape
    if target_ids.shape != (b, k + 1) or draft_ids.dtype != torch.int64 or target_ids.dtype != torch.int64:
        raise ValueError(f"greedy_accept: draft_ids {list(draft_ids.shape)} {draft_ids.dtype} and target_ids "
                         f"{list(target_ids.shape)} {target_ids.dtype} must be int64 [B, k] and [B, k + 1]")
    if not use_triton(draft_ids, target_ids) or draft_ids.stride(1) != 1 or target_ids.stride(1) != 1:
        return greedy_accept_ref(draft_ids, target_ids)
    out = torch.empty(b, k + 1, dtype=torch.int64, device=draft_ids.device)
    acc = torch.empty(b, dtype=torch.int64, device=draft_ids.device)
    if b:
        _greedy_accept[(b,)](draft_ids, target_ids, out, acc, draft_ids.stride(0), target_ids.stride(0), out.stride(0),
                             K=k, K1_P2=next_power_of_2(k + 1), PAD=PLACEHOLDER, num_warps=1)
    return out, acc


__all__ = ["PLACEHOLDER", "greedy_accept", "greedy_accept_ref"]
