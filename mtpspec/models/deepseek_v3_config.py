"""The DeepSeek-V3 part of a model config (``ModelConfig.arch`` for ``DeepseekV3ForCausalLM``).

Multi-head latent attention (MLA; DeepSeek-V3 technical report, arXiv:2412.19437, sec. 2.1.1):
the fields Hugging Face's ``DeepseekV3Config`` has beyond the ones every architecture shares
(:class:`mtpspec.config.ModelConfig`, which also parses the DeepSeek MoE router fields). Light:
no torch import, so reading a config imports no model code.

Rope: ``"default"`` or ``"yarn"`` (``rope_parameters``, Hugging Face >= 5, or the older
``rope_scaling``). YaRN is read exactly as ``transformers.modeling_rope_utils._compute_yarn_parameters``
and ``modeling_deepseek_v3.yarn_apply_mscale`` use it: :meth:`DeepseekV3ArchConfig.rope_inv_freq`
(the interpolated frequencies of the ``qk_rope_head_dim`` channels), ``rope_attention_factor``
(the factor on cos / sin) and ``softmax_scale`` (``qk_head_dim ** -0.5``, times
``yarn_get_mscale(factor, mscale_all_dim) ** 2`` when ``mscale_all_dim`` is set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional

from mtpspec.config import ArchConfig, ModelConfig, ModelConfigError, require_int, rope_parameters

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor (``transformers``' ``yarn_get_mscale``): 1 for
    ``scale <= 1``, else ``0.1 * mscale * ln(scale) + 1``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekV3ArchConfig(ArchConfig):
    """DeepSeek-V3 attention (MLA) and rope fields.

    Attributes:
        q_lora_rank: rank of the query compression (``q_a_proj`` -> ``q_a_layernorm`` ->
            ``q_b_proj``), or None: one ``q_proj``.
        kv_lora_rank: the latent size (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``; cached).
        qk_rope_head_dim: rotary channels per head (the shared rope key; cached).
        qk_nope_head_dim: non-rotary query / key channels per head.
        v_head_dim: value channels per head.
        rope_interleave: rotary pairs are channels ``(2i, 2i + 1)`` (True, Hugging Face's
            default) or ``(i, i + rope / 2)`` (False).
        rope_type: ``"default"`` or ``"yarn"``.
        rope_scaling: the YaRN keys (``factor``, ``original_max_position_embeddings``,
            ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``,
            ``truncate``) as given; empty for default rope.
        max_position_embeddings: copied from the common part when parsed (YaRN's defaults for
            ``original_max_position_embeddings`` and ``factor`` read it).
        qk_head_dim (property): ``qk_nope_head_dim + qk_rope_head_dim``.
        kv_cache_head_size (property): ``kv_lora_rank + qk_rope_head_dim`` values per token.
    """

    #: 64-token cache blocks: the MLA kernel's bulk-copy key tiles (64 keys) must lie in one block
    #: (:func:`mtpspec.ops.mla_attention.tma_eligible`; FlashMLA's page size is 64 too).
    default_block_size: ClassVar[int] = 64

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    rope_type: str = "default"
    rope_scaling: Any = None  # a dict (frozen dataclass: not hashed)
    max_position_embeddings: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "DeepseekV3ArchConfig":
        """Read the fields (see the class docstring) from a parsed ``config.json``.

        Raises:
            ModelConfigError: a rope type other than ``"default"`` / ``"yarn"``, YaRN without a
                numeric ``factor``, or ``attention_bias`` set (DeepSeek-V3 checkpoints have no
                attention biases).
        """
        params = dict(rope_parameters(raw))
        legacy = raw.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise ModelConfigError(f"config key 'rope_scaling' must be an object, got {legacy!r}")
        merged = {**legacy, **params}
        rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rtype not in ("default", "yarn"):
            raise ModelConfigError(f"unsupported rope_type {rtype!r} for DeepseekV3ForCausalLM; "
                                   "supported: 'default', 'yarn'")
        if raw.get("attention_bias"):
            raise ModelConfigError("attention_bias=True is not supported for DeepseekV3ForCausalLM")
        scaling = {k: merged[k] for k in _YARN_KEYS if merged.get(k) is not None} if rtype == "yarn" else {}
        if rtype == "yarn" and not isinstance(scaling.get("factor"), (int, float)):  # transformers requires it too
            raise ModelConfigError(f"rope_type 'yarn' needs a numeric 'factor' in rope_parameters / rope_scaling, got "
                                   f"{merged.get('factor')!r}")
        return cls(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw.get("kv_lora_rank", 512),
                   qk_rope_head_dim=raw.get("qk_rope_head_dim", 64), qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
                   v_head_dim=raw.get("v_head_dim", 128) or 128,
                   rope_interleave=bool(raw.get("rope_interleave", True)), rope_type=rtype, rope_scaling=scaling,
                   max_position_embeddings=raw.get("max_position_embeddings", 0))

    # ---------------------------------------------------------------- rope
    def _yarn(self) -> Dict[str, Any]:
        s = dict(self.rope_scaling or {})
        omax = s.get("original_max_position_embeddings") or self.max_position_embeddings
        return dict(s, factor=float(s["factor"]), original_max_position_embeddings=omax)

    @property
    def rope_attention_factor(self) -> float:
        """The factor on cos and sin (``transformers``' ``attention_factor``): 1 for default rope;
        YaRN: ``attention_factor`` if given, else ``mscale(factor, mscale) / mscale(factor,
        mscale_all_dim)`` when both are set, else ``mscale(factor)``."""
        if self.rope_type != "yarn":
            return 1.0
        s = self._yarn()
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        if s.get("mscale") and s.get("mscale_all_dim"):
            return float(yarn_get_mscale(s["factor"], s["mscale"]) / yarn_get_mscale(s["factor"], s["mscale_all_dim"]))
        return float(yarn_get_mscale(s["factor"]))

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` for YaRN
        with ``mscale_all_dim`` set (``transformers``' ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_type == "yarn":
            s = self._yarn()
            if s.get("mscale_all_dim"):
                m = yarn_get_mscale(s["factor"], s["mscale_all_dim"])
                scale = scale * m * m
        return scale

    def rope_inv_freq(self, theta: float) -> List[float]:
        """Inverse frequencies (``qk_rope_head_dim / 2`` of them) as a list of floats computed
        by torch in fp32 exactly as ``transformers`` does (default or YaRN); imports torch."""
        import torch
        dim = self.qk_rope_head_dim
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.rope_type != "yarn":
            return (1.0 / pos_freqs).tolist()
        s = self._yarn()
        factor, omax = s["factor"], s["original_max_position_embeddings"]
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv.tolist()

    # ---------------------------------------------------------------- checks
    def validate(self, config: ModelConfig) -> None:
        """Positive ranks and head dims, an even rope dim, sane YaRN values.

        Raises:
            ModelConfigError: naming the value.
        """
        if self.q_lora_rank is not None:
            require_int("q_lora_rank", self.q_lora_rank)
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            require_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.rope_type == "yarn":
            s = self._yarn()
            if not s["factor"] > 0:
                raise ModelConfigError(f"rope factor={s['factor']!r} is impossible; expected > 0")
            require_int("original_max_position_embeddings", s["original_max_position_embeddings"])

    def verify_tensor_parallel(self, config: ModelConfig, tp: int) -> None:
        """Heads split evenly (checked by ``ModelConfig`` already; repeated here so the message
        names MLA); the latent projections are replicated, so nothing else must divide.

        Raises:
            ModelConfigError: ``num_attention_heads % tp != 0``.
        """
        if config.num_attention_heads % tp:
            raise ModelConfigError(f"DeepseekV3ForCausalLM splits the MLA heads across ranks: "
                                   f"num_attention_heads={config.num_attention_heads} is not divisible by "
                                   f"tensor_parallel_size={tp}")
