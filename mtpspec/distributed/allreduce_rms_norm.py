"""Fused trailing all-reduce + residual add + RMSNorm of the MTP draft path.

The MTP layer's block leaves its output un-reduced (``RowParallelLinear(reduce_results=False)``,
MoE partial sums). :func:`fused_allreduce_rms_norm` finishes it in one call:
``(rms_norm(all_reduce(h) + residual), all_reduce(h) + residual)``.

Backends implement :class:`AllReduceRMSNormBackend`: a name, the largest input (bytes =
``num_tokens * hidden_size * element_size``) they accept, and the call. The dispatcher tries
registered backends in priority order and falls back to the exact NCCL backend
(:class:`NcclAllReduceThenAddRMSNorm`) for anything no other backend accepts. The one-kernel
peer-memory backend (:mod:`mtpspec.distributed.p2p_allreduce_rms_norm`) is one such backend.

Engine selection: the backend is a per-process setting, chosen once per rank at worker start by
:func:`init_allreduce_rms_norm_backend` from ``ParallelConfig.allreduce_backend`` (``"nccl"`` or
``"p2p"``), as vLLM sets up its custom all-reduce in ``parallel_state``; call sites (the MTP
layer's fused tail) stay ``fused_allreduce_rms_norm(hidden, residual, norm)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import List, Optional, Tuple

import torch

from mtpspec.config import ALLREDUCE_BACKENDS  # noqa: F401 - engine-level names, re-exported
from mtpspec.distributed import (
    get_tensor_model_parallel_world_size, sp_all_gather, sp_shard, tensor_model_parallel_all_reduce,
    tensor_model_parallel_reduce_scatter)
from mtpspec.ops.rms_norm import fused_add_rms_norm


class AllReduceRMSNormBackend(ABC):
    """One way to compute ``norm(all_reduce(h) + residual)`` across the TP group.

    Attributes:
        name: short identifier, reported in :func:`backend_usage`.
        max_bytes: the largest ``hidden_states`` (in bytes) this backend accepts; the
            dispatcher never hands it more. ``None`` means no limit.
    """

    name: str = "abstract"
    max_bytes: Optional[int] = None

    def accepts(self, hidden_states: torch.Tensor) -> bool:
        """Whether this backend can take ``hidden_states`` (size limit; override for more)."""
        if self.max_bytes is None:
            return True
        return hidden_states.numel() * hidden_states.element_size() <= self.max_bytes

    @abstractmethod
    def __call__(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(normed, new_residual)``, both ``[num_tokens, hidden_size]`` in h's dtype."""


class NcclAllReduceThenAddRMSNorm(AllReduceRMSNormBackend):
    """The exact fallback: one ``tensor_model_parallel_all_reduce`` feeding the fused
    add + RMSNorm kernel (two launches, one collective). Accepts any size."""

    name = "allreduce+fused_add_rms_norm"

    def __call__(self, hidden_states, residual, weight, eps):
        reduced = tensor_model_parallel_all_reduce(hidden_states)
        return fused_add_rms_norm(reduced, residual, weight, eps)


class ReduceScatterNormAllGather(AllReduceRMSNormBackend):
    """Reduce-scatter over tokens, add + norm this rank's ``ceil(T / tp)`` rows, all-gather.

    Moves the same bytes as a ring all-reduce but does ``1 / tp`` of the norm work per rank;
    pays off for large token counts. Pads the token dim with ``(-T) % tp`` zero rows (their
    norm is 0, not NaN, since eps > 0) and trims them after the gather.
    """

    name = "reduce_scatter+norm+all_gather"

    def __init__(self, max_bytes: Optional[int] = None):
        self.max_bytes = max_bytes

    def __call__(self, hidden_states, residual, weight, eps):
        tp = get_tensor_model_parallel_world_size()
        num_tokens = hidden_states.shape[0]
        pad = (-num_tokens) % tp
        h = hidden_states
        if pad:
            h = torch.cat([h, h.new_zeros((pad, h.shape[1]))])
        local = tensor_model_parallel_reduce_scatter(h, dim=0)
        local_res = sp_shard(residual) if residual is not None else None
        normed, new_res = fused_add_rms_norm(local, local_res, weight, eps)
        both = sp_all_gather(torch.cat([normed, new_res], dim=1))[:num_tokens]
        hidden = hidden_states.shape[1]
        return both[:, :hidden].contiguous(), both[:, hidden:].contiguous()


