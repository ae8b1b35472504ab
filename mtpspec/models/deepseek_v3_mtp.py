"""DeepSeek-V3 MTP draft layers (DeepSeek-V3 technical report, arXiv:2412.19437, sec. 2.2).

The MTP layer is GLM-4.5's (:class:`mtpspec.models.glm4_moe_mtp.MultiTokenPredictorLayer`:
``fused_eh_norm`` -> optional ``sp_shard`` -> ``eh_proj`` -> block with its last reduction left
undone -> ``fused_allreduce_rms_norm`` tail, the baseline tail, or the sequence-parallel path),
with a DeepSeek-V3 decoder layer (MLA + MoE) as its block. Checkpoint layout: layer ``k`` at
``model.layers.{num_hidden_layers + k}.`` with ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, optional ``shared_head.head`` (absent: tied to the target's ``lm_head``)
and ``embed_tokens`` (ignored), and the block's MLA / MoE weights (:func:`mtp_weight_specs`).
"""

from __future__ import annotations

from typing import ClassVar, Dict

from mtpspec.config import ModelConfig
from mtpspec.models import glm4_moe_mtp
from mtpspec.models.deepseek_v3 import DeepseekV3DecoderLayer, decoder_layer_weight_specs
from mtpspec.models.glm4_moe_mtp import Glm4MoeMTP
from mtpspec.models.interfaces import WeightSpec


class DeepseekV3MTP(Glm4MoeMTP):
    """The DeepSeek-V3 MTP draft model: :class:`~mtpspec.models.glm4_moe_mtp.Glm4MoeMTP` (same
    constructor, ``forward`` / ``compute_logits`` / ``get_top_tokens`` with layer
    ``spec_step_idx % num_mtp_layers``, ``set_variant``) with :class:`DeepseekV3DecoderLayer` blocks."""

    decoder_layer_cls: ClassVar[type] = DeepseekV3DecoderLayer


def mtp_weight_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for :class:`DeepseekV3MTP` (module docstring)."""
    return glm4_moe_mtp.mtp_weight_specs(cfg, decoder_layer_weight_specs)
