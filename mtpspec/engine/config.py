"""Engine-side configs: scheduler limits, KV-cache sizing, and the :class:`EngineConfig` bundle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from mtpspec.config import KV_CACHE_DTYPES

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
        enable_prefix_caching: automatic prefix caching (vLLM's name; default on): full blocks
            of computed tokens are kept by content hash and shared by later requests with the
            same prefix (:mod:`mtpspec.engine.block_manager`).
        cache_dtype: vLLM's ``--kv-cache-dtype``: ``"auto"`` (the model dtype) or ``"fp8"`` /
            ``"fp8_e4m3"`` (every cache, GQA K/V, MLA latent and indexer keys, stored as
            ``torch.float8_e4m3fn`` with the layers' ``k_scale`` / ``v_scale``, 1.0 by default;
            half the bytes of a 16-bit cache, so twice the blocks in one memory budget;
            :mod:`mtpspec.ops.kv_quant`).
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not float(self.cpu_kv_cache_gib) > 0.0:
            raise ValueError(f"cpu_kv_cache_gib (CLI: --cpu-kv-cache-gib) must be > 0, got {self.cpu_kv_cache_gib!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")


#: ``max_num_batched_tokens`` when none is given and prefills are chunked: vLLM's default
#: (``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS``), raised to one decode step of every
#: sequence (``max_num_seqs * (1 + k)``) and lowered to ``max_model_len`` when that is smaller.
DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_model_len: most tokens (prompt + output) per sequence.
        max_num_batched_tokens: most new tokens fed to the target in one step (decode rows +
            prefill chunk rows). ``None`` picks ``max(min(max_model_len, 2048), max_num_seqs *
            (1 + k))`` with chunked prefill, ``max(max_model_len, max_num_seqs * (1 + k))``
            without. Must hold a decode step of every running sequence (``>= max_num_seqs *
            (1 + k)``) and, without chunked prefill, a whole prompt (``>= max_model_len``).
        num_speculative_tokens: ``k`` (0 = plain decoding).
        enable_chunked_prefill: split prompts into chunks that fill each step's token budget
            after the running decodes (vLLM's name; default on, as in vLLM V1). Off: a prompt is
            prefilled in one step, as before chunking existed.
        long_prefill_token_threshold: most tokens of one prompt per step (vLLM's name; ``0`` = no
            cap beyond the step's budget). Needs ``enable_chunked_prefill``.
        async_scheduling: overlap the host with the device (vLLM's name): the engine applies a
            step's tokens (stops, outputs, streaming) and schedules the next step while the step's
            draft passes still run, waiting for the drafts only when it builds the next step's
            input. With ``k = 0`` (no draft passes to hide behind) the next step is scheduled and
            launched before the last one's tokens are applied, its decodes one position ahead
            (:meth:`~mtpspec.engine.llm_engine.LLMEngine.step`). Same outputs either way (an
            aborted request may miss the token of the step in flight; default on; off: each
            step is waited for whole).

    Raises:
        ValueError: limits that could never schedule a request (the message names the value).
    """

    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: Optional[int] = None
    num_speculative_tokens: int = 0
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        thr = self.long_prefill_token_threshold
        if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0 = no cap), got {thr!r}")
        if thr and not self.enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold={thr} caps prefill chunks, so it needs "
                             "enable_chunked_prefill=True (or leave it 0)")
        decode_rows = self.max_num_seqs * (1 + k)
        if self.enable_chunked_prefill:
            default = max(min(self.max_model_len, DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS), decode_rows)
        else:
            default = max(self.max_model_len, decode_rows)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < decode_rows:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is too small: a step must hold a decode "
                f"of every running sequence, max_num_seqs * (1 + k) = {self.max_num_seqs} * {1 + k} = {decode_rows}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is too small: with chunked prefill off "
                f"(--no-enable-chunked-prefill) a whole prompt is prefilled in one step, so it must be >= "
                f"max_model_len ({self.max_model_len}); enable chunked prefill or raise it")

    @property
    def decode_query_len(self) -> int:
        """Target tokens per running sequence in a decode step: ``1 + k``."""
        return 1 + self.num_speculative_tokens

    def prefill_slots(self, num_tokens: int) -> int:
        """KV slots a prefill of ``num_tokens`` touches (target and MTP caches share the table).

        The target and the MTP first pass write positions ``0 .. n-1``; the ``k - 1`` further
        draft steps write ``n .. n + k - 2``. A chunk ending at ``c <= n`` writes ``.. c + k - 2``
        (its draft steps run too, their drafts are dropped), inside the same bound.
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
        load_format: ``"auto"`` / ``"safetensors"`` (read the checkpoint) or ``"dummy"`` (random
            weights, config.json only: :func:`mtpspec.models.loader.load_models`).
        disable_shared_experts_fusion: keep MoE shared experts as their own MLP (default: fused
            into the routed experts after loading).
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
    load_format: str = "auto"
    disable_shared_experts_fusion: bool = False
