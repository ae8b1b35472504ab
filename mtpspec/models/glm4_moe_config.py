"""The GLM-4.5-family part of a model config (``ModelConfig.arch`` for ``Glm4MoeForCausalLM``).

Grouped-query attention with partial rotary: the fields Hugging Face's ``Glm4MoeConfig`` has
beyond the ones every architecture shares (:class:`mtpspec.config.ModelConfig`). Light: no
torch import, so reading a config imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from mtpspec.config import ArchConfig, ModelConfig, ModelConfigError, require_int, rope_parameters


@dataclass(frozen=True)
class Glm4MoeArchConfig(ArchConfig):
    """GLM-4.5-family attention fields.

    Attributes:
        num_key_value_heads: kv heads (default: num_attention_heads).
        head_dim: per-head size (default: hidden_size // num_attention_heads).
        partial_rotary_factor: fraction of head_dim that is rotated (default 0.5, Hugging
            Face's GLM-4-MoE default); read from the top level or from ``rope_parameters``.
        rope_is_neox_style: GLM-4-MoE rotates the two halves of the rotary part
            (``rotate_half``), i.e. neox style: ``True``.
        attention_bias: q/k/v projections carry a bias (default False; o_proj never does).
        use_qk_norm: per-head RMSNorm on q and k before rotary (default False).
        rotary_dim (property): ``int(head_dim * partial_rotary_factor)``, even and > 0.

    Only the default rope is supported (no ``rope_scaling`` / ``rope_type`` other than
    ``"default"``).
    """

    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.5
    rope_is_neox_style: bool = True
    attention_bias: bool = False
    use_qk_norm: bool = False

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "Glm4MoeArchConfig":
        """Read the fields (see the class docstring) from a parsed ``config.json``.

        Raises:
            ModelConfigError: a rope type other than ``"default"`` in ``rope_parameters`` or
                ``rope_scaling``.
        """
        rope_params = rope_parameters(raw)
        rope_scaling = raw.get("rope_scaling") or {}
        for source, params in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
            rtype = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
            if rtype not in ("default", None):
                raise ModelConfigError(f"unsupported {source} rope_type {rtype!r}; only 'default' rope is supported")
        prf = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        head_dim = raw.get("head_dim") or (hidden // heads if isinstance(heads, int) and heads > 0 else 0)
        return cls(num_key_value_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
                   partial_rotary_factor=float(prf), attention_bias=bool(raw.get("attention_bias", False)),
                   use_qk_norm=bool(raw.get("use_qk_norm", False)))

    def validate(self, config: ModelConfig) -> None:
        """Positive kv heads and head_dim, a rotary dim that is even and > 0, heads divisible by kv heads.

        Raises:
            ModelConfigError: naming the value.
        """
        require_int("num_key_value_heads", self.num_key_value_heads)
        require_int("head_dim", self.head_dim)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ModelConfigError(f"config value partial_rotary_factor={self.partial_rotary_factor!r} is "
                                   "impossible; expected 0 < factor <= 1")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ModelConfigError(f"rotary dim int(head_dim * partial_rotary_factor) = {self.rotary_dim} "
                                   f"(head_dim={self.head_dim}) must be even and > 0")
        if config.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads={config.num_attention_heads} is not divisible by "
                                   f"num_key_value_heads={self.num_key_value_heads}")

    def verify_tensor_parallel(self, config: ModelConfig, tp: int) -> None:
        """kv heads either divide evenly (``kv % tp == 0``) or are replicated (``tp % kv == 0``,
        each rank keeps one kv head).

        Raises:
            ModelConfigError: naming the kv heads and tp.
        """
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ModelConfigError(f"num_key_value_heads={kv} cannot be split over tensor_parallel_size={tp}: "
                                   "need kv % tp == 0 (sharded) or tp % kv == 0 (replicated)")
