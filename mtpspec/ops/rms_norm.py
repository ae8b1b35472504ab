"""RMSNorm and fused residual-add + RMSNorm: torch references.

RMSNorm (Zhang & Sennrich 2019, eq. 4): ``y = x / sqrt(mean(x**2) + eps) * weight``,
computed in fp32 and cast back to ``x.dtype``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


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
