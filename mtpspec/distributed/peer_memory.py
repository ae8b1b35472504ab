"""Peer memory: one byte buffer per rank of a host, every rank's buffer mapped into every rank.

A one-shot collective kernel (``mtpspec.distributed.p2p_allreduce_rms_norm``) stores straight into its
peers' buffers, so each rank needs the addresses, valid in its own process, of all ranks'
buffers. :func:`allocate_peer_buffers` makes them, once, at start-up (a collective over the TP
group):

* **CUDA** (ranks on the GPUs of one host, or several ranks on one GPU): each rank allocates
  its buffer with the caching allocator and shares it with CUDA IPC
  (``torch.multiprocessing.reductions.reduce_tensor`` gives a picklable recipe holding the
  ``cudaIpcMemHandle``); the recipes travel by ``all_gather_object`` over the group (gloo or
  NCCL), and each rank opens its peers' handles *on its own device*, as CUDA's
  ``cudaIpcOpenMemHandle`` with lazy peer access expects, so its kernels can store into them
  over NVLink / PCIe (or into the same GPU's memory when ranks share one). No multicast object
  is ever created.
* **CPU** (tests, with Triton's interpreter): each rank creates a file under ``/dev/shm`` with a
  name unique to this launch, the ranks exchange the names, map each other's files, and unlink
  them once all are mapped (the mappings live on; nothing is left behind, even after a crash).

Either way a handshake then proves the mapping: every rank writes a marker into every peer's
buffer through its mapping and checks that all markers arrived in its own, so a broken mapping
fails at start-up with a clear error rather than inside a kernel.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from mtpspec.distributed.parallel_state import get_tp_group

#: Bytes at the start of every buffer used by the start-up handshake (one int64 per rank, up to
#: 64 ranks); zeroed again before :func:`allocate_peer_buffers` returns.
HANDSHAKE_BYTES = 8 * 64


@dataclass
class PeerBuffers:
    """Every rank's buffer as mapped into this process.

    Attributes:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        nbytes: size of each rank's buffer, in bytes (equal on every rank).
        device: where the buffers live (``cuda:i`` or ``cpu``).
        kind: ``"cuda_ipc"``, ``"shm"`` (CPU shared memory) or ``"local"`` (world size 1).
        buffers: ``world_size`` uint8 tensors ``[nbytes]``; ``buffers[rank]`` is this rank's own,
            the others are mappings of the peers' buffers (zero-initialised at start-up).
        files: for ``"shm"``, the shared-memory file of each rank (already unlinked: the names
            no longer exist once allocation returned); empty otherwise.
    """

    rank: int
    world_size: int
    nbytes: int
    device: torch.device
    kind: str
    buffers: List[torch.Tensor]
    files: List[str] = field(default_factory=list)
    _keep: List[Any] = field(default_factory=list, repr=False)

    def addresses(self, offset: int = 0) -> List[int]:
        """The address (in this process) of byte ``offset`` of every rank's buffer, rank order."""
        if not 0 <= offset <= self.nbytes:
            raise ValueError(f"offset {offset} outside the {self.nbytes}-byte buffers")
        return [b.data_ptr() + offset for b in self.buffers]

    def address_table(self, offset: int = 0) -> torch.Tensor:
        """:meth:`addresses` as an int64 tensor ``[world_size]`` on :attr:`device`, for a kernel
        that turns each entry into a pointer (``tl.load(table + r).to(tl.pointer_type(...))``)."""
        return torch.tensor(self.addresses(offset), dtype=torch.int64, device=self.device)

    def close(self) -> None:
        """Drop this process's mappings (call on every rank, after the last kernel using them
        has finished; CUDA IPC mappings are released when their tensors are freed)."""
        self.buffers = []
        for obj in self._keep:
            if isinstance(obj, mmap.mmap):
                try:
                    obj.close()
                except BufferError:  # a tensor view still exists: the GC unmaps it later
                    pass
        self._keep = []


