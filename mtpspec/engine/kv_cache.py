"""KV-cache sizing and allocation for the target's and the MTP layers' attention.

Sizing asks each cache-owning layer for its spec
(:meth:`~mtpspec.attention.backends.abstract.AttentionLayerBase.get_kv_cache_spec`) and sums
``page_size_bytes``; allocation asks each layer's backend for its tensor. Every layer gets the same
number of blocks, so one block table serves them all. Nothing here knows a cache layout.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

from mtpspec.engine.config import CacheConfig
from mtpspec.attention.backends.abstract import AttentionLayerBase
from mtpspec.layers.attention import collect_attention_layers


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

    Raises:
        RuntimeError: no room for a single block.
    """
    if cfg.num_kv_blocks is not None:
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
    return n


def allocate(layers: List[AttentionLayerBase], num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> List[torch.Tensor]:
    """Attach to each layer a zeroed cache of ``num_blocks`` blocks in its backend's layout and
    its spec's dtype (paged GQA: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``);
    returns them in layer order.

    Raises:
        ValueError: a backend's tensor disagrees with the bytes its spec gave the sizing.
    """
    return [layer.allocate_kv_cache(num_blocks, block_size, dtype, device) for layer in layers]


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
