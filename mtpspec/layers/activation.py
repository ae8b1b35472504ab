"""Gated activation of SwiGLU MLPs (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``.

    Input ``[num_tokens, 2 * d]`` (gate half first, then up half, as
    ``MergedColumnParallelLinear([d, d])`` lays them out); output ``[num_tokens, d]``, same dtype.

    Raises:
        ValueError: the last dimension is odd.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul needs an even last dimension, got {tuple(x.shape)}")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
