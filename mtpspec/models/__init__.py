"""Model classes, the model registry, and the checkpoint loader / writer.

Names are imported lazily (``from mtpspec.models import load_models`` imports the loader then),
so ``mtpspec.models.registry`` and the architectures' config parts can be read without
importing any model code. The supported architectures: :mod:`mtpspec.models.registry`.
"""

from typing import Any

_LAZY = {
    "DeepseekV3ForCausalLM": "mtpspec.models.deepseek_v3",
    "DeepseekV3MTP": "mtpspec.models.deepseek_v3_mtp",
    "DeepseekV32ForCausalLM": "mtpspec.models.deepseek_v32",
    "DeepseekV32MTP": "mtpspec.models.deepseek_v32_mtp",
    "GlmMoeDsaForCausalLM": "mtpspec.models.glm_moe_dsa",
    "GlmMoeDsaMTP": "mtpspec.models.glm_moe_dsa",
    "Glm4MoeForCausalLM": "mtpspec.models.glm4_moe",
    "Glm4MoeMTP": "mtpspec.models.glm4_moe_mtp",
    "MultiTokenPredictorLayer": "mtpspec.models.glm4_moe_mtp",
    "SupportsLocalArgmax": "mtpspec.models.interfaces",
    "supports_local_argmax": "mtpspec.models.interfaces",
    "WeightSpec": "mtpspec.models.interfaces",
    "supported_architectures": "mtpspec.models.registry",
    "get_architecture": "mtpspec.models.registry",
    **{name: "mtpspec.models.loader" for name in (
        "CheckpointError", "CorruptCheckpointError", "MissingKeyError", "ShapeMismatchError", "UnexpectedKeyError",
        "UnsupportedDtypeError", "export_hf_state_dict", "load_models", "load_target_model", "save_checkpoint")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtpspec.models' has no attribute {name!r}")
