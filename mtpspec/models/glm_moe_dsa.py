"""GLM-5 (``GlmMoeDsaForCausalLM``) target and MTP models.

The computation of ``transformers``' ``GlmMoeDsaForCausalLM`` is DeepSeek-V3.2's
(:mod:`mtpspec.models.deepseek_v32`) with two config-driven differences, both handled there from
the config (:mod:`mtpspec.models.glm_moe_dsa_config`): the indexer's rope is interleaved, and
``"shared"`` layers (``indexer_types``) carry no indexer and attend the selection of the previous
``"full"`` layer in the same forward (``GlmMoeDsaAttention``'s ``prev_topk_indices``). The MTP
layers (:class:`GlmMoeDsaMTP`) always run their own indexer. Checkpoint layout: DeepSeek-V3.2's
(:func:`~mtpspec.models.deepseek_v32.target_weight_specs`,
:func:`~mtpspec.models.deepseek_v32_mtp.mtp_weight_specs`), without indexer tensors in shared
layers.
"""

from __future__ import annotations

from mtpspec.models.deepseek_v32 import DeepseekV32ForCausalLM
from mtpspec.models.deepseek_v32_mtp import DeepseekV32MTP


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """The GLM-5 target model (:class:`~mtpspec.models.deepseek_v32.DeepseekV32ForCausalLM`)."""


class GlmMoeDsaMTP(DeepseekV32MTP):
    """The GLM-5 MTP draft model (:class:`~mtpspec.models.deepseek_v32_mtp.DeepseekV32MTP`)."""
