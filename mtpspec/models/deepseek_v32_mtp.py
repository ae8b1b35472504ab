"""DeepSeek-V3.2 MTP draft layers (DeepSeek-V3 technical report, arXiv:2412.19437, sec. 2.2, with DSA).

The MTP layer is DeepSeek-V3's (:mod:`mtpspec.models.deepseek_v3_mtp`, i.e. GLM-4.5's
:class:`~mtpspec.models.glm4_moe_mtp.MultiTokenPredictorLayer`: ``fused_eh_norm`` -> optional
``sp_shard`` -> ``eh_proj`` -> block with its last reduction left undone -> the
``fused_allreduce_rms_norm`` tail, the baseline tail, or the sequence-parallel path) with a
DeepSeek-V3.2 decoder layer as its block: sparse MLA driven by the layer's OWN lightning indexer
(checkpoint ``model.layers.{num_hidden_layers + k}.self_attn.indexer.*``), never the target's.
MTP blocks always carry an indexer, GLM-5's included. Checkpoint layout: DeepSeek-V3's MTP
layout (:func:`mtp_weight_specs`) plus those indexer tensors.

MTP index sharing (``index_share_for_mtp_iteration``) is built on two seams and is not done here:
:meth:`DeepseekV32MTP.index_selection` reads the selection a layer used in its latest forward
(e.g. the first pass's, to anchor on), and ``AttentionMetadata.precomputed_topk_pos`` makes a
forward use a given selection instead of running the indexer's scoring.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional

import torch

from mtpspec.config import ModelConfig
from mtpspec.models import glm4_moe_mtp
from mtpspec.models.deepseek_v3_mtp import DeepseekV3MTP
from mtpspec.models.deepseek_v32 import DeepseekV32DecoderLayer, decoder_layer_weight_specs
from mtpspec.models.interfaces import WeightSpec


class DeepseekV32MTP(DeepseekV3MTP):
    """The DeepSeek-V3.2 MTP draft model: :class:`~mtpspec.models.deepseek_v3_mtp.DeepseekV3MTP` (same
    constructor, ``forward`` / ``compute_logits`` / ``get_top_tokens`` with layer
    ``spec_step_idx % num_mtp_layers``, ``set_variant``) with :class:`DeepseekV32DecoderLayer`
    blocks, each with its own indexer and its own
    :class:`~mtpspec.layers.indexer.IndexSelection`."""

    decoder_layer_cls: ClassVar[type] = DeepseekV32DecoderLayer

    def index_selection(self, spec_step_idx: int = 0) -> Optional[torch.Tensor]:
        """The selection layer ``spec_step_idx % num_mtp_layers`` attended in its latest forward:
        ``[num_tokens, K]`` int positions (``-1`` = none) in each row's sequence, computed by its
        own indexer (``K = index_topk``) or taken from ``precomputed_topk_pos``; ``None`` before
        its first forward. Kept until that layer's next forward (no copy: clone to keep longer).
        Under CUDA graphs, read it inside the captured function and return it as a graph output:
        after a replay this attribute still names the tensor of the last capture (of whatever
        batch size), not the replayed graph's.

        Raises:
            ValueError: ``spec_step_idx < 0``.
        """
        return self.get_layer(spec_step_idx).mtp_block.self_attn.index_selection.topk_pos


def mtp_weight_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for :class:`DeepseekV32MTP` (module docstring)."""
    return glm4_moe_mtp.mtp_weight_specs(cfg, decoder_layer_weight_specs)