_FALLBACK = NcclAllReduceThenAddRMSNorm()
_BACKENDS: List[AllReduceRMSNormBackend] = []
_USAGE: Counter = Counter()


def register_allreduce_rms_norm_backend(backend: AllReduceRMSNormBackend) -> None:
    """Add ``backend`` ahead of those already registered (the fallback stays last)."""
    _BACKENDS.insert(0, backend)


def unregister_allreduce_rms_norm_backend(backend: AllReduceRMSNormBackend) -> None:
    """Remove a backend added with :func:`register_allreduce_rms_norm_backend`."""
    _BACKENDS.remove(backend)


def backend_usage() -> dict:
    """How many calls each backend served in this process: ``{name: calls}``."""
    return dict(_USAGE)


#: Default capacity of the engine's p2p backend: the largest ``hidden_states`` it takes, in bytes
#: (larger calls, e.g. prefills, go to the NCCL fallback). vLLM's custom all-reduce uses 8 MiB too.
DEFAULT_P2P_CAPACITY_BYTES = 8 << 20

_ENGINE_BACKEND: Optional[AllReduceRMSNormBackend] = None
_ENGINE_BACKEND_NAME = "nccl"


def check_allreduce_backend_supported(name: str, device: torch.device) -> None:
    """Raise ValueError unless backend ``name`` can run on ``device`` in this process.

    ``"nccl"`` runs everywhere. ``"p2p"`` needs Triton and either a CUDA device or a CPU device
    with Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` was first imported
    and at call time), and ranks on one host (not checked here: peer-memory setup fails clearly).
    """
    if name not in ALLREDUCE_BACKENDS:
        raise ValueError(f"allreduce_backend must be one of {list(ALLREDUCE_BACKENDS)}, got {name!r}")
    if name != "p2p":
        return
    from mtpspec.ops.triton_utils import HAS_TRITON, interpreter_available, interpreting
    if not HAS_TRITON:
        raise ValueError("allreduce_backend='p2p' needs Triton, which is not installed; use 'nccl' "
                         "(CLI: --allreduce-backend nccl)")
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting() and interpreter_available():
        return
    raise ValueError(f"allreduce_backend='p2p' runs its Triton kernel on CUDA GPUs, or on CPU only under "
                     f"Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported; tests); "
                     f"this rank's device is {device}; use allreduce_backend='nccl' (CLI: --allreduce-backend nccl)")


def init_allreduce_rms_norm_backend(name: str = "nccl", capacity_bytes: int = DEFAULT_P2P_CAPACITY_BYTES,
                                    device: Optional[torch.device] = None) -> Optional[AllReduceRMSNormBackend]:
    """Select this process's backend of :func:`fused_allreduce_rms_norm` (once per rank, at worker start).

    A collective for ``"p2p"`` at tp > 1: call it on every rank of the TP group, after
    ``init_distributed_environment``, with the same arguments. Replaces (unregisters and closes)
    the backend a previous call installed; backends registered by hand with
    :func:`register_allreduce_rms_norm_backend` are left alone.

    Args:
        name: ``"nccl"`` (default: the exact fallback serves every call) or ``"p2p"`` (a
            :class:`~mtpspec.distributed.p2p_allreduce_rms_norm.P2PAllReduceRMSNorm` serves calls up
            to ``capacity_bytes``; larger ones take the NCCL fallback).
        capacity_bytes: the p2p backend's largest input in bytes (default
            :data:`DEFAULT_P2P_CAPACITY_BYTES`); ignored for ``"nccl"``.
        device: this rank's device (default: the TP group's).

    Returns:
        The installed backend, or ``None`` for ``"nccl"`` and at tp 1 (no collective at all: the
        choice is a no-op there).

    Raises:
        ValueError: an unknown name (the message lists :data:`ALLREDUCE_BACKENDS`), or ``"p2p"``
            on a device it cannot run on (see :func:`check_allreduce_backend_supported`).
        RuntimeError: peer memory could not be set up (e.g. ranks on different hosts).
    """
    global _ENGINE_BACKEND, _ENGINE_BACKEND_NAME
    from mtpspec.distributed.parallel_state import get_tp_group
    group = get_tp_group()
    dev = torch.device(device) if device is not None else group.device
    if name not in ALLREDUCE_BACKENDS:
        raise ValueError(f"allreduce_backend must be one of {list(ALLREDUCE_BACKENDS)}, got {name!r}")
    close_allreduce_rms_norm_backend()
    if name == "nccl" or group.world_size == 1:
        _ENGINE_BACKEND_NAME = name
        return None
    check_allreduce_backend_supported(name, dev)
    from mtpspec.distributed.p2p_allreduce_rms_norm import P2PAllReduceRMSNorm
    backend = P2PAllReduceRMSNorm(int(capacity_bytes), device=dev)
    register_allreduce_rms_norm_backend(backend)
    _ENGINE_BACKEND, _ENGINE_BACKEND_NAME = backend, name
    return backend


