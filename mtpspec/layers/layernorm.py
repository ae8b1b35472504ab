"""RMSNorm (and the biased LayerNorm of the DSA indexer) layers.

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4).

``y = x / sqrt(mean(x**2, -1) + eps) * weight`` with fp32 statistics, cast back to ``x.dtype``.
With a residual, follows the fused-add convention of ``docs/structures.md``:
``forward(x, residual) -> (norm(s), s)`` where ``s = round_to_dtype(x + residual)`` is formed in fp32.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from mtpspec.layers.weight_utils import default_weight_loader
from mtpspec.ops import fused_add_rms_norm, rms_norm  # Triton on CUDA / TRITON_INTERPRET=1, else *_ref


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension.

    Args:
        hidden_size: size of the normalised (last) dimension, >= 1.
        eps: added to the mean square before the square root (> 0 recommended; must be >= 0).
        params_dtype: dtype of ``weight`` (default: ``torch.get_default_dtype()``).

    Attributes:
        weight: ``[hidden_size]``, initialised to ones; ``weight.weight_loader`` copies a full
            ``[hidden_size]`` checkpoint tensor (converted to ``params_dtype``).
        eps / variance_epsilon: the epsilon (``variance_epsilon`` is vLLM's and Hugging Face's name).

    Raises:
        ValueError: ``hidden_size < 1`` or ``eps < 0``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"RMSNorm: hidden_size must be an int >= 1, got {hidden_size!r}")
        if not eps >= 0:
            raise ValueError(f"RMSNorm: eps must be >= 0, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    @property
    def variance_epsilon(self) -> float:
        """Alias of :attr:`eps`."""
        return self.eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Normalise ``x``; with ``residual``, normalise ``x + residual`` and return the sum too.

        Args:
            x: ``[..., hidden_size]`` (typically ``[num_tokens, hidden_size]``), floating point.
            residual: ``None`` or a tensor of ``x``'s shape and dtype.

        Returns:
            ``residual is None``: ``norm(x)``, ``x``'s shape and dtype.
            Otherwise ``(norm(s), s)`` with ``s = (x.float() + residual.float()).to(x.dtype)``.

        Raises:
            ValueError: last dimension is not ``hidden_size``, or ``residual``'s shape differs.
            TypeError: ``x`` is not floating point, or ``residual``'s dtype differs from ``x``'s.
        """
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"RMSNorm: expected input [..., {self.hidden_size}], got {list(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"RMSNorm: input must be floating point, got {x.dtype}")
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"RMSNorm: residual shape {list(residual.shape)} != input shape {list(x.shape)}")
            if residual.dtype != x.dtype:
                raise TypeError(f"RMSNorm: residual dtype {residual.dtype} != input dtype {x.dtype}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        if residual is None:
            return rms_norm(x2, self.weight, self.eps).reshape(x.shape)
        out, s = fused_add_rms_norm(x2, residual.reshape(-1, self.hidden_size), self.weight, self.eps)
        return out.reshape(lead + (self.hidden_size,)), s.reshape(lead + (self.hidden_size,))

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(nn.Module):
    """Layer normalisation with a bias (Ba, Kiros & Hinton 2016, "Layer Normalization", eq. 4):
    ``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension, as
    ``torch.nn.LayerNorm`` computes it (the DSA indexer's ``k_norm``).

    Args:
        hidden_size: size of the normalised (last) dimension, >= 1.
        eps: added to the variance (>= 0).
        params_dtype: dtype of ``weight`` and ``bias`` (default ``torch.get_default_dtype()``).

    Attributes:
        weight, bias: ``[hidden_size]`` (ones / zeros until loaded), each with a
            ``weight_loader`` that copies a full ``[hidden_size]`` checkpoint tensor.

    ``forward(x [..., hidden_size]) -> x``'s shape and dtype.

    Raises:
        ValueError: ``hidden_size < 1``, ``eps < 0``, or an input whose last dimension differs.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"LayerNorm: hidden_size must be an int >= 1, got {hidden_size!r}")
        if not eps >= 0:
            raise ValueError(f"LayerNorm: eps must be >= 0, got {eps!r}")
        self.hidden_size, self.eps = hidden_size, float(eps)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"LayerNorm: expected input [..., {self.hidden_size}], got {list(x.shape)}")
        return torch.nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
