"""KV-cache sizing: bytes per block, the CPU budget, the explicit override, the min over ranks;
sizing and allocation ask each layer's attention backend (a fake latent / indexer-key backend and
an fp8 cache dtype change the counts by hand-computed amounts, with no change to the sizing)."""

from typing import Tuple, Type

import pytest
import torch
from torch import nn

from mtpspec.attention import AttentionBackend, AttentionLayerBase, AttentionSpec, FullAttentionSpec, PagedGQABackend
from mtpspec.distributed import get_tensor_model_parallel_rank, launch
from mtpspec.engine.config import CacheConfig
from mtpspec.engine.kv_cache import allocate, attention_layers, available_kv_blocks, bytes_per_block
from mtpspec.engine.worker import init_cache_min_over_ranks
from mtpspec.layers.attention import Attention, collect_attention_layers


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


def test_cuda_budget_counts_other_processes_and_says_so(monkeypatch):
    """On CUDA the budget is ``gpu_memory_utilization x total`` minus ALL memory in use (vLLM's
    rule, other processes included) minus the activation peak; when nothing is left, the error
    gives those figures (two engines sharing one GPU at 0.18 each failed with no hint why)."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)
    layers, dev = _layers(), torch.device("cuda")
    # 0.95 x 100 - 90 in use - 2 activation peak = 3 GiB
    n = available_kv_blocks(layers, CacheConfig(block_size=16, gpu_memory_utilization=0.95), torch.bfloat16, dev, 1)
    assert n == 3 * gib // 16384
    with pytest.raises(RuntimeError, match=r"0.5 x 100.0 GiB = 50.00 GiB, of which 90.00 GiB is in use .*every other "
                                           r"process.* 2.00 GiB is the profiled activation peak"):
        available_kv_blocks(layers, CacheConfig(block_size=16, gpu_memory_utilization=0.5), torch.bfloat16, dev, 1)


class _LatentBackend(AttentionBackend):
    """A second layout: one entry of ``head_size`` values per token shared by all heads (the shape
    of an MLA latent or of indexer keys), ``[num_blocks, block_size, head_size]``."""

    @staticmethod
    def get_name() -> str:
        return "FAKE_LATENT"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("sizing tests only")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        assert num_kv_heads == 1
        return (num_blocks, block_size, head_size)


class _BadBackend(_LatentBackend):
    """Lays out one value more per token than its spec says."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> Tuple[int, ...]:
        return (num_blocks, block_size, head_size + 1)


class _LatentCache(nn.Module, AttentionLayerBase):
    """A cache-owning layer of the fake backend; ``dtype`` fixes its stored dtype (as an indexer
    cache may), else it follows the engine's cache dtype."""

    def __init__(self, head_size: int, dtype=None, backend: Type[AttentionBackend] = _LatentBackend):
        super().__init__()
        self.head_size, self.dtype, self.backend, self.kv_cache = head_size, dtype, backend, None

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return self.backend

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(block_size=block_size, num_kv_heads=1, head_size=self.head_size, dtype=self.dtype or dtype)


def test_sizing_asks_each_layers_backend():
    gqa = Attention(8, 64, 0.125, 2)
    assert gqa.get_attn_backend() is PagedGQABackend
    assert gqa.get_kv_cache_spec(16, torch.bfloat16) == FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                                          dtype=torch.bfloat16)
    latent = _LatentCache(40)  # e.g. kv_lora_rank 32 + rope 8: one entry per token for all heads
    index_keys = _LatentCache(16, dtype=torch.float32)  # fixed fp32 whatever the engine's dtype
    # by hand, block_size 16, bf16: GQA 2*16*2*64*2 = 8192; latent 16*40*2 = 1280; index keys 16*16*4 = 1024
    assert bytes_per_block([latent], 16, torch.bfloat16) == 1280
    assert bytes_per_block([index_keys], 16, torch.bfloat16) == 1024
    mixed = [gqa, latent, index_keys]
    assert bytes_per_block(mixed, 16, torch.bfloat16) == 8192 + 1280 + 1024
    assert bytes_per_block(mixed, 16, torch.float32) == 2 * 8192 + 2 * 1280 + 1024
    cfg = CacheConfig(block_size=16, cpu_kv_cache_gib=0.001)
    budget = int(0.001 * (1 << 30))
    cpu = torch.device("cpu")
    assert available_kv_blocks([gqa], cfg, torch.bfloat16, cpu, 10**9) == budget // 8192 == 131
    assert available_kv_blocks(mixed, cfg, torch.bfloat16, cpu, 10**9) == budget // 10496 == 102
    # an fp8 cache dtype: half the bytes of bf16 per GQA block, so twice the blocks in one budget
    assert bytes_per_block([gqa], 16, torch.float8_e4m3fn) == 4096
    assert available_kv_blocks([gqa], cfg, torch.float8_e4m3fn, cpu, 10**9) == budget // 4096 == 262
    # the layers a model owns, mixed kinds, in forward order, no repeats
    model = nn.ModuleList([gqa, nn.Sequential(latent, index_keys)])
    assert collect_attention_layers(model) == mixed and attention_layers(model, None, model) == mixed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_allocate_gives_each_layer_its_backends_layout_and_dtype(dtype):
    gqa, latent, index_keys = Attention(8, 64, 0.125, 2), _LatentCache(40), _LatentCache(16, dtype=torch.float32)
    caches = allocate([gqa, latent, index_keys], 5, 16, dtype, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, 16, 2, 64), (5, 16, 40), (5, 16, 16)]
    assert [c.dtype for c in caches] == [dtype, dtype, torch.float32]
    assert caches[0] is gqa.kv_cache and caches[1] is latent.kv_cache and caches[2] is index_keys.kv_cache
    assert all(not c.float().any() for c in caches)
    total = sum(c.numel() * c.element_size() for c in caches)
    assert total == 5 * bytes_per_block([gqa, latent, index_keys], 16, dtype)
    bad = _LatentCache(40, backend=_BadBackend)
    with pytest.raises(ValueError, match="FAKE_LATENT: cache .* its spec says 5 x 1280"):
        allocate([bad], 5, 16, torch.bfloat16, torch.device("cpu"))
    assert bad.kv_cache is None


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
