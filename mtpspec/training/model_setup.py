"""Model presets for the training recipe, and building / initialising mtpspec's own model classes
for training (tp 1): the target of the preset's architecture plus its MTP model sharing the
target's embedding, with the MTP ``shared_head.head`` tied to the target's ``lm_head`` (the
DeepSeek-V3 report, section 2.2: "shared embedding layer" and "shared output head").

Two architectures (``--arch``):

* ``glm4_moe`` (default, the bundled demo model): :class:`~mtpspec.models.Glm4MoeForCausalLM` +
  :class:`~mtpspec.models.Glm4MoeMTP` (GQA, DeepSeek MoE without expert groups), :data:`PRESETS`.
* ``glm_moe_dsa`` (GLM-5 architecture, ``GlmMoeDsaForCausalLM`` as ``transformers`` 5 defines
  it): :class:`~mtpspec.models.glm_moe_dsa.GlmMoeDsaForCausalLM` + ``GlmMoeDsaMTP``: MLA with
  q-lora, the DSA lightning indexer (``index_topk``; ``"shared"`` layers reuse the previous full
  layer's selection), DeepSeek MoE with expert groups (``n_group > 1``), one MTP layer with its
  own indexer, :data:`DSA_PRESETS`. Its training-time attention is :mod:`mtpspec.training.dsa`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch
from torch import nn

from mtpspec.config import ModelConfig

# Hugging Face ``config.json`` fields (GLM-4.5 / ``Glm4MoeConfig`` names) of each preset; the
# vocabulary size and special-token ids are filled in from the trained tokenizer.
PRESETS: Dict[str, Dict[str, Any]] = {
    # ~13 M parameters with tied embeddings (about 26 MB in bf16): 4 layers, the first dense and
    # three MoE (4 routed experts, top-2, plus 1 shared expert), GQA 8 q / 2 kv heads of 48,
    # half-rotary, and one MoE MTP layer.
    "demo": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=48, moe_intermediate_size=256, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096),
    # Dense MLPs everywhere (MTP block included), about the same total size: a comparison point.
    "demo-dense": dict(hidden_size=384, intermediate_size=1280, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=48, moe_intermediate_size=256, n_routed_experts=4,
                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=5,
                       max_position_embeddings=4096),
    # CPU in a few minutes.
    "tiny": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, moe_intermediate_size=64, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096),
    # CI: seconds.
    "ci": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=2,
               num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=2048),
}

_COMMON: Dict[str, Any] = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_act="silu", attention_bias=True,
    use_qk_norm=False, partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5, norm_topk_prob=True,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, num_nextn_predict_layers=1, tie_word_embeddings=True,
    attention_dropout=0.0, initializer_range=0.02, use_cache=True)


# GLM-5 architecture (``GlmMoeDsaConfig`` names). The demo preset mirrors the GLM-4.5 demo where
# the fields apply (hidden 384, 4 layers with the first dense (intermediate 1024) and three MoE,
# 8 query heads, tied 10,007-token embedding, one MoE MTP layer, 4,096 positions) and replaces the
# rest by GLM-5's parts at small sizes, about 11.8 M parameters (23.7 MB in bf16, below the GLM-4.5
# demo's 13.1 M: the MLA + indexer layers are larger than its GQA, the experts are narrower):
# * MLA: q-lora 128, kv-lora 128, per head 32 nope + 16 rope query / key channels (48, the GLM-4.5
#   demo's head_dim, half of it rotary there too) and 48 value channels (equal to the query / key
#   width, so dense training attention can take the flash kernel);
# * DSA: an indexer of 8 heads x 32 channels (16 rotary) keeping index_topk = 256 positions; layers
#   1 and 3 are "shared" (they attend the selection of layers 0 and 2); the MTP layer has its own.
#   Every 5-shot GSM8K test prompt is longer than 256 tokens with the recipe's tokenizer (1,319 of
#   1,319: 666 to 836 tokens, median 701), so the selection prunes from the first decode step on;
# * MoE: 8 routed experts of intermediate 96 in 4 groups of 2, top-4 experts from the best 3
#   groups, and a shared expert of 192 (n_shared_experts 2 x 96).
DSA_PRESETS: Dict[str, Dict[str, Any]] = {
    "demo": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48,
                 index_topk=256, index_head_dim=32, index_n_heads=8,
                 indexer_types=["full", "shared", "full", "shared"], moe_intermediate_size=96,
                 n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=3, n_shared_experts=2,
                 first_k_dense_replace=1, max_position_embeddings=4096),
    # CPU in a few minutes; index_topk 64 prunes the 5-shot chains (hundreds of tokens).
    "tiny": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                 index_topk=64, index_head_dim=16, index_n_heads=4, indexer_types=["full", "shared"],
                 moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                 n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096),
    # CI: seconds; index_topk 16 prunes nearly every training document.
    "ci": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
               index_topk=16, index_head_dim=16, index_n_heads=4, indexer_types=["full", "shared"],
               moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
               n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=2048),
}

_DSA_COMMON: Dict[str, Any] = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_act="silu", attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=10000.0, rms_norm_eps=1e-5,
    norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1, tie_word_embeddings=True,
    attention_dropout=0.0, initializer_range=0.02, use_cache=True, index_share_for_mtp_iteration=False)

#: ``--arch`` name -> (presets, common config.json fields)
ARCHS: Dict[str, Tuple[Dict[str, Dict[str, Any]], Dict[str, Any]]] = {
    "glm4_moe": (PRESETS, _COMMON), "glm_moe_dsa": (DSA_PRESETS, _DSA_COMMON)}


def make_config_dict(preset: str, vocab_size: int, eot_id: int, arch: str = "glm4_moe",
                     **overrides: Any) -> Dict[str, Any]:
    """The ``config.json`` dict of ``preset`` of architecture ``arch`` (:data:`ARCHS`) for a
    tokenizer of ``vocab_size`` whose end-of-text id is ``eot_id`` (used as ``eos_token_id`` and
    ``pad_token_id``; no BOS token). ``overrides`` replace preset fields (e.g. ``index_topk``).

    Raises:
        ValueError: unknown architecture or preset.
        ModelConfigError: the resulting config does not validate.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(ARCHS)}")
    presets, common = ARCHS[arch]
    if preset not in presets:
        raise ValueError(f"unknown model preset {preset!r} for --arch {arch}; expected one of {sorted(presets)}")
    raw = dict(common)
    raw.update(presets[preset])
    raw.update(vocab_size=int(vocab_size), eos_token_id=int(eot_id), pad_token_id=int(eot_id), bos_token_id=None,
               torch_dtype="bfloat16")
    raw.update(overrides)
    ModelConfig.from_dict(raw)  # validate now, with a clear error
    return raw


