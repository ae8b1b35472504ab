"""GLM-5 (``GlmMoeDsaForCausalLM``): config, shared-selection layers, target, MTP, engine, loader errors.

Tiny random checkpoints written by ``transformers``' own ``GlmMoeDsaForCausalLM.save_pretrained``
(4 layers, ``indexer_types`` full / shared / full / shared, so each shared layer follows a
different full layer; interleaved indexer rope; ``index_topk`` 6) plus random MTP layers with
their own indexers (``tests/tiny_models.py``, ``family="glm_moe_dsa"``). The checks are
``tests/test_deepseek_v32.py``'s helpers:

* config: ``indexer_types`` derived from ``index_topk_freq`` / ``index_skip_topk_offset`` /
  ``index_topk_pattern`` as ``transformers``' ``GlmMoeDsaConfig`` does; bad types are errors;
* shared layers hold no indexer and no indexer cache and attend exactly the selection of the
  previous full layer of the same forward;
* target logits equal ``transformers`` at tp 1, 2, 4 (pruning matters, no near-tie boundaries);
  MTP at tp 2 / 4 equals tp 1 (fused / baseline / SP), equals a float64 reference built from
  ``transformers``' ``GlmMoeDsaDecoderLayer``, and uses its own indexer;
* engine (1 MTP layer): greedy == ``generate``; speculative decoding (k 1 and 3, fused / unfused /
  SP, local argmax on / off, tp 1 and 2, the graph code path under the no-host-sync guard) emits
  the plain greedy tokens;
* loader: a missing indexer tensor of a full layer or of the MTP layer is named; an indexer
  tensor in a shared layer is an unexpected key.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from mtpspec.config import ModelConfig, ModelConfigError
from mtpspec.models import load_models
from test_deepseek_v32 import (TopkGuard, check_graph_path_sync_free, check_greedy_matches_generate,
                               check_missing_tensor_is_named, check_mtp_reference, check_mtp_tp,
                               check_mtp_uses_its_own_indexer, check_pruning_matters, check_spec, check_target,
                               dsa_extras, dsa_target_checks, engine_generate, engine_llm, loader_base_for,
                               make_engine_model, make_setup, write_variant)
from tiny_models import DSV3_YARN, GLM5_TINY_CONFIG

FAMILY = "glm_moe_dsa"
VARIANTS = {
    # default rope, 2 MTP layers
    "shared": dict(num_mtp_layers=2),
    # YaRN, tied MTP head, shared layers 1 and 2 after full layer 0
    "yarn_fss": dict(num_mtp_layers=1, mtp_head=False, rope_parameters=DSV3_YARN,
                     indexer_types=["full", "shared", "shared", "full"]),
}
PROMPT_LENS = (1, 7, 13, 4, 16)
NAMES = ("GlmMoeDsaForCausalLM", "GlmMoeDsaMTP")


# ------------------------------------------------------------------------------------------------ config
def _raw(**over):
    raw = dict(GLM5_TINY_CONFIG, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa")
    raw.update(over)
    return raw


def test_indexer_types_are_derived_as_transformers_does():
    from transformers import GlmMoeDsaConfig
    base = {k: v for k, v in _raw().items() if k != "indexer_types"}
    for n, extra in [(9, dict(index_topk_freq=3, index_skip_topk_offset=2)), (9, dict(index_topk_freq=2)),
                     (7, dict(index_topk_freq=4, index_skip_topk_offset=3)), (4, dict(index_topk_pattern="FSSF")),
                     (4, dict(index_topk_pattern=["full", "full", "shared", "full"])), (5, {})]:
        hf = GlmMoeDsaConfig(num_hidden_layers=n, **extra)
        cfg = ModelConfig.from_dict({**base, "num_hidden_layers": n, **extra})
        assert list(cfg.indexer_types) == hf.indexer_types, extra
        assert [cfg.layer_has_indexer(i) for i in range(n + 2)] == [t == "full" for t in hf.indexer_types] + [True] * 2
    cfg = ModelConfig.from_dict(_raw())
    assert cfg.indexer_types == ("full", "shared", "full", "shared") and cfg.indexer_rope_interleave
    assert cfg.index_n_heads == 8
    assert ModelConfig.from_dict({k: v for k, v in _raw().items() if k != "index_n_heads"}).index_n_heads == 32


@pytest.mark.parametrize("over,msg", [
    (dict(indexer_types=["shared", "full", "full", "full"]), r"indexer_types\[0\] must be 'full'"),
    (dict(indexer_types=["full", "shared", "full"]), "one of .* per layer .*num_hidden_layers=4"),
    (dict(indexer_types=["full", "sparse", "full", "full"]), "one of .* per layer"),
    (dict(indexer_types="FSFS"), "'indexer_types' must be a list"),
    (dict(indexer_types=None, index_topk_pattern="FXFS"), r"characters \['X'\]"),
    (dict(indexer_rope_interleave=False), "indexer_rope_interleave=False contradicts GlmMoeDsaForCausalLM"),
    (dict(q_lora_rank=None), "GlmMoeDsaForCausalLM needs q_lora_rank"),
])
def test_config_errors_are_clear(over, msg):
    with pytest.raises(ModelConfigError, match=msg):
        ModelConfig.from_dict(_raw(**over))


# ------------------------------------------------------------------------------------- target + MTP, tp 1 2 4
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory, FAMILY, VARIANTS, PROMPT_LENS, 70, dsa_target_checks, dsa_extras)


def test_selection_prunes_and_has_no_near_ties(setup):
    data, _, hfs, guard = setup
    guard.assert_well_posed(min_pruned=20)
    for name in VARIANTS:
        check_pruning_matters(hfs[name], data[name][1], data[name][2], data[name][0])


def _indexer_rows(variant):
    types = VARIANTS[variant].get("indexer_types", GLM5_TINY_CONFIG["indexer_types"])
    return [(8 * 16, 24) if t == "full" else None for t in types]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_target_matches_transformers(setup, variant, tp):
    data, runs, _, _ = setup
    check_target(data, runs, variant, tp, NAMES, _indexer_rows(variant))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_tp_equals_tp1_and_arms_agree(setup, variant, tp):
    check_mtp_tp(setup[1], variant, tp, VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_matches_independent_transformers_reference(setup, variant):
    data, _, hfs, _ = setup
    check_mtp_reference(hfs, data, variant)


def test_mtp_uses_its_own_indexer(setup):
    check_mtp_uses_its_own_indexer(setup[0]["shared"][0])


def test_shared_layers_attend_the_previous_full_layers_selection(setup):
    """Each layer's sparse attention receives: its own indexer's selection (full layers) or the very
    tensor of the previous full layer (shared layers); no cache and no indexer in shared layers."""
    from mtpspec.engine.kv_cache import attention_layers, bytes_per_block
    target, mtp = load_models(setup[0]["shared"][0], dtype=torch.float32, device="cpu")
    seen = {}
    hooks = [layer.self_attn.mla_attn.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[4])) for i, layer in enumerate(target.model.layers)]
    p = torch.randint(3, 200, (14,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target(p, torch.arange(14))
    for h in hooks:
        h.remove()
    assert seen[1] is seen[0] and seen[3] is seen[2] and not torch.equal(seen[0], seen[2])
    assert target.index_selection.topk_pos is None  # dropped after the forward
    assert [layer.self_attn.indexer is None for layer in target.model.layers] == [False, True, False, True]
    layers = attention_layers(target, mtp)
    assert len(layers) == 4 + 2 + 2 * 2  # latent caches, indexer caches of the full layers, MTP (both)
    assert bytes_per_block(layers, 4, torch.float32) == 4 * 4 * ((4 + 2) * (16 + 8) + (2 + 2) * 16)


# ------------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    return make_engine_model(tmp_path_factory, FAMILY, 1, 13)


@pytest.fixture(scope="module")
def plain_greedy(engine_model):
    path, _, _, prompts = engine_model
    guard = TopkGuard()
    with guard.active(), engine_llm(path) as llm:
        out = engine_generate(llm, prompts)
    guard.assert_well_posed(min_pruned=50)
    return out


def test_plain_greedy_matches_transformers_generate(engine_model, plain_greedy):
    check_greedy_matches_generate(engine_model[1], engine_model[3], plain_greedy)


@pytest.mark.parametrize("k,local_argmax,fused", [(1, False, False), (3, True, True)])
def test_mtp_spec_decoding_equals_plain_greedy(engine_model, plain_greedy, k, local_argmax, fused):
    check_spec(engine_model[0], engine_model[3], plain_greedy, k, local_argmax, fused)


def test_graph_code_path_with_padding_equals_plain_greedy(engine_model, plain_greedy, monkeypatch):
    check_graph_path_sync_free(engine_model[0], engine_model[3], plain_greedy, 3, False, monkeypatch)


@pytest.mark.parametrize("k,fused,seq_parallel,local_argmax", [(1, True, False, True), (3, False, True, False)])
def test_mtp_spec_decoding_tp2_equals_plain_greedy(engine_model, plain_greedy, k, fused, seq_parallel, local_argmax):
    check_spec(engine_model[0], engine_model[3], plain_greedy, k, local_argmax, fused, tp=2,
               seq_parallel=seq_parallel)


# ------------------------------------------------------------------------------------------------- loader
@pytest.fixture(scope="module")
def loader_base(tmp_path_factory):
    return loader_base_for(tmp_path_factory, FAMILY, "glm5_loader")


@pytest.mark.parametrize("key", ["model.layers.2.self_attn.indexer.wq_b.weight",
                                 "model.layers.4.self_attn.indexer.k_norm.weight"])  # a full layer, the MTP layer
def test_missing_tensor_is_named(tmp_path, loader_base, key, monkeypatch):
    check_missing_tensor_is_named(tmp_path, loader_base, key, monkeypatch)


def test_indexer_tensor_in_a_shared_layer_is_unexpected(tmp_path, loader_base):
    from mtpspec.models import UnexpectedKeyError
    key = "model.layers.3.self_attn.indexer.wk.weight"
    path = write_variant(tmp_path, loader_base,
                         lambda t: t.__setitem__(key, t["model.layers.2.self_attn.indexer.wk.weight"].clone()))
    with pytest.raises(UnexpectedKeyError, match=key.replace(".", r"\.")):
        load_models(path, dtype=torch.float32, device="cpu")
