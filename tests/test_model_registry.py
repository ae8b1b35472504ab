"""The model registry: what it lists, the errors that name it, one entry is all a new architecture
needs beside its own modules; the config's per-architecture part; no transformers at import time."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mtpspec.config import ModelConfig, ModelConfigError
from mtpspec.models import registry
from mtpspec.models.glm4_moe import Glm4MoeForCausalLM, target_weight_specs
from mtpspec.models.glm4_moe_config import Glm4MoeArchConfig
from mtpspec.models.glm4_moe_mtp import Glm4MoeMTP, mtp_weight_specs

DEMO = os.path.join(os.path.dirname(__file__), "..", "mtpspec", "demo_model")
REPO = os.path.join(os.path.dirname(__file__), "..")


def _demo_config_dict():
    with open(os.path.join(DEMO, "config.json"), "r", encoding="utf-8") as f:
        return json.load(f)


def test_registry_lists_glm45_and_resolves_its_pieces():
    assert "Glm4MoeForCausalLM" in registry.supported_architectures()
    entry = registry.get_architecture("Glm4MoeForCausalLM")
    assert entry.config_class() is Glm4MoeArchConfig
    assert entry.target_class() is Glm4MoeForCausalLM and entry.mtp_class() is Glm4MoeMTP
    cfg = ModelConfig.from_pretrained(DEMO)
    assert entry.target_weight_specs(cfg) == target_weight_specs(cfg)
    assert entry.mtp_weight_specs(cfg) == mtp_weight_specs(cfg)


def test_unsupported_architecture_errors_list_the_registry():
    names = registry.supported_architectures()
    with pytest.raises(ModelConfigError, match="unsupported architecture") as exc:
        ModelConfig.from_dict({**_demo_config_dict(), "architectures": ["LlamaForCausalLM"]})
    assert "LlamaForCausalLM" in str(exc.value) and str(names) in str(exc.value)
    with pytest.raises(ModelConfigError, match="unsupported architecture 'Nope'") as exc:
        registry.get_architecture("Nope")
    assert str(names) in str(exc.value)


def test_one_registry_entry_adds_an_architecture(tmp_path, monkeypatch):
    """A new name mapped to existing pieces: config parsing and loading follow the registry alone."""
    monkeypatch.setitem(registry._ARCHITECTURES, "Glm4MoeAliasForCausalLM",
                        registry.get_architecture("Glm4MoeForCausalLM"))
    raw = _demo_config_dict()
    raw["architectures"] = ["Glm4MoeAliasForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for name in os.listdir(DEMO):
        if name.endswith((".safetensors", ".safetensors.index.json")):
            os.symlink(os.path.abspath(os.path.join(DEMO, name)), tmp_path / name)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == "Glm4MoeAliasForCausalLM" and isinstance(cfg.arch, Glm4MoeArchConfig)
    from mtpspec.models import load_models
    target, mtp = load_models(str(tmp_path), dtype=torch.float32, device="cpu")
    assert isinstance(target, Glm4MoeForCausalLM) and isinstance(mtp, Glm4MoeMTP)


def test_architecture_part_fields_read_through_the_config():
    cfg = ModelConfig.from_pretrained(DEMO)
    assert isinstance(cfg.arch, Glm4MoeArchConfig)
    for name in ("num_key_value_heads", "head_dim", "rotary_dim", "partial_rotary_factor", "attention_bias",
                 "use_qk_norm", "rope_is_neox_style"):
        assert getattr(cfg, name) == getattr(cfg.arch, name)
    with pytest.raises(AttributeError, match="set config.arch.head_dim"):
        cfg.head_dim = 8
    with pytest.raises(AttributeError, match="kv_lora_rank.*Glm4MoeArchConfig"):
        cfg.kv_lora_rank


def test_reading_a_config_imports_no_model_code_and_mtpspec_never_imports_transformers():
    code = ("import sys, pkgutil, importlib\n"
            "from mtpspec.config import ModelConfig\n"
            f"ModelConfig.from_pretrained({DEMO!r})\n"
            "heavy = [m for m in sys.modules if m.startswith(('mtpspec.layers', 'mtpspec.ops', 'triton'))\n"
            "         or m in ('mtpspec.models.glm4_moe', 'mtpspec.models.loader')]\n"
            "assert not heavy, heavy[:3]\n"
            "import mtpspec\n"
            "for m in pkgutil.walk_packages(mtpspec.__path__, 'mtpspec.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
            "assert not bad, bad[:3]\n")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
