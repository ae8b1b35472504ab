"""KV-cache sizing: bytes per block, the CPU budget, the explicit override, the min over ranks."""

import pytest
import torch

from mtpspec.distributed import get_tensor_model_parallel_rank, launch
from mtpspec.engine.config import CacheConfig
from mtpspec.engine.kv_cache import available_kv_blocks, bytes_per_block
from mtpspec.engine.worker import init_cache_min_over_ranks
from mtpspec.layers.attention import Attention


def _layers():
    return [Attention(8, 64, 0.125, 2), Attention(4, 32, 0.2, 4)]


def test_bytes_per_block_and_cpu_budget():
    layers = _layers()
    # K and V, 16 tokens, kv heads x head_dim, 2 bytes: 2*16*2*64*2 + 2*16*4*32*2
    assert bytes_per_block(layers, 16, torch.bfloat16) == 8192 + 8192
    assert bytes_per_block(layers, 16, torch.float32) == 2 * (8192 + 8192)
    cfg = CacheConfig(block_size=16, cpu_kv_cache_gib=0.001)
    n = available_kv_blocks(layers, cfg, torch.bfloat16, torch.device("cpu"), max_useful_blocks=10**9)
    assert n == int(0.001 * (1 << 30)) // 16384
    # capped at what every sequence at full length could use
    assert available_kv_blocks(layers, cfg, torch.bfloat16, torch.device("cpu"), max_useful_blocks=7) == 7
    # an explicit count wins
    assert available_kv_blocks(layers, CacheConfig(block_size=16, num_kv_blocks=123), torch.bfloat16,
                               torch.device("cpu"), 7) == 123
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        available_kv_blocks(layers, CacheConfig(block_size=16, cpu_kv_cache_gib=1e-9), torch.bfloat16,
                            torch.device("cpu"), 10**9)


class _FakeRunner:
    """What init_cache_min_over_ranks needs: a per-rank profiled count and the allocation call."""

    def __init__(self, blocks: int):
        self.blocks, self.allocated, self.device = blocks, None, torch.device("cpu")

    def profile_and_count_blocks(self) -> int:
        return self.blocks

    def init_kv_cache(self, n: int) -> None:
        self.allocated = n


def _rank(per_rank):
    runner = _FakeRunner(per_rank[get_tensor_model_parallel_rank()])
    return init_cache_min_over_ranks(runner), runner.allocated


def test_every_rank_allocates_the_minimum_over_ranks():
    per_rank = [900, 350, 1200]
    assert launch(_rank, 3, per_rank) == [(350, 350)] * 3
