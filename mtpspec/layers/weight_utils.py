"""Checks and copies shared by the layers' ``weight_loader`` methods.

Every loader receives the FULL, unsharded checkpoint tensor, checks its shape and dtype, and
copies this rank's slice into the parameter (converting to the parameter's dtype and device).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def check_full_tensor(what: str, loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """Raise unless ``loaded`` is a floating tensor of shape ``expected``.

    Args:
        what: names the tensor in the message (layer, parameter, shard).
        loaded: the checkpoint tensor.
        expected: the full (unsharded) shape it must have.

    Raises:
        TypeError: ``loaded`` is not a floating-point tensor.
        ValueError: its shape is not ``expected`` (the message names both shapes).
    """
    if not isinstance(loaded, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(loaded).__name__}")
    if not loaded.is_floating_point():
        raise TypeError(f"{what}: checkpoint tensor must be floating point, got {loaded.dtype}")
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: expected full shape {list(expected)}, got {list(loaded.shape)}")


@torch.no_grad()
def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` converted to ``dst``'s dtype and device (shapes must already match)."""
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor,
                          loaded_shard_id: Optional[Any] = None) -> None:
    """Load a replicated parameter: ``loaded_weight`` must have ``param``'s full shape.

    Raises:
        ValueError: a shard id was given (replicated parameters have none) or the shape differs.
        TypeError: ``loaded_weight`` is not floating point.
    """
    if loaded_shard_id is not None:
        raise ValueError(f"replicated parameter takes no shard id, got {loaded_shard_id!r}")
    check_full_tensor("replicated parameter", loaded_weight, param.shape)
    copy_into(param.data, loaded_weight)