def _gather(obj: Any, group: Optional[dist.ProcessGroup], world_size: int) -> List[Any]:
    out: List[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def _map_file(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)  # zero-filled
        elif os.fstat(fd).st_size != nbytes:
            raise RuntimeError(f"peer buffer {path} has {os.fstat(fd).st_size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _allocate_shm(nbytes: int, rank: int, world_size: int,
                  group: Optional[dist.ProcessGroup]) -> PeerBuffers:
    path = os.path.join(_shm_dir(), f"mtpspec-p2p-{os.getpid()}-{uuid.uuid4().hex}-r{rank}")
    maps: List[mmap.mmap] = []
    try:
        own = _map_file(path, nbytes, create=True)
        paths = _gather(path, group, world_size)
        for r, p in enumerate(paths):
            maps.append(own if r == rank else _map_file(p, nbytes, create=False))
        dist.barrier(group=group)  # every rank has mapped every file
    finally:
        os.unlink(path)
    buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    return PeerBuffers(rank, world_size, nbytes, torch.device("cpu"), "shm", buffers, list(paths), list(maps))


def _rebuild_on_device(recipe: Any, device_index: int) -> torch.Tensor:
    """Open a peer's CUDA IPC recipe from ``reduce_tensor`` on ``device_index`` (this rank's
    device), so the mapping belongs to the context that launches the kernels."""
    import inspect

    fn, args = recipe
    params = list(inspect.signature(fn).parameters)
    if "storage_device" not in params:
        raise RuntimeError(f"unexpected CUDA IPC rebuild function {fn.__name__}{tuple(params)}; "
                           "this torch version is not supported by peer_memory")
    args = list(args)
    args[params.index("storage_device")] = device_index
    return fn(*args)


def _allocate_cuda_ipc(nbytes: int, rank: int, world_size: int, device: torch.device,
                       group: Optional[dist.ProcessGroup]) -> PeerBuffers:
    from torch.multiprocessing.reductions import reduce_tensor

    own = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)  # zeroed before any peer can write into it
    recipes = _gather(reduce_tensor(own), group, world_size)
    buffers: List[torch.Tensor] = []
    for r, recipe in enumerate(recipes):
        if r == rank:
            buffers.append(own)
            continue
        try:
            buffers.append(_rebuild_on_device(recipe, device.index))
        except Exception as exc:
            raise RuntimeError(f"rank {rank}: could not open rank {r}'s CUDA IPC buffer on "
                               f"{device} ({exc}); peer memory needs all ranks on one host") from exc
        if buffers[-1].numel() != nbytes:
            raise RuntimeError(f"rank {r}'s buffer has {buffers[-1].numel()} bytes, expected {nbytes}")
    dist.barrier(group=group)
    return PeerBuffers(rank, world_size, nbytes, device, "cuda_ipc", buffers, [], [recipes])


def _handshake(pb: PeerBuffers, group: Optional[dist.ProcessGroup]) -> None:
    """Each rank writes ``1000 + rank`` into slot ``rank`` of every buffer through its own mapping,
    then checks its own buffer holds every rank's marker, then clears it."""
    for buf in pb.buffers:
        buf[:HANDSHAKE_BYTES].view(torch.int64)[pb.rank] = 1000 + pb.rank
    if pb.device.type == "cuda":
        torch.cuda.synchronize(pb.device)
    dist.barrier(group=group)
    got = pb.buffers[pb.rank][:HANDSHAKE_BYTES].view(torch.int64)[:pb.world_size].cpu().tolist()
    want = [1000 + r for r in range(pb.world_size)]
    dist.barrier(group=group)  # every rank has read its markers before any is cleared
    pb.buffers[pb.rank][:HANDSHAKE_BYTES].zero_()
    if pb.device.type == "cuda":
        torch.cuda.synchronize(pb.device)
    dist.barrier(group=group)
    if got != want:
        raise RuntimeError(f"peer memory handshake failed on rank {pb.rank}: expected markers {want} "
                           f"from ranks 0..{pb.world_size - 1}, found {got} ({pb.kind})")


def allocate_peer_buffers(nbytes: int, device: Optional[torch.device] = None,
                          group: Optional[dist.ProcessGroup] = None) -> PeerBuffers:
    """Allocate a zeroed ``nbytes`` buffer on every rank and map all of them into every rank.

    A collective: every rank of ``group`` must call it with the same ``nbytes``.

    Args:
        nbytes: bytes per rank's buffer, ``> HANDSHAKE_BYTES``.
        device: this rank's device; default the TP group's device (``cuda:i`` or ``cpu``).
        group: the process group; default the TP group's (the whole world).

    Returns:
        A :class:`PeerBuffers`; keep it alive as long as kernels use the addresses.

    Raises:
        ValueError: ``nbytes`` too small, ranks disagree on ``nbytes``, or an unsupported device.
        RuntimeError: a peer's buffer could not be mapped, or the handshake found a marker
            missing (the mapping does not reach the peer's memory).
    """
    tp = get_tp_group()
    device = torch.device(device) if device is not None else tp.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"peer memory needs a cuda or cpu device, got {device}")
    nbytes = int(nbytes)
    if nbytes <= HANDSHAKE_BYTES:
        raise ValueError(f"nbytes must be > {HANDSHAKE_BYTES}, got {nbytes}")
    if tp.world_size == 1 or not dist.is_initialized():
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return PeerBuffers(0, 1, nbytes, device, "local", [buf])
    group = group if group is not None else tp.device_group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    sizes = _gather(nbytes, group, world_size)
    if len(set(sizes)) != 1:
        raise ValueError(f"ranks asked for different peer buffer sizes: {sizes}")
    if device.type == "cuda":
        pb = _allocate_cuda_ipc(nbytes, rank, world_size, device, group)
    else:
        pb = _allocate_shm(nbytes, rank, world_size, group)
    _handshake(pb, group)
    return pb
