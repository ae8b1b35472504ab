"""Configs: parallel, speculative (model config: ``ModelConfig`` below, from ``config.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union


@dataclass
class ParallelConfig:
    """Tensor parallelism.

    Attributes:
        tensor_parallel_size: number of TP ranks (>= 1).
        sequence_parallel: shard the MTP layer's tokens across ranks (``sp_shard`` /
            ``sp_all_gather``) instead of all-reducing its output; only at tp > 1.
    """

    tensor_parallel_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")


MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """MTP speculative decoding (vLLM's ``speculative_config`` dict maps onto this).

    Attributes:
        method: only ``"mtp"``.
        num_speculative_tokens: k, draft tokens proposed per target step, 1..16.
        use_local_argmax_reduction: greedy drafts via the model's ``get_top_tokens``
            (vocab-parallel local argmax: gathers ``[num_tokens, 2]`` pairs per rank instead of
            ``[num_tokens, vocab]`` logits). The model must implement ``SupportsLocalArgmax``.

    Raises:
        ValueError: unknown method or k out of range.
    """

    method: str = "mtp"
    num_speculative_tokens: int = 1
    use_local_argmax_reduction: bool = False

    def __post_init__(self) -> None:
        if self.method != "mtp":
            raise ValueError(f"speculative method must be 'mtp', got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}")

    @classmethod
    def from_any(cls, cfg: Union[None, Dict[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """``None`` -> ``None`` (plain decoding); a dict -> a config (unknown keys raise)."""
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise TypeError(f"speculative_config must be a dict, SpeculativeConfig or None, got {type(cfg).__name__}")
        unknown = set(cfg) - {"method", "num_speculative_tokens", "use_local_argmax_reduction"}
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**cfg)
