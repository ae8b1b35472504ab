"""Process groups for tensor parallelism.

One tensor-parallel (TP) group spans the whole world (no pipeline or data
parallelism yet). When no process group was initialised, every accessor
behaves as a single-rank group, so layers and models run unchanged in one
process (tp = 1) without ``torch.distributed``.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("MTPSPEC_DIST_TIMEOUT_S", "120"))


@dataclass
class GroupCoordinator:
    """A process group and this process's place in it.

    Attributes:
        rank_in_group: this process's rank inside the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group.
        device_group: the ``torch.distributed`` group (``None`` when ``world_size == 1``
            and no process group exists).
        backend: ``"nccl"``, ``"gloo"`` or ``"none"`` (single process).
        device: the device this rank's tensors live on.
    """

    rank_in_group: int
    world_size: int
    device_group: Optional[dist.ProcessGroup]
    backend: str
    device: torch.device

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0


_TP: Optional[GroupCoordinator] = None


def _single_process_group() -> GroupCoordinator:
    return GroupCoordinator(0, 1, None, "none", torch.device("cpu"))


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    local_rank: int = -1,
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GroupCoordinator:
    """Initialise ``torch.distributed`` and the tensor-parallel group.

    Arguments default to the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); our launcher sets the same
    variables. The backend is NCCL when CUDA is available and every rank has its
    own GPU, gloo otherwise (several ranks sharing one GPU must use gloo: NCCL
    refuses duplicate devices).

    Args:
        world_size, rank, local_rank: -1 reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``
            (defaults 1, 0, rank).
        backend: ``"nccl"``, ``"gloo"`` or ``None`` for the choice above.
        init_method: a ``torch.distributed`` init URL; default ``env://``.
        timeout_s: seconds a rendezvous or collective may wait for a missing or dead
            peer before raising (``torch.distributed.DistBackendError`` / ``RuntimeError``)
            instead of hanging. Default ``MTPSPEC_DIST_TIMEOUT_S`` or 120 s.

    Returns:
        The tensor-parallel :class:`GroupCoordinator`.

    Raises:
        ValueError: inconsistent rank / world size.
        RuntimeError: rendezvous failed or timed out.
    """
    global _TP
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size < 0 else world_size
    rank = int(os.environ.get("RANK", "0")) if rank < 0 else rank
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank))) if local_rank < 0 else local_rank
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if backend is None:
        backend = default_backend(world_size)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")

    if backend == "nccl" or torch.cuda.is_available():
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)) \
            if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if world_size == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
        _TP = GroupCoordinator(0, 1, None, "none", device)
        return _TP

    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend=backend,
            init_method=init_method or "env://",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        atexit.register(_destroy_at_exit)
    _TP = GroupCoordinator(rank, world_size, dist.group.WORLD, backend, device)
    return _TP


def _destroy_at_exit() -> None:
    """At interpreter exit: meet the peers (bounded), then destroy the process group.

    A process that exits with its gloo group alive, or while a peer still reads from it, aborts in
    the group's destructor ("terminate called without an active exception"); seen under torchrun
    when ranks finished at different moments. Errors here (a dead peer, a timeout) are ignored:
    the process is leaving anyway.
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def default_backend(world_size: int) -> str:
    """``"nccl"`` when CUDA exists and there is a GPU per rank, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def destroy_distributed_environment() -> None:
    """Tear down the process group (if any) and reset the TP group to a single rank."""
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = None


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group; a single-rank group when none was initialised."""
    return _TP if _TP is not None else _single_process_group()


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group (0 when uninitialised)."""
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    """Number of tensor-parallel ranks (1 when uninitialised)."""
    return get_tp_group().world_size