def _is_residual_out(name: str) -> bool:
    return name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight"))


@torch.no_grad()
def init_weights(module: nn.Module, num_layers: int, std: float = 0.02, seed: int = 0) -> None:
    """Initialise every parameter in place (GPT-2 style, Radford et al. 2019, section 2.3).

    RMSNorm and LayerNorm weights 1 (the DSA indexer's ``k_norm`` is a LayerNorm); biases and
    the router's ``e_score_correction_bias`` 0; matrices ``N(0, std)``, the residual-branch outputs
    (``o_proj``, ``down_proj``, expert ``w2``) scaled by ``1 / sqrt(2 * num_layers)``.
    Deterministic for a given ``seed`` (CPU generator).
    """
    from mtpspec.layers.layernorm import LayerNorm, RMSNorm
    norm_params = {id(m.weight) for m in module.modules() if isinstance(m, (RMSNorm, LayerNorm))}
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if id(p) in norm_params:
            p.fill_(1.0)
        elif p.dim() < 2:
            p.zero_()
        else:
            s = std / math.sqrt(2 * num_layers) if _is_residual_out(name) else std
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)


def build_models(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> Tuple[nn.Module, nn.Module]:
    """Fresh trainable ``(target, mtp)`` at tp 1 on ``device`` with ``dtype`` parameters
    (the MoE router stays fp32), initialised by :func:`init_weights`.

    The classes are the registry's for ``config.architecture`` (:mod:`mtpspec.models.registry`).
    The MTP model shares the target's ``embed_tokens`` and uses its ``lm_head`` as every
    layer's ``shared_head.head``; only the MTP layers' own parameters belong to ``mtp``.
    """
    from mtpspec.models.registry import get_architecture
    arch = get_architecture(config.architecture)
    with torch.device(device):
        target = arch.target_class()(config, dtype)
        mtp = arch.mtp_class()(config, target.model.embed_tokens, target.lm_head, tie_heads=True,
                               params_dtype=dtype)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    init_weights(target, layers, seed=seed)
    init_weights(mtp.model, layers, seed=seed + 1)
    for m in (target, mtp):
        for p in m.parameters():
            p.requires_grad_(True)
        m.train()
    return target, mtp


def count_parameters(target: nn.Module, mtp: nn.Module) -> Dict[str, int]:
    """Unique parameters: ``{"target", "mtp" (its own, excluding shared), "total"}``."""
    seen = {id(p) for p in target.parameters()}
    t = sum(p.numel() for p in target.parameters())
    m = sum(p.numel() for p in mtp.parameters() if id(p) not in seen)
    return {"target": t, "mtp": m, "total": t + m}
