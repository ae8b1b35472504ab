"""Host -> device copies of a step's small host arrays without a host stall.

A ``non_blocking`` copy from pageable host memory is staged by the driver synchronously (tens of
microseconds each, a dozen per step); from pinned memory it is queued like a kernel. The
engine's per-step inputs therefore go through :func:`to_device`, which pins on CUDA (PyTorch's
caching host allocator reuses a pinned block only after the copies that read it completed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(a: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``a`` (numpy array, list or CPU tensor) as a ``dtype`` tensor on ``device``, queued without
    waiting (pinned staging on CUDA; a plain conversion elsewhere)."""
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(a)))
    if t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)
