"""Engine-side configs: scheduler limits, KV-cache sizing, and the :class:`EngineConfig` bundle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from mtpspec.config import ModelConfig, ParallelConfig, SpeculativeConfig


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block (>= 1).
        num_kv_blocks: explicit number of blocks per layer, or ``None`` to size the cache from
            free device memory (GPU: ``gpu_memory_utilization`` of total memory minus what the
            weights and a profiling forward used, minimum over ranks; CPU: ``cpu_kv_cache_gib``).
        gpu_memory_utilization: fraction of the GPU's memory the engine may use, in (0, 1].
        cpu_kv_cache_gib: KV-cache budget on CPU, in GiB (> 0).
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not float(self.cpu_kv_cache_gib) > 0.0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib!r}")


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_model_len: most tokens (prompt + output) per sequence.
        max_num_batched_tokens: most new tokens fed to the target in one step; ``None`` picks
            ``max(max_model_len, max_num_seqs * (1 + k))``. Must hold a whole prompt (prefills
            are not chunked) and a decode step of every running sequence.
        num_speculative_tokens: ``k`` (0 = plain decoding).

    Raises:
        ValueError: limits that could never schedule a request.
    """

    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: Optional[int] = None
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        need = max(self.max_model_len, self.max_num_seqs * (1 + k))
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = need
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < need:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is too small: prefills are not "
                f"chunked, so it must be >= max_model_len ({self.max_model_len}) and >= max_num_seqs * "
                f"(1 + k) ({self.max_num_seqs * (1 + k)})")

    @property
    def decode_query_len(self) -> int:
        """Target tokens per running sequence in a decode step: ``1 + k``."""
        return 1 + self.num_speculative_tokens

    def prefill_slots(self, num_tokens: int) -> int:
        """KV slots a prefill of ``num_tokens`` touches (target and MTP caches share the table).

        The target and the MTP first pass write positions ``0 .. n-1``; the ``k - 1`` further
        draft steps write ``n .. n + k - 2``.
        """
        return num_tokens + max(self.num_speculative_tokens - 1, 0)

    def decode_slots(self, num_tokens: int) -> int:
        """KV slots a decode step of a sequence holding ``num_tokens`` tokens touches.

        Verification writes positions ``n-1 .. n-1+k`` (target and MTP first pass); after
        ``a`` accepted drafts the draft steps write ``n+a+1 .. n+a+k-1 <= n+2k-1``.
        """
        return num_tokens + 2 * self.num_speculative_tokens


@dataclass
class EngineConfig:
    """The one engine config every rank receives (vLLM's ``VllmConfig``); picklable.

    Built by :meth:`mtpspec.engine.arg_utils.EngineArgs.create_engine_config` (which ``LLM``
    uses too).

    Attributes:
        model: checkpoint folder.
        dtype: parameter dtype name or ``None`` (the checkpoint's).
        device: ``"cpu"``, ``"cuda"`` (each rank takes ``cuda:local_rank``), ``"cuda:N"`` or
            ``None`` (CUDA when present).
        model_config: the checkpoint's :class:`~mtpspec.config.ModelConfig`.
        parallel_config: :class:`~mtpspec.config.ParallelConfig` (tp, sequence parallel, fused
            tail, all-reduce backend).
        speculative_config: :class:`~mtpspec.config.SpeculativeConfig` or ``None`` (plain decoding).
        cache_config, scheduler_config: KV cache and batching limits.
        graph_mode: CUDA-graph mode of the runner (``"auto"``, ``"off"``, ``"cuda"``, ``"static"``;
            :class:`~mtpspec.engine.model_runner.ModelRunner`).
        seed: engine seed (seeds the seeds of requests that give none); ``None``: random.
    """

    model: str
    dtype: Optional[str]
    device: Optional[str]
    model_config: "ModelConfig"
    parallel_config: "ParallelConfig"
    speculative_config: Optional["SpeculativeConfig"]
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    graph_mode: str = "auto"
    seed: Optional[int] = None
