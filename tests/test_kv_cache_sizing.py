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


# ------------------------------------------------------------------ a cache too large for memory
def test_an_explicit_count_larger_than_memory_is_a_clear_value_error(monkeypatch):
    """Found by a new-user pass: ``--num-kv-blocks 100000000`` ended in the CPU allocator's raw
    ``RuntimeError: ... can't allocate memory: you tried to allocate 1843200000000 bytes``. Now the
    count is checked against the memory available before anything is allocated: a ValueError
    (the commands' ``error: ...``, exit 2) giving GiB needed and available and the flag to lower."""
    from mtpspec.engine import kv_cache
    gib = 1 << 30
    layers, cpu = _layers(), torch.device("cpu")
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 3 * gib)
    n = 2 * gib // 16384  # 2 GiB of 16384-byte blocks: fits in 3 GiB
    assert available_kv_blocks(layers, CacheConfig(block_size=16, num_kv_blocks=n), torch.bfloat16, cpu, 7) == n
    with pytest.raises(kv_cache.KVCacheMemoryError) as info:
        available_kv_blocks(layers, CacheConfig(block_size=16, num_kv_blocks=4 * n), torch.bfloat16, cpu, 7)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "need 8.00 GiB, but only 3.00 GiB is available on this host" in msg, msg
    assert "num_kv_blocks (CLI: --num-kv-blocks)" in msg and "\n" not in msg, msg
    # two CPU ranks of this host each allocate their own cache from the same memory
    monkeypatch.setattr(kv_cache, "_ranks_sharing_memory", lambda device: 2)
    with pytest.raises(kv_cache.KVCacheMemoryError, match=r"need 2.00 GiB x 2 ranks on this host = 4.00 GiB"):
        available_kv_blocks(layers, CacheConfig(block_size=16, num_kv_blocks=n), torch.bfloat16, cpu, 7)
    # the CPU budget (cpu_kv_cache_gib) is checked too, naming its own setting
    with pytest.raises(kv_cache.KVCacheMemoryError, match=r"lower cpu_kv_cache_gib .*--num-kv-blocks"):
        available_kv_blocks(layers, CacheConfig(block_size=16, cpu_kv_cache_gib=2.0), torch.bfloat16, cpu, 10**9)
    # unknown available memory: nothing to check against
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: None)
    assert available_kv_blocks(layers, CacheConfig(block_size=16, num_kv_blocks=10**8), torch.bfloat16, cpu, 7) \
        == 10**8


def test_an_explicit_count_larger_than_the_gpus_free_memory_names_gpu_memory_utilization(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 80 * gib))
    with pytest.raises(ValueError, match=r"need 2.00 GiB, but only 1.00 GiB is free on cuda.*--num-kv-blocks.*"
                                         r"leave it unset so that gpu_memory_utilization \(CLI: "
                                         r"--gpu-memory-utilization\) sizes it"):
        available_kv_blocks(_layers(), CacheConfig(block_size=16, num_kv_blocks=2 * gib // 16384), torch.bfloat16,
                            torch.device("cuda"), 1)


def test_available_memory_reads_proc_meminfo():
    from mtpspec.engine.kv_cache import available_memory_bytes
    n = available_memory_bytes(torch.device("cpu"))
    assert n is not None and 0 < n < 1 << 50


def test_an_allocator_failure_is_a_clear_error_and_leaves_no_cache(monkeypatch):
    """Where the check could not see it coming (e.g. memory taken meanwhile), the allocator's own
    refusal becomes the same kind of one-line ValueError, and the layers allocated before the
    failing one give their caches back (nothing half-allocated)."""
    from mtpspec.engine import kv_cache
    layers = _layers()
    real = PagedGQABackend.allocate_kv_cache.__func__
    calls = []

    def refuse_second(cls, spec, num_blocks, device):
        calls.append(spec)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 1843200000000 bytes. Error code 12")
        return real(cls, spec, num_blocks, device)

    monkeypatch.setattr(PagedGQABackend, "allocate_kv_cache", classmethod(refuse_second))
    with pytest.raises(kv_cache.KVCacheMemoryError) as info:
        allocate(layers, 5, 16, torch.bfloat16, torch.device("cpu"))
    msg = str(info.value)
    assert msg.startswith("out of memory allocating the KV cache: 5 blocks of 16 tokens") and "--num-kv-blocks" in msg
    assert info.value.__cause__ is None and len(calls) == 2
    assert all(layer.kv_cache is None for layer in layers)
    # any other failure passes through unchanged (and still leaves no cache)
    calls.clear()
    monkeypatch.setattr(PagedGQABackend, "allocate_kv_cache",
                        classmethod(lambda cls, spec, n, device: calls.append(spec) or 1 / 0))
    with pytest.raises(ZeroDivisionError):
        allocate(layers, 5, 16, torch.bfloat16, torch.device("cpu"))


def test_cgroup_headroom_counts_the_inactive_page_cache_as_free(monkeypatch) -> None:
    """Review: a container's cgroup usage counts the page cache (the checkpoint just read), which the
    kernel reclaims on demand; ``available_memory_bytes`` counts its inactive part as headroom, as
    docker and the kubelet do, so the default CPU budget is not refused after a load."""
    import io

    import torch

    import mtpspec.engine.kv_cache as kc
    gib = 1 << 30
    files = {"/proc/meminfo": "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n",  # 32 GiB on the host
             "/sys/fs/cgroup/memory.max": f"{8 * gib}\n", "/sys/fs/cgroup/memory.current": f"{7 * gib}\n",
             "/sys/fs/cgroup/memory.stat": f"anon {2 * gib}\nfile {5 * gib}\ninactive_file {4 * gib}\n"}

    def fake_open(path, *a, **kw):
        if path not in files:
            raise OSError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(kc, "open", fake_open, raising=False)
    assert kc.available_memory_bytes(torch.device("cpu")) == 5 * gib  # 8 - (7 - 4 inactive)
    del files["/sys/fs/cgroup/memory.stat"]
    assert kc.available_memory_bytes(torch.device("cpu")) == 1 * gib  # no stat: the usage as it is
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert kc.available_memory_bytes(torch.device("cpu")) == 32 * gib  # no limit: the host's MemAvailable


def test_the_cpu_cache_holds_max_num_seqs_full_sequences_beside_the_watermark():
    """The CPU cache is capped at every sequence at full length; the block manager keeps 1% of the
    blocks from new sequences, so the cap must add that share: at ``max_num_seqs=1`` and 4,096 tokens
    (257 blocks of 16) the engine refused to start ('259 blocks needed')."""
    from mtpspec import LLM, SamplingParams, demo_model_path
    from mtpspec.engine.block_manager import blocks_with_watermark
    for useful in (1, 99, 100, 257, 12345):
        n = blocks_with_watermark(useful)
        assert n - int(0.01 * n) >= useful > (n - 1) - int(0.01 * (n - 1))
    with pytest.raises(ValueError, match=r"watermark must be in \[0, 1\)"):
        blocks_with_watermark(10, 1.0)
    llm = LLM(demo_model_path("glm4_moe"), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=4096)
    try:
        bm, sc = llm.llm_engine.scheduler.block_manager, llm.llm_engine.scheduler_config
        assert bm.num_blocks - bm.watermark_blocks == bm.blocks_for(sc.decode_slots(4096)) >= 256
        out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
