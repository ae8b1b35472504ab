"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): config, target, MTP, engine and loader errors.

Tiny random checkpoints written by ``transformers``' own ``DeepseekV3ForCausalLM.save_pretrained``
(random non-trivial norm weights, 2-4 expert groups, ``v_head_dim`` != qk head dim) plus random
MTP layers (``tests/tiny_models.py``, ``family="deepseek_v3"``):

* config: YaRN frequencies, cos / sin factor and softmax scale equal ``transformers``'; tp that
  does not divide the heads, unsupported rope types and attention biases give clear errors;
* target logits equal ``transformers``' ``DeepseekV3ForCausalLM`` (fp32, eager) at tp 1 and tp 2
  (gloo ranks; one prompt at a time, a padded varlen batch, and through the paged latent cache:
  chunked prefill then decode) for q-lora on / off, YaRN on / off, ``rope_interleave`` both ways;
* MTP: tp 2 equals tp 1, the fused / baseline / sequence-parallel tails agree, ``get_top_tokens``
  equals the argmax of the logits, and layer 0 equals an independent reference built from
  ``transformers``' own ``DeepseekV3DecoderLayer`` loaded with the MTP block's weights;
* engine (tp 1): greedy decoding equals ``transformers`` ``generate``; MTP speculative decoding
  (k 1 and 3, fused / unfused, local argmax on / off) emits exactly the plain greedy tokens;
* loader: a missing tensor and a wrong shape are named, nothing half-loaded.

Until the ``mla`` branch's :class:`~mtpspec.layers.mla_attention.MLAAttention` is present, this
module installs a TEST-ONLY stand-in of that exact interface (absorbed MLA computed as
multi-query attention over ``[c_kv | k_pe]`` keys and ``[c_kv | 0]`` values through the existing
paged :class:`~mtpspec.layers.attention.Attention`); spawned ranks import this module, so they
get it too. The engine tests run at tp 1 (in-process) for that reason.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

torch.set_num_threads(1)


def _install_mla_stand_in() -> bool:
    try:
        import mtpspec.layers.mla_attention  # noqa: F401  (the real layer, once branch mla is merged)
        return False
    except ImportError:
        pass
    from mtpspec.layers.attention import Attention

    class MLAAttention(Attention):
        """TEST stand-in of the mla branch's interface: ``forward(q_latent [T, H, r], q_pe [T, H, rope],
        c_kv [T, r], k_pe [T, rope]) -> o_latent [T, H, r]``."""

        def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
            super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1)
            self.kv_lora_rank = kv_lora_rank

        def forward(self, q_latent, q_pe, c_kv, k_pe):  # type: ignore[override]
            t, h, r = q_latent.shape
            q = torch.cat([q_latent, q_pe], -1).reshape(t, -1)
            k = torch.cat([c_kv, k_pe], -1)
            v = torch.cat([c_kv, torch.zeros_like(k_pe)], -1)
            return super().forward(q, k, v).view(t, h, -1)[..., :r]

    mod = types.ModuleType("mtpspec.layers.mla_attention")
    mod.MLAAttention = MLAAttention
    sys.modules["mtpspec.layers.mla_attention"] = mod
    return True


STAND_IN = _install_mla_stand_in()

from mtpspec.config import ModelConfig, ModelConfigError  # noqa: E402
from mtpspec.distributed import comm_stats, get_tensor_model_parallel_rank, launch, reset_comm_stats  # noqa: E402
from mtpspec.layers.attention import (  # noqa: E402
    allocate_kv_caches, build_attention_metadata, collect_attention_layers, set_forward_context)
from mtpspec.models import load_models  # noqa: E402
from tiny_models import DSV3_TINY_CONFIG, DSV3_YARN, make_tiny_checkpoint  # noqa: E402

