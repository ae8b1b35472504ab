"""The GLM-5 part of a model config (``ModelConfig.arch`` for ``GlmMoeDsaForCausalLM``).

GLM-5 is DeepSeek-V3.2's architecture (:mod:`mtpspec.models.deepseek_v32_config`: MLA + the DSA
lightning indexer) with two differences, read as ``transformers``' ``GlmMoeDsaConfig`` /
``GlmMoeDsaIndexer`` / ``GlmMoeDsaAttention`` define them:

* the indexer's rope is interleaved (pairs ``(2i, 2i + 1)``), like MLA's;
* cross-layer selection sharing: ``indexer_types[i]`` is ``"full"`` (layer ``i`` runs its
  indexer) or ``"shared"`` (no indexer weights; it reuses the selection of the previous full
  layer in the same forward). When ``indexer_types`` is absent it is derived from
  ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``
  (:func:`~mtpspec.models.deepseek_v32_config.indexer_types_from_schedule`).

``index_n_heads`` defaults to 32 (Hugging Face's GLM-5 default). MTP layers always carry their
own indexer. Light: no torch import at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Tuple

from mtpspec.config import ModelConfigError
from mtpspec.models.deepseek_v32_config import DeepseekV32ArchConfig, indexer_types_from_schedule


@dataclass(frozen=True)
class GlmMoeDsaArchConfig(DeepseekV32ArchConfig):
    """:class:`~mtpspec.models.deepseek_v32_config.DeepseekV32ArchConfig` with GLM-5's interleaved
    indexer rope and ``"full"`` / ``"shared"`` indexer types."""

    indexer_rope_interleave: bool = True
    index_n_heads: int = 32

    ARCHITECTURE: ClassVar[str] = "GlmMoeDsaForCausalLM"
    INDEXER_ROPE_INTERLEAVE: ClassVar[bool] = True
    DEFAULT_INDEX_N_HEADS: ClassVar[int] = 32

    @classmethod
    def parse_indexer_types(cls, raw: Dict[str, Any]) -> Tuple[str, ...]:
        """``indexer_types`` as given, else derived as ``transformers`` does (module docstring).

        Raises:
            ModelConfigError: ``indexer_types`` is not a list, or a bad ``index_topk_pattern``.
        """
        given = raw.get("indexer_types")
        if given is not None:
            if not isinstance(given, (list, tuple)):
                raise ModelConfigError(f"config key 'indexer_types' must be a list, got {given!r}")
            return tuple(given)
        n = raw.get("num_hidden_layers")
        n = n if isinstance(n, int) and n > 0 else 0
        return indexer_types_from_schedule(n, raw.get("index_topk_pattern"), raw.get("index_topk_freq"),
                                           raw.get("index_skip_topk_offset"))
