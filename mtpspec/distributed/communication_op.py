"""Tensor-parallel collectives with per-process byte counters.

Every collective adds ``(calls, bytes_sent, bytes_received)`` to a per-process
counter under its op name, computed from shapes on the host (no device sync).
Bytes follow the ring algorithm NCCL uses at these sizes, per rank, for a group
of ``n`` ranks:

==================  =========================  ==================================
op                  payload                    bytes sent (= bytes received)
==================  =========================  ==================================
``all_reduce``      ``S`` bytes per rank       ``2 * (n - 1) * S // n``
``all_gather``      ``s`` bytes per rank       ``(n - 1) * s``
``reduce_scatter``  ``S`` bytes input          ``(n - 1) * S // n``
==================  =========================  ==================================

At ``n == 1`` nothing is communicated and nothing is counted. A caller may file an all-gather
under its own name (``counter=``), so that one path's bytes stand apart: with
``draft_sampling="auto"`` every draft step's Gumbel-max rows (greedy rows' included: one gather
serves the batch) are ``all_gather_draft_sample``, and the recovered tokens' rows at a
verification with sampled drafts ``all_gather_residual_sample`` (:mod:`mtpspec.sample.gumbel`);
greedy drafts' pairs stay under ``all_gather``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist

from mtpspec.distributed.parallel_state import get_tp_group

_STATS: Dict[str, Dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes_sent": 0, "bytes_received": 0})


def _count(op: str, sent: int, received: int) -> None:
    s = _STATS[op]
    s["calls"] += 1
    s["bytes_sent"] += int(sent)
    s["bytes_received"] += int(received)


def comm_stats() -> Dict[str, Dict[str, int]]:
    """A copy of this process's counters: ``{op: {"calls", "bytes_sent", "bytes_received"}}``."""
    return {op: dict(v) for op, v in _STATS.items()}


def reset_comm_stats() -> None:
    """Zero every counter."""
    _STATS.clear()


def total_comm_bytes(stats: Dict[str, Dict[str, int]] | None = None) -> int:
    """Bytes this rank sent, summed over ops (``stats`` defaults to the live counters)."""
    stats = comm_stats() if stats is None else stats
    return sum(v["bytes_sent"] for v in stats.values())


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group. Returns a tensor of ``x``'s shape and dtype.

    At tp 1 returns ``x`` itself. Otherwise reduces a contiguous copy in place and
    returns it (``x`` is left untouched when it was not contiguous).
    """
    g = get_tp_group()
    n = g.world_size
    if n == 1:
        return x
    out = x.contiguous()
    if out is x:
        out = x.clone()
    dist.all_reduce(out, group=g.device_group)
    nbytes = out.numel() * out.element_size()
    _count("all_reduce", 2 * (n - 1) * nbytes // n, 2 * (n - 1) * nbytes // n)
    return out


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1, counter: str = "all_gather",
                                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order.

    Args:
        x: this rank's tensor, the same shape on every rank.
        dim: the dimension to concatenate along (negative counts from the end).
        counter: the op name its bytes are counted under.
        out: optional contiguous result tensor (tp > 1; the result is written into it, no extra
            copy); ignored at tp 1, where ``x`` itself is returned.

    Returns:
        A tensor whose size along ``dim`` is ``tp * x.shape[dim]``; rank r's part
        occupies ``[r * x.shape[dim], (r + 1) * x.shape[dim])``.

    Raises:
        ValueError: a 0-d ``x``, or ``out`` of another shape or dtype than the result, or not contiguous.
    """
    g = get_tp_group()
    n = g.world_size
    if n == 1:
        return x
    if x.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension")
    dim = dim % x.dim()
    x = x.contiguous()
    shape = tuple(x.shape[:dim]) + (n * x.shape[dim],) + tuple(x.shape[dim + 1:])
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"all_gather: out must be a contiguous {list(shape)} {x.dtype} tensor, got "
                         f"{list(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if g.backend == "nccl":
        flat = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(flat, x, group=g.device_group)
        parts = flat.view((n,) + tuple(x.shape))
        if out is None:
            out = parts.movedim(0, dim).reshape(shape)
        else:  # the same one copy reshape makes, into out
            out.view(tuple(x.shape[:dim]) + (n, x.shape[dim]) + tuple(x.shape[dim + 1:])).copy_(parts.movedim(0, dim))
    else:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=g.device_group)
        out = torch.cat(parts, dim=dim) if out is None else torch.cat(parts, dim=dim, out=out)
    nbytes = x.numel() * x.element_size()
    _count(counter, (n - 1) * nbytes, (n - 1) * nbytes)
    return out


def tensor_model_parallel_reduce_scatter(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the TP group and keep this rank's ``1 / tp`` slice along ``dim``.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the TP size.
    """
    g = get_tp_group()
    n = g.world_size
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by tp={n}")
    xm = x.movedim(dim, 0).contiguous()
    chunk = xm.shape[0] // n
    if g.backend == "nccl":
        out = torch.empty((chunk,) + tuple(xm.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, xm, group=g.device_group)
    else:  # gloo has no reduce_scatter: all-reduce, then keep our slice (same result).
        dist.all_reduce(xm, group=g.device_group)
        out = xm[g.rank_in_group * chunk:(g.rank_in_group + 1) * chunk].clone()
    nbytes = x.numel() * x.element_size()
    _count("reduce_scatter", (n - 1) * nbytes // n, (n - 1) * nbytes // n)
    return out.movedim(0, dim).contiguous()


def sp_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the token dimension (dim 0), for sequence parallelism.

    Pads dim 0 with ``(-num_tokens) % tp`` zero rows so it divides evenly, then returns
    rows ``[rank * m, (rank + 1) * m)`` with ``m = ceil(num_tokens / tp)``. No
    communication. ``x``: ``[num_tokens, ...]``; returns ``[m, ...]`` (a view when no
    padding was needed).
    """
    g = get_tp_group()
    n = g.world_size
    if n == 1:
        return x
    num_tokens = x.shape[0]
    pad = (-num_tokens) % n
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))], dim=0)
    m = x.shape[0] // n
    return x[g.rank_in_group * m:(g.rank_in_group + 1) * m]


def sp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Gather :func:`sp_shard` slices back along dim 0: ``[m, ...] -> [tp * m, ...]``.

    The result still holds the padding rows; the caller trims with ``[:num_tokens]``.
    """
    return tensor_model_parallel_all_gather(x, dim=0)
