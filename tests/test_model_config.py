"""ModelConfig: both rope spellings, defaults, and every config error names what is wrong."""

import json

import pytest
import torch

from mtpspec.config import ModelConfig, ModelConfigError

BASE = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 200, "max_position_embeddings": 256, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1,
}


def _cfg(**kw):
    raw = dict(BASE)
    for k, v in kw.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


def test_glm45_style_top_level_rope(tmp_path):
    raw = _cfg(rope_theta=1000000.0, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
               eos_token_id=[151329, 151336, 151338], bos_token_id=None, pad_token_id=151329,
               num_nextn_predict_layers=1, torch_dtype="bfloat16", routed_scaling_factor=2.5)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = ModelConfig.from_pretrained(str(tmp_path))
    assert c.rope_theta == 1e6 and c.partial_rotary_factor == 0.5 and c.rotary_dim == 8
    assert c.use_qk_norm and c.attention_bias and c.num_mtp_layers == 1
    assert c.eos_token_ids == (151329, 151336, 151338) and c.pad_token_id == 151329
    assert c.dtype == torch.bfloat16 and c.routed_scaling_factor == 2.5
    assert c.model_path == str(tmp_path)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_hf5_rope_parameters_spelling_and_defaults():
    raw = _cfg(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
               num_key_value_heads=None, head_dim=None, eos_token_id=7, dtype="float16")
    c = ModelConfig.from_dict(raw)
    assert c.rope_theta == 500.0 and c.partial_rotary_factor == 0.25
    assert c.num_key_value_heads == 8 and c.head_dim == 8 and c.rotary_dim == 2
    assert c.eos_token_ids == (7,) and c.dtype == torch.float16
    # Hugging Face defaults for absent optional keys.
    assert (c.first_k_dense_replace, c.n_shared_experts, c.norm_topk_prob, c.rms_norm_eps) == (1, 1, True, 1e-5)
    assert c.num_nextn_predict_layers == 0 and not c.tie_word_embeddings
    # Absent rope keys: GLM-4-MoE's partial factor 0.5 and base 10000.
    c2 = ModelConfig.from_dict(_cfg())
    assert (c2.rope_theta, c2.partial_rotary_factor, c2.dtype) == (10000.0, 0.5, torch.float32)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "n_routed_experts",
                                 "moe_intermediate_size", "architectures"])
def test_missing_key_is_named(key):
    with pytest.raises(ModelConfigError, match=f"missing required key '{key}'"):
        ModelConfig.from_dict(_cfg(**{key: None}))


def test_unsupported_architecture_is_named():
    with pytest.raises(ModelConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        ModelConfig.from_dict(_cfg(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ModelConfigError, match="unsupported architecture.*LlamaForCausalLM"):  # before other keys
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("kw,pattern", [
    (dict(num_key_value_heads=3), "num_attention_heads=8 is not divisible by num_key_value_heads=3"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (dict(n_group=3), "n_routed_experts=8 is not divisible by n_group=3"),
    (dict(topk_group=3), "topk_group=3 exceeds n_group=2"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the experts in the chosen groups"),
    (dict(n_group=8, topk_group=1), "experts per group"),
    (dict(partial_rotary_factor=0.1), "rotary dim"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor=1.5"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
    (dict(torch_dtype="float64"), "unsupported dtype 'float64'"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers=2.5"),
    (dict(layer_types=["full_attention"]), r"'layer_types' must list one entry per layer \(num_hidden_layers=3\)"),
    (dict(layer_types="full_attention"), "'layer_types' must list one entry per layer"),
])
def test_impossible_values_are_named(kw, pattern):
    with pytest.raises(ModelConfigError, match=pattern):
        ModelConfig.from_dict(_cfg(**kw))


def test_tensor_parallel_checks():
    c = ModelConfig.from_dict(_cfg())  # 8 heads, 2 kv heads
    for tp in (1, 2, 4, 8):
        c.verify_tensor_parallel(tp)  # tp 4 and 8 replicate the kv heads
    with pytest.raises(ModelConfigError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        c.verify_tensor_parallel(3)
    c6 = ModelConfig.from_dict(_cfg(num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                                    intermediate_size=96))
    c6.verify_tensor_parallel(2)
    with pytest.raises(ModelConfigError, match="num_key_value_heads=6 cannot be split over tensor_parallel_size=4"):
        c6.verify_tensor_parallel(4)
    with pytest.raises(ModelConfigError, match="moe_intermediate_size=32 is not divisible"):
        ModelConfig.from_dict(_cfg(num_attention_heads=64, num_key_value_heads=64, head_dim=8,
                                   intermediate_size=128)).verify_tensor_parallel(64)
    with pytest.raises(ModelConfigError, match="intermediate_size=96 is not divisible"):
        ModelConfig.from_dict(_cfg(num_attention_heads=128, num_key_value_heads=128,
                                   head_dim=8)).verify_tensor_parallel(128)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="invalid JSON"):
        ModelConfig.from_pretrained(str(tmp_path))
