"""The model registry: a config.json ``architectures`` name -> where its pieces live.

One entry per architecture, each naming (as ``"module:attribute"`` under ``mtpspec.models``,
imported on first use, so reading a config imports no model code):

* ``config``: the :class:`~mtpspec.config.ArchConfig` subclass that parses and checks the
  architecture's own config.json fields (``ModelConfig.arch``);
* ``target`` / ``target_specs``: the target model class and its weight-spec function
  ``(ModelConfig) -> {checkpoint key: WeightSpec}``;
* ``mtp`` / ``mtp_specs``: the MTP draft model class and its weight-spec function.

The loader (:mod:`mtpspec.models.loader`) builds, loads and exports models only through these.
Constructor contracts: ``target(config, params_dtype)`` with ``get_input_embeddings()`` and
``lm_head``; ``mtp(config, embed_tokens, lm_head, tie_heads, fuse_allreduce_rmsnorm,
sequence_parallel, params_dtype)`` with ``tie_heads`` (one bool per MTP layer) kept as an
attribute. Adding an architecture = its own modules + one line in ``_ARCHITECTURES``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List


@dataclass(frozen=True)
class ModelArchitecture:
    """Where one architecture's pieces live (``"module:attribute"`` under ``mtpspec.models``).

    The accessors import the named module on first use (``ImportError`` / ``AttributeError``
    when an entry names something that does not exist).
    """

    config: str
    target: str
    target_specs: str
    mtp: str
    mtp_specs: str

    @staticmethod
    def _resolve(ref: str) -> Any:
        module, attr = ref.split(":")
        return getattr(importlib.import_module(f"mtpspec.models.{module}"), attr)

    def config_class(self) -> type:
        """The :class:`~mtpspec.config.ArchConfig` subclass (``ModelConfig.arch``'s type)."""
        return self._resolve(self.config)

    def target_class(self) -> type:
        """The target model class (``nn.Module``; ``forward(input_ids [T], positions [T]) -> [T, H]``)."""
        return self._resolve(self.target)

    def mtp_class(self) -> type:
        """The MTP draft model class (``nn.Module``; ``forward(input_ids, positions, previous_hidden_states,
        spec_step_idx) -> [T, H]``)."""
        return self._resolve(self.mtp)

    def target_weight_specs(self, config: Any) -> Dict[str, Any]:
        """``{checkpoint key: WeightSpec}`` of the target model for ``config``."""
        fn: Callable[[Any], Dict[str, Any]] = self._resolve(self.target_specs)
        return fn(config)

    def mtp_weight_specs(self, config: Any) -> Dict[str, Any]:
        """``{checkpoint key: WeightSpec}`` of the MTP model's ``num_nextn_predict_layers`` layers."""
        fn: Callable[[Any], Dict[str, Any]] = self._resolve(self.mtp_specs)
        return fn(config)


_ARCHITECTURES: Dict[str, ModelArchitecture] = {
    "Glm4MoeForCausalLM": ModelArchitecture("glm4_moe_config:Glm4MoeArchConfig", "glm4_moe:Glm4MoeForCausalLM",
                                            "glm4_moe:target_weight_specs", "glm4_moe_mtp:Glm4MoeMTP",
                                            "glm4_moe_mtp:mtp_weight_specs"),
    "DeepseekV3ForCausalLM": ModelArchitecture("deepseek_v3_config:DeepseekV3ArchConfig",
                                               "deepseek_v3:DeepseekV3ForCausalLM", "deepseek_v3:target_weight_specs",
                                               "deepseek_v3_mtp:DeepseekV3MTP", "deepseek_v3_mtp:mtp_weight_specs"),
    "DeepseekV32ForCausalLM": ModelArchitecture("deepseek_v32_config:DeepseekV32ArchConfig",
                                                "deepseek_v32:DeepseekV32ForCausalLM", "deepseek_v32:target_weight_specs",
                                                "deepseek_v32_mtp:DeepseekV32MTP", "deepseek_v32_mtp:mtp_weight_specs"),
    "GlmMoeDsaForCausalLM": ModelArchitecture("glm_moe_dsa_config:GlmMoeDsaArchConfig",
                                              "glm_moe_dsa:GlmMoeDsaForCausalLM", "deepseek_v32:target_weight_specs",
                                              "glm_moe_dsa:GlmMoeDsaMTP", "deepseek_v32_mtp:mtp_weight_specs"),
}


def supported_architectures() -> List[str]:
    """The registered architecture names, in registration order."""
    return list(_ARCHITECTURES)


def get_architecture(name: str) -> ModelArchitecture:
    """The registry entry of ``name``.

    Raises:
        ModelConfigError: ``name`` is not registered (the message lists the registered names).
    """
    if name not in _ARCHITECTURES:
        from mtpspec.config import ModelConfigError
        raise ModelConfigError(f"unsupported architecture {name!r}; supported: {supported_architectures()}")
    return _ARCHITECTURES[name]
