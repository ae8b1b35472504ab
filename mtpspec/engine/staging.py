"""One host -> device copy for a step's small input arrays.

A step's inputs are a dozen small arrays (token ids, positions, slots, block tables, query
offsets, ...). Copied one by one from pageable memory, each costs the host a driver staging
copy (an H200 host measured 0.4-0.8 ms for :func:`~mtpspec.engine.input_prep.prepare_step` at
batch 1); with async scheduling that time sits between two steps on the critical path.
:class:`Staging` packs them into a persistent pinned buffer and issues one ``non_blocking`` copy
into a fresh device buffer; the step's tensors are views of it. On a CPU device the arrays are
wrapped as they are (no copy).

The pinned buffers are double-buffered: a buffer is refilled only after the event recorded
behind its last copy completed (one step later, long done in practice).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

_ALIGN = 16  # bytes: every view starts aligned for any dtype
_NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64}


class _PinnedRing:
    """Two growing pinned host buffers with the events of their last copies."""

    def __init__(self) -> None:
        self.bufs: List[Optional[torch.Tensor]] = [None, None]
        self.events: List[Optional[torch.cuda.Event]] = [None, None]
        self.turn = 0

    def take(self, nbytes: int) -> Tuple[int, torch.Tensor]:
        i = self.turn = 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(max(nbytes, 1 << 16) * 2, dtype=torch.uint8, pin_memory=True)
        return i, buf


_RINGS: Dict[torch.device, _PinnedRing] = {}


class Staging:
    """Collect arrays (:meth:`add`), then move them in one copy (:meth:`flush`).

    Args:
        device: where the tensors go.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.arrays: List[Tuple[np.ndarray, torch.dtype]] = []

    def add(self, a, dtype: torch.dtype = torch.int64) -> int:
        """Queue ``a`` (array-like) as a ``dtype`` tensor of its shape; returns its index in :meth:`flush`.

        Raises:
            TypeError: a dtype other than int32 / int64 / float32 / float64.
        """
        if dtype not in _NP:
            raise TypeError(f"Staging.add: dtype must be one of {list(_NP)}, got {dtype}")
        self.arrays.append((np.require(np.asarray(a, dtype=_NP[dtype]), requirements="C"), dtype))
        return len(self.arrays) - 1

    def flush(self) -> List[torch.Tensor]:
        """The queued arrays as device tensors, in :meth:`add` order (one host -> device copy on CUDA)."""
        arrays, self.arrays = self.arrays, []
        if self.device.type != "cuda":
            return [torch.from_numpy(a).to(self.device) for a, _ in arrays]
        offs, total = [], 0
        for a, _ in arrays:
            offs.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        ring = _RINGS.setdefault(self.device, _PinnedRing())
        i, host = ring.take(total)
        view = host.numpy()
        for (a, _), off in zip(arrays, offs):
            view[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
        dev.copy_(host[:total], non_blocking=True)
        ev = ring.events[i] = torch.cuda.Event()
        ev.record()
        return [dev[off:off + a.nbytes].view(dtype).view(a.shape) for (a, dtype), off in zip(arrays, offs)]
