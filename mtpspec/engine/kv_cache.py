"""KV-cache sizing and allocation for the target's and the MTP layers' attention.

Sizing asks each cache-owning layer for its spec
(:meth:`~mtpspec.attention.backends.abstract.AttentionLayerBase.get_kv_cache_spec`) and sums
``page_size_bytes``; allocation asks each layer's backend for its tensor. Every layer gets the same
number of blocks, so one block table serves them all. Nothing here knows a cache layout.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from mtpspec.engine.config import CacheConfig
from mtpspec.attention.backends.abstract import AttentionLayerBase
from mtpspec.layers.attention import collect_attention_layers
from mtpspec.memory import is_out_of_memory


_GIB = 1 << 30


class KVCacheMemoryError(ValueError):
    """The KV cache asked for does not fit in memory (checked before it is allocated, or the
    allocator refused it). A ``ValueError``: a setting to change (``num_kv_blocks``,
    ``gpu_memory_utilization``, ``cpu_kv_cache_gib``), which the commands report as one
    ``error: ...`` line (exit 2), at any tp (a rank's is a
    :class:`~mtpspec.engine.executor.WorkerInputError`)."""


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory an allocation on ``device`` can take now, in bytes (``None``: unknown).

    CUDA: the device's free memory (``torch.cuda.mem_get_info``) plus what torch's caching
    allocator holds unused. CPU: ``MemAvailable`` of ``/proc/meminfo`` (free memory plus what
    the kernel can reclaim; else ``os.sysconf``'s free pages), at most what the process's cgroup
    limit leaves (v2 ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``, the inactive page cache of ``memory.stat`` not counted as used).
    """
    if device.type == "cuda":
        try:
            # what torch's caching allocator holds but does not use is free to this process too
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(torch.cuda.mem_get_info(device)[0]) + max(0, int(cached))
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    avail: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge v1 value: no limit
            # the usage counts the page cache (the checkpoint just read, say), which the kernel
            # reclaims on demand: its inactive part is headroom, as docker / the kubelet count it
            stat = os.path.join(os.path.dirname(usage_file), "memory.stat")
            try:
                with open(stat) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key in ("inactive_file", "total_inactive_file"):
                            usage -= int(value)
                            break
            except (OSError, ValueError):
                pass
            avail = min(avail, max(0, int(limit) - max(0, usage)))
        break
    return avail


def _ranks_sharing_memory(device: torch.device) -> int:
    """How many ranks allocate their caches from the memory ``device``'s allocation comes from:
    on CPU, the TP ranks on this host (``LOCAL_WORLD_SIZE`` under ``torchrun``, else the TP
    group: self-launched ranks share one host); on a GPU, 1 (a GPU per rank)."""
    if device.type != "cpu":
        return 1
    from mtpspec.distributed import get_tensor_model_parallel_world_size
    world = get_tensor_model_parallel_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, min(world, int(local))) if local.isdigit() else world


def _fix_hint(cfg: CacheConfig, device: torch.device) -> str:
    """What to change when the cache does not fit: the setting that sized it (the Python API's
    name and the CLI's flag)."""
    if cfg.num_kv_blocks is not None:
        unset = ("so that gpu_memory_utilization (CLI: --gpu-memory-utilization) sizes it" if device.type == "cuda"
                 else "so that cpu_kv_cache_gib (CLI: --cpu-kv-cache-gib; default 1 GiB) sizes it")
        return f"lower num_kv_blocks (CLI: --num-kv-blocks), or leave it unset {unset}"
    if device.type == "cuda":
        return "lower gpu_memory_utilization (CLI: --gpu-memory-utilization) or set num_kv_blocks (CLI: --num-kv-blocks)"
    return ("lower cpu_kv_cache_gib (CLI: --cpu-kv-cache-gib) or set a smaller num_kv_blocks "
            "(CLI: --num-kv-blocks)")


def check_kv_cache_fits(layers: List[AttentionLayerBase], num_blocks: int, cfg: CacheConfig, dtype: torch.dtype,
                        device: torch.device) -> None:
    """Raise :class:`KVCacheMemoryError` when ``num_blocks`` blocks of every layer's cache need more
    memory than :func:`available_memory_bytes` reports (on CPU: times the ranks of this host,
    :func:`_ranks_sharing_memory`, each allocating its own cache from the same memory). Nothing
    is checked where the available memory is unknown.

    Raises:
        KVCacheMemoryError: the message gives the GiB needed and available and the setting to
            change (:func:`_fix_hint`).
    """
    per_block = bytes_per_block(layers, cfg.block_size, dtype)
    need = num_blocks * per_block
    avail = available_memory_bytes(device)
    ranks = _ranks_sharing_memory(device)
    if avail is None or need * ranks <= avail:
        return
    where = "free on " + str(device) if device.type == "cuda" else "available on this host"
    each = f" x {ranks} ranks on this host = {need * ranks / _GIB:.2f} GiB" if ranks > 1 else ""
    raise KVCacheMemoryError(
        f"the KV cache does not fit in memory: {num_blocks} blocks of {cfg.block_size} tokens ({per_block} bytes "
        f"each, all layers) need {need / _GIB:.2f} GiB{each}, but only {avail / _GIB:.2f} GiB is {where}; "
        f"{_fix_hint(cfg, device)}")


