"""Tiny random GLM-4.5-family and DeepSeek-V3 checkpoints for tests and smoke runs (needs ``transformers``, a test
dependency, so it lives with the tests: ``from tiny_models import make_tiny_checkpoint`` in a test
module; scripts outside tests/ put this folder on ``sys.path`` first).

:func:`make_tiny_checkpoint` builds a random ``transformers.Glm4MoeForCausalLM`` (dense and MoE
layers, partial rotary, GQA), saves it with ``save_pretrained`` (Hugging Face's own on-disk
layout), then adds random MTP layers with :func:`mtpspec.models.loader.save_checkpoint`.
``family="deepseek_v3"`` does the same with ``transformers.DeepseekV3ForCausalLM`` (MLA with
q-lora, ``v_head_dim`` != qk head dim, 2 expert groups; ``DSV3_TINY_CONFIG``); ``"deepseek_v32"`` and
``"glm_moe_dsa"`` (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``: DSA indexers with ``index_topk`` 6,
GLM-5 with two ``"shared"`` layers) likewise.
Weights are rescaled so activations stay O(1) and routing is not degenerate (Hugging Face's
0.02-std init gives near-zero logits, which would make comparisons weak).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional, Tuple

import torch

from mtpspec.config import ModelConfig

TINY_CONFIG: Dict[str, Any] = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
    n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
    norm_topk_prob=True, use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.5,
    rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    eos_token_id=[1, 2], bos_token_id=0)

DSV3_TINY_CONFIG: Dict[str, Any] = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4,  # transformers' MLA repeats kv by heads // kv heads: must equal the heads
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2,
    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True, rope_interleave=True,
    rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    eos_token_id=[1, 2], bos_token_id=0)

#: DeepSeek-V3.2: DeepSeek-V3's tiny MLA (q-lora; MLA rope always interleaved) plus a DSA indexer with
#: ``index_topk`` 6, so test prompts longer than 6 tokens really prune; 8 indexer heads keep exact ties of
#: the ReLU'd scores (all heads negative) rare
DSV32_TINY_CONFIG: Dict[str, Any] = {**{k: v for k, v in DSV3_TINY_CONFIG.items() if k != "rope_interleave"},
                                     "index_topk": 6, "index_head_dim": 16, "index_n_heads": 8}

#: GLM-5: DeepSeek-V3.2's tiny config with 4 layers, two of them "shared" (each after a different full layer)
GLM5_TINY_CONFIG: Dict[str, Any] = {**DSV32_TINY_CONFIG, "num_hidden_layers": 4,
                                    "indexer_types": ["full", "shared", "full", "shared"]}

#: family name -> (transformers config class, model class, tiny config)
FAMILIES = {"glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", TINY_CONFIG),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DSV3_TINY_CONFIG),
            "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", DSV32_TINY_CONFIG),
            "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", GLM5_TINY_CONFIG)}

#: YaRN rope for ``DSV3_TINY_CONFIG`` (``rope_parameters`` override): factor 4 over 64 original
#: positions, mscale != mscale_all_dim, so frequencies, the cos / sin factor and the softmax scale all change
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
             "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def _randomise(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A fresh value for one checkpoint tensor (by its name), float32."""
    shape = tuple(t.shape)
    if name.endswith("norm.weight"):
        return 0.6 + 0.8 * torch.rand(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.2 * torch.randn(shape, generator=g)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if "embed_tokens" in name or "lm_head" in name or "shared_head.head" in name:
        return torch.randn(shape, generator=g)
    fan_in = shape[-1]
    scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0
    return scale * torch.randn(shape, generator=g) / math.sqrt(fan_in)


def make_hf_model(seed: int = 0, family: str = "glm4_moe", **overrides: Any):
    """A random ``transformers.Glm4MoeForCausalLM`` (eval, float32) from ``TINY_CONFIG`` + overrides
    (other families: :data:`FAMILIES`, e.g. ``"deepseek_v3"``: ``DeepseekV3ForCausalLM`` from
    ``DSV3_TINY_CONFIG``)."""
    import transformers
    cfg_name, model_name, base = FAMILIES[family]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    cfg_kwargs = dict(base)
    cfg_kwargs.update(overrides)
    cfg_kwargs.pop("num_nextn_predict_layers", None)
    if "rope_parameters" in cfg_kwargs:
        cfg_kwargs.pop("rope_theta", None)
    hf_cfg = cfg_cls(**cfg_kwargs)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_randomise(name, p, g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(_randomise(name, b, g))
    return model


def random_mtp_tensors(config: ModelConfig, num_mtp_layers: int, seed: int = 0, with_head: bool = True,
                       with_embed: bool = False) -> Dict[str, torch.Tensor]:
    """Random float32 tensors for MTP layers ``num_hidden_layers + k``, ``k < num_mtp_layers``
    (Hugging Face names, per-expert layout)."""
    from dataclasses import replace

    from mtpspec.models.registry import get_architecture
    cfg = replace(config, num_nextn_predict_layers=num_mtp_layers)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, spec in get_architecture(cfg.architecture).mtp_weight_specs(cfg).items():
        if spec.layout is not None and spec.layout.endswith(":fused"):
            continue
        if key.endswith("shared_head.head.weight") and not with_head:
            continue
        if key.endswith("embed_tokens.weight") and not with_embed:
            continue
        out[key] = _randomise(key, torch.empty(spec.shape), g)
    return out


def make_tiny_checkpoint(path: str, seed: int = 0, num_mtp_layers: int = 1, mtp_head: bool = True,
                         dtype: Optional[torch.dtype] = None, max_shard_bytes: Optional[int] = None,
                         family: str = "glm4_moe", **overrides: Any) -> Tuple[Any, ModelConfig]:
    """Write a tiny checkpoint with ``num_mtp_layers`` random MTP layers to ``path``.

    Args:
        path: output folder.
        seed: weights seed.
        num_mtp_layers: MTP layers to add (0: none).
        mtp_head: include ``shared_head.head`` (False: the loader ties it to ``lm_head``).
        dtype: save dtype (default float32).
        max_shard_bytes: shard the safetensors files (with an index) above this size.
        family: ``"glm4_moe"``, ``"deepseek_v3"``, ``"deepseek_v32"`` or ``"glm_moe_dsa"`` (:data:`FAMILIES`).
        overrides: ``Glm4MoeConfig`` fields replacing ``TINY_CONFIG``'s (``DeepseekV3Config`` /
            ``DSV3_TINY_CONFIG`` for DeepSeek-V3).

    Returns:
        ``(hf_model, config)``: the float32 ``transformers`` target model and the mtpspec config.
    """
    from mtpspec.models.loader import read_checkpoint_tensors, save_checkpoint
    model = make_hf_model(seed, family, **overrides)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "r", encoding="utf-8") as f:
        raw = json.load(f)
    raw["num_nextn_predict_layers"] = num_mtp_layers
    tensors = dict(read_checkpoint_tensors(path))
    cfg = ModelConfig.from_dict(raw)
    if num_mtp_layers:
        tensors.update(random_mtp_tensors(cfg, num_mtp_layers, seed + 2, with_head=mtp_head))
    if dtype is not None:
        raw["torch_dtype"] = str(dtype).replace("torch.", "")
        raw.pop("dtype", None)
    save_checkpoint(path, tensors, raw, max_shard_bytes=max_shard_bytes, dtype=dtype)
    cfg = ModelConfig.from_pretrained(path)
    return model, cfg


def hf_mtp_block_reference(hf, path: str, cfg, k: int, ids: torch.Tensor, pos: torch.Tensor, prev: torch.Tensor,
                           build_layer, rotary_cls) -> torch.Tensor:
    """MTP layer ``k`` in float64 from transformers' own decoder layer loaded with the MTP block's
    checkpoint weights: ``eh_proj([enorm(emb; position-0 rows zero), hnorm(prev)])`` -> layer ->
    ``shared_head.norm``, one causal sequence. ``build_layer(hf_cfg, idx)`` makes the architecture's
    decoder layer from a copy of ``hf.config`` (experts on the per-expert loop: grouped_mm has no
    float64); ``rotary_cls(hf.config)`` its rotary embedding."""
    import copy

    from mtpspec.models.loader import read_checkpoint_tensors
    idx = cfg.num_hidden_layers + k
    pre = f"model.layers.{idx}."
    sub = {key[len(pre):]: t.double() for key, t in read_checkpoint_tensors(path) if key.startswith(pre)}
    hf_cfg = copy.deepcopy(hf.config)
    hf_cfg._experts_implementation = "eager"
    layer = build_layer(hf_cfg, idx).eval()
    sd, experts = {}, range(cfg.n_routed_experts)
    for name in layer.state_dict():  # per-expert checkpoint tensors -> transformers' fused experts
        if name == "mlp.experts.gate_up_proj":
            sd[name] = torch.stack([torch.cat([sub[f"mlp.experts.{e}.gate_proj.weight"],
                                               sub[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        elif name == "mlp.experts.down_proj":
            sd[name] = torch.stack([sub[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        else:
            sd[name] = sub[name]
    layer.load_state_dict(sd)
    layer.double()

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    emb = hf.model.embed_tokens.weight.detach().double()[ids]
    emb[pos == 0] = 0
    eh = torch.cat([rms(emb, sub["enorm.weight"]), rms(prev.double(), sub["hnorm.weight"])], -1)
    x = eh @ sub["eh_proj.weight"].T
    t = len(ids)
    cos, sin = rotary_cls(hf.config)(x[None], pos[None])
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        h = layer(x[None], attention_mask=mask, position_ids=pos[None], position_embeddings=(cos, sin))
    h = h[0] if isinstance(h, tuple) else h
    return rms(h[0], sub["shared_head.norm.weight"])

