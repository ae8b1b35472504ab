"""GLM-4.5-family target model, its MTP draft layers, and the checkpoint loader / writer."""

from mtpspec.models.glm4_moe import Glm4MoeForCausalLM
from mtpspec.models.glm4_moe_mtp import Glm4MoeMTP, MultiTokenPredictorLayer
from mtpspec.models.interfaces import SupportsLocalArgmax, supports_local_argmax
from mtpspec.models.loader import (
    CheckpointError, CorruptCheckpointError, MissingKeyError, ShapeMismatchError, UnexpectedKeyError,
    UnsupportedDtypeError, export_hf_state_dict, load_models, load_target_model, save_checkpoint)

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "Glm4MoeForCausalLM", "Glm4MoeMTP", "MissingKeyError",
    "MultiTokenPredictorLayer", "ShapeMismatchError", "SupportsLocalArgmax", "UnexpectedKeyError",
    "UnsupportedDtypeError", "export_hf_state_dict", "load_models", "load_target_model", "save_checkpoint",
    "supports_local_argmax",
]
