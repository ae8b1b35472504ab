"""Model presets for the training recipe, and building / initialising mtpspec's own model classes
for training (tp 1): :class:`~mtpspec.models.Glm4MoeForCausalLM` plus :class:`~mtpspec.models.Glm4MoeMTP`
sharing its embedding, with the MTP ``shared_head.head`` tied to the target's ``lm_head`` (the
DeepSeek-V3 report, section 2.2: "shared embedding layer" and "shared output head").
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


def make_config_dict(preset: str, vocab_size: int, eot_id: int, **overrides: Any) -> Dict[str, Any]:
    """The ``config.json`` dict of ``preset`` for a tokenizer of ``vocab_size`` whose end-of-text id
    is ``eot_id`` (used as ``eos_token_id`` and ``pad_token_id``; no BOS token).

    Raises:
        ValueError: unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    raw = dict(_COMMON)
    raw.update(PRESETS[preset])
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

    RMSNorm weights 1; biases and the router's ``e_score_correction_bias`` 0; matrices
    ``N(0, std)``, the residual-branch outputs (``o_proj``, ``down_proj``, expert ``w2``) scaled by
    ``1 / sqrt(2 * num_layers)``. Deterministic for a given ``seed`` (CPU generator).
    """
    from mtpspec.layers.layernorm import RMSNorm
    norm_params = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
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

    The MTP model shares the target's ``embed_tokens`` and uses its ``lm_head`` as every
    layer's ``shared_head.head``; only the MTP layers' own parameters belong to ``mtp``.
    """
    from mtpspec.models import Glm4MoeForCausalLM, Glm4MoeMTP
    with torch.device(device):
        target = Glm4MoeForCausalLM(config, dtype)
        mtp = Glm4MoeMTP(config, target.model.embed_tokens, target.lm_head, tie_heads=True, params_dtype=dtype)
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