VARIANTS = {
    # q-lora, YaRN, interleaved rope, 2 MTP layers with their own heads
    "qlora_yarn_interleave": dict(num_mtp_layers=2, rope_parameters=DSV3_YARN),
    # q_proj, default rope, neox rope, tied MTP head, 4 groups pick 2, no top-k renormalisation
    "qproj_default_neox": dict(num_mtp_layers=1, mtp_head=False, q_lora_rank=None, rope_interleave=False,
                               n_group=4, topk_group=2, num_experts_per_tok=2, norm_topk_prob=False,
                               routed_scaling_factor=2.0, first_k_dense_replace=2),
    # q_proj with YaRN and neox rope
    "qproj_yarn_neox": dict(num_mtp_layers=1, q_lora_rank=None, rope_interleave=False, rope_parameters=DSV3_YARN),
}
PROMPT_LENS = (1, 7, 13, 4)
ATOL, RTOL = 2e-4, 2e-5
MTP_ATOL, MTP_RTOL = 1e-4, 1e-5


# ------------------------------------------------------------------------------------------------- config
def _raw(**over):
    raw = dict(DSV3_TINY_CONFIG, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    raw.update(over)
    return raw


def test_config_yarn_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    for params in (DSV3_YARN, dict(DSV3_YARN, mscale=0.7, mscale_all_dim=0.7), dict(DSV3_YARN, mscale_all_dim=0),
                   dict(DSV3_YARN, factor=40.0, beta_fast=16)):
        kw = {k: v for k, v in DSV3_TINY_CONFIG.items() if k != "rope_theta"}
        hf = DeepseekV3Config(**kw, rope_parameters=dict(params))
        inv, att = ROPE_INIT_FUNCTIONS["yarn"](hf)
        cfg = ModelConfig.from_dict(_raw(rope_parameters=dict(params)))
        assert cfg.rope_type == "yarn"
        assert torch.equal(torch.tensor(cfg.rope_inv_freq(cfg.rope_theta), dtype=torch.float32), inv)
        assert cfg.rope_attention_factor == pytest.approx(att, rel=1e-12)
        assert cfg.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, cfg.qk_head_dim ** -0.5),
                                                  rel=1e-12)
    legacy = ModelConfig.from_dict(_raw(rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                      "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}))
    new = ModelConfig.from_dict(_raw(rope_parameters=DSV3_YARN))
    assert legacy.softmax_scale == new.softmax_scale and legacy.rope_inv_freq(1e4) == new.rope_inv_freq(1e4)
    plain = ModelConfig.from_dict(_raw())
    assert plain.rope_type == "default" and plain.rope_attention_factor == 1.0
    assert plain.softmax_scale == (12 + 8) ** -0.5 and plain.kv_cache_head_size == 16 + 8


def test_config_errors_are_clear():
    cfg = ModelConfig.from_dict(_raw())
    cfg.verify_tensor_parallel(2)
    cfg.verify_tensor_parallel(4)
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        cfg.verify_tensor_parallel(3)
    with pytest.raises(ModelConfigError, match="MLA heads.*num_attention_heads=4.*tensor_parallel_size=3"):
        cfg.arch.verify_tensor_parallel(cfg, 3)
    with pytest.raises(ModelConfigError, match="unsupported rope_type 'llama3'"):
        ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}))
    with pytest.raises(ModelConfigError, match="attention_bias"):
        ModelConfig.from_dict(_raw(attention_bias=True))
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim=7 must be even"):
        ModelConfig.from_dict(_raw(qk_rope_head_dim=7))
    with pytest.raises(ModelConfigError, match="kv_lora_rank=0"):
        ModelConfig.from_dict(_raw(kv_lora_rank=0))


def test_model_refuses_tp_not_dividing_heads(monkeypatch):
    import mtpspec.models.glm4_moe as glm
    from mtpspec.models.deepseek_v3 import DeepseekV3ForCausalLM
    cfg = ModelConfig.from_dict(_raw())
    monkeypatch.setattr(glm, "get_tensor_model_parallel_world_size", lambda: 3)
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        DeepseekV3ForCausalLM(cfg, torch.float32)