def bytes_per_block(layers: List[AttentionLayerBase], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of ``block_size`` tokens takes summed over ``layers``, each layer's
    ``get_kv_cache_spec(block_size, dtype).page_size_bytes`` (paged GQA:
    ``2 * block_size * num_kv_heads * head_dim * itemsize``). ``dtype``: the engine's cache dtype."""
    return sum(layer.get_kv_cache_spec(block_size, dtype).page_size_bytes for layer in layers)


def attention_layers(*models: nn.Module) -> List[AttentionLayerBase]:
    """Every attention layer of the given models (``None`` skipped), in forward order, no repeats."""
    seen, out = set(), []
    for m in models:
        if m is None:
            continue
        for layer in collect_attention_layers(m):
            if id(layer) not in seen:
                seen.add(id(layer))
                out.append(layer)
    return out


def available_kv_blocks(layers: List[AttentionLayerBase], cfg: CacheConfig, dtype: torch.dtype, device: torch.device,
                        max_useful_blocks: int) -> int:
    """Blocks this rank can hold (before the min over ranks).

    ``cfg.num_kv_blocks`` when set. On CUDA: ``gpu_memory_utilization * total`` minus the memory
    in use now (weights, context, other processes) minus the activation peak of the profiling
    forward the caller ran, over :func:`bytes_per_block`. On CPU: ``cpu_kv_cache_gib`` over :func:`bytes_per_block`, capped at
    ``max_useful_blocks`` (every sequence at full length).

    An explicit count and the CPU budget are checked against the memory available now
    (:func:`check_kv_cache_fits`; the CUDA budget is sized from it). Every rank checks before the
    caller's minimum over ranks, so no rank has allocated its cache yet.

    Raises:
        RuntimeError: no room for a single block.
        KVCacheMemoryError: (a ``ValueError``) the explicit count or the CPU budget needs more
            memory than is available.
    """
    if cfg.num_kv_blocks is not None:
        check_kv_cache_fits(layers, cfg.num_kv_blocks, cfg, dtype, device)
        return cfg.num_kv_blocks
    per_block = bytes_per_block(layers, cfg.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # in use now (weights, CUDA context, other processes) + the profiled activation peak
        activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        budget = cfg.gpu_memory_utilization * total - (total - free) - activation_peak
        n = int(budget // per_block)
        gib = 1 << 30
        where = (f": gpu_memory_utilization {cfg.gpu_memory_utilization} x {total / gib:.1f} GiB = "
                 f"{cfg.gpu_memory_utilization * total / gib:.2f} GiB, of which {(total - free) / gib:.2f} GiB is in "
                 f"use on the device (this process's weights and context AND every other process's memory) and "
                 f"{activation_peak / gib:.2f} GiB is the profiled activation peak")
    else:
        n = min(int(cfg.cpu_kv_cache_gib * (1 << 30) // per_block), max_useful_blocks)
        where = f": cpu_kv_cache_gib {cfg.cpu_kv_cache_gib}"
    if n < 1:
        raise RuntimeError(f"no memory left for the KV cache ({per_block} bytes per block){where}; lower "
                           "max_num_seqs / max_num_batched_tokens, raise gpu_memory_utilization, or set num_kv_blocks")
    if device.type != "cuda":
        check_kv_cache_fits(layers, n, cfg, dtype, device)
    return n


def allocate(layers: List[AttentionLayerBase], num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> List[torch.Tensor]:
    """Attach to each layer a zeroed cache of ``num_blocks`` blocks in its backend's layout and
    its spec's dtype (paged GQA: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``);
    returns them in layer order.

    An allocator failure leaves no layer with a cache (those allocated are released) and is
    raised as :class:`KVCacheMemoryError`.

    Raises:
        ValueError: a backend's tensor disagrees with the bytes its spec gave the sizing.
        KVCacheMemoryError: (a ``ValueError``) the allocator refused a layer's cache.
    """
    caches: List[torch.Tensor] = []
    try:
        for layer in layers:
            caches.append(layer.allocate_kv_cache(num_blocks, block_size, dtype, device))
    except BaseException as exc:
        for layer in layers:
            layer.kv_cache = None
        caches.clear()
        if not is_out_of_memory(exc):
            raise
        need = num_blocks * bytes_per_block(layers, block_size, dtype)
        avail = available_memory_bytes(device)
        have = f" ({avail / _GIB:.2f} GiB {'free on ' + str(device) if device.type == 'cuda' else 'available'} now)" \
            if avail is not None else ""
        flags = ("lower num_kv_blocks (CLI: --num-kv-blocks) or gpu_memory_utilization (CLI: --gpu-memory-utilization)"
                 if device.type == "cuda" else
                 "lower num_kv_blocks (CLI: --num-kv-blocks) or cpu_kv_cache_gib (CLI: --cpu-kv-cache-gib)")
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise KVCacheMemoryError(f"out of memory allocating the KV cache: {num_blocks} blocks of {block_size} tokens "
                                 f"need {need / _GIB:.2f} GiB on {device}{have}; {flags} ({first})") from None
    return caches


def copy_blocks(layers: List[AttentionLayerBase], copies: Sequence[Tuple[int, int]], device: torch.device) -> None:
    """Copy block ``src`` into block ``dst`` for every ``(src, dst)`` in every layer's cache
    (through its backend's :meth:`~mtpspec.attention.backends.abstract.AttentionBackend.copy_blocks`;
    all sources are read before any destination is written). No host sync.

    Raises:
        ValueError: a layer without a cache, or a block id outside the cache.
    """
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64).to(device, non_blocking=True)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64).to(device, non_blocking=True)
    for layer in layers:
        if layer.kv_cache is None:
            raise ValueError(f"{type(layer).__name__} has no KV cache to copy blocks in")
        layer.get_attn_backend().copy_blocks(layer.kv_cache, src, dst)