def get_allreduce_rms_norm_backend() -> str:
    """The engine-level backend name chosen in this process (``"nccl"`` until
    :func:`init_allreduce_rms_norm_backend` picks another)."""
    return _ENGINE_BACKEND_NAME


def close_allreduce_rms_norm_backend() -> None:
    """Unregister and close the backend :func:`init_allreduce_rms_norm_backend` installed (if
    any); the process is back to ``"nccl"``. Every rank calls it, after its last call."""
    global _ENGINE_BACKEND, _ENGINE_BACKEND_NAME
    b, _ENGINE_BACKEND, _ENGINE_BACKEND_NAME = _ENGINE_BACKEND, None, "nccl"
    if b is not None:
        if b in _BACKENDS:
            unregister_allreduce_rms_norm_backend(b)
        close = getattr(b, "close", None)
        if callable(close):
            close()


def select_backend(hidden_states: torch.Tensor) -> AllReduceRMSNormBackend:
    """The first registered backend that accepts ``hidden_states``, else the exact fallback."""
    for b in _BACKENDS:
        if b.accepts(hidden_states):
            return b
    return _FALLBACK


def fused_allreduce_rms_norm(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                             norm: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """All-reduce over the TP group, residual add and RMSNorm in one call.

    Equals ``norm(tensor_model_parallel_all_reduce(hidden_states), residual)`` with the
    fused-add convention of ``mtpspec.layers.RMSNorm`` (sum formed in fp32, rounded once to
    the dtype; fp32 statistics).

    Args:
        hidden_states: ``[num_tokens, hidden_size]``, this rank's un-reduced partial sum
            (bf16 / fp16 / fp32).
        residual: ``[num_tokens, hidden_size]`` in the same dtype, or ``None`` for no
            residual add (never read).
        norm: an RMSNorm module with ``weight`` ``[hidden_size]`` and ``eps``.

    Returns:
        ``(normed, new_residual)``, each ``[num_tokens, hidden_size]`` in ``hidden_states``'
        dtype; ``new_residual = all_reduce(hidden_states) + residual``. At tp 1 no collective
        is issued.

    Raises:
        ValueError: ``hidden_states`` is not 2-D, or ``residual`` / ``norm.weight`` shapes or
            dtypes disagree with it.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [num_tokens, hidden_size], got shape {tuple(hidden_states.shape)}")
    if residual is not None and (residual.shape != hidden_states.shape or residual.dtype != hidden_states.dtype):
        raise ValueError(f"residual must match hidden_states {tuple(hidden_states.shape)} {hidden_states.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    weight, eps = norm.weight, norm.eps
    if tuple(weight.shape) != (hidden_states.shape[1],):
        raise ValueError(f"norm weight must be [{hidden_states.shape[1]}], got {tuple(weight.shape)}")
    if get_tensor_model_parallel_world_size() == 1:
        _USAGE["local"] += 1
        return fused_add_rms_norm(hidden_states, residual, weight, eps)
    backend = select_backend(hidden_states)
    _USAGE[backend.name] += 1
    return backend(hidden_states, residual, weight, eps)
