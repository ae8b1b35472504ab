"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): config, target, MTP, engine and loader errors.

Tiny random checkpoints written by ``transformers``' own ``DeepseekV3ForCausalLM.save_pretrained``
(random non-trivial norm weights, 2-4 expert groups, ``v_head_dim`` != qk head dim) plus random
MTP layers (``tests/tiny_models.py``, ``family="deepseek_v3"``):

* config: YaRN frequencies, cos / sin factor and softmax scale equal ``transformers``'; tp that
  does not divide the heads, unsupported rope types and attention biases give clear errors;
* target logits equal ``transformers``' ``DeepseekV3ForCausalLM`` (fp32, eager) at tp 1, 2 and 4
  (gloo ranks; one prompt at a time, a padded varlen batch, and through the paged latent cache:
  chunked prefill then decode) for q-lora on / off, YaRN on / off, ``rope_interleave`` both ways;
* MTP: tp 2 and 4 equal tp 1, the fused / baseline / sequence-parallel tails agree, ``get_top_tokens``
  equals the argmax of the logits, and layer 0 equals an independent reference built from
  ``transformers``' own ``DeepseekV3DecoderLayer`` loaded with the MTP block's weights;
* engine: greedy decoding equals ``transformers`` ``generate``; MTP speculative decoding (k 1 and
  3, 2 MTP layers, fused / unfused / sequence-parallel, local argmax on / off, tp 1 and 2, the
  CUDA-graph code path with padded batches) emits exactly the plain greedy tokens;
* loader: a missing tensor and a wrong shape are named, nothing half-loaded; a declared MTP layer
  with no tensor at all (plain `save_pretrained`) is named as a layer; export round-trips
  and the fused expert layout loads the same weights.

Attention runs through the real :class:`~mtpspec.layers.mla_attention.MLAAttention` (paged latent
cache, torch path on CPU).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

torch.set_num_threads(1)

from mtpspec.config import ModelConfig, ModelConfigError
from mtpspec.distributed import launch
from mtpspec.layers.attention import collect_attention_layers
from mtpspec.models import load_models
from tiny_models import DSV3_TINY_CONFIG, DSV3_YARN, hf_mtp_block_reference, make_tiny_checkpoint

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


# ------------------------------------------------------------------------------------- target + MTP, tp 1 and 2
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_model_tp import make_check_inputs
    g = torch.Generator().manual_seed(4321)
    out, hfs = {}, {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        path = str(tmp_path_factory.mktemp(name))
        hf, cfg = make_tiny_checkpoint(path, seed=60 + i, family="deepseek_v3", **overrides)
        prompts, ref, mtp_inputs = make_check_inputs(hf, cfg, g, PROMPT_LENS)
        out[name] = (path, prompts, ref, mtp_inputs)
        hfs[name] = hf
    runs = {1: [_rank_all(out)], **{tp: launch(_rank_all, tp, out, timeout_s=600) for tp in (2, 4)}}
    return out, runs, hfs


def _target_checks(model, prompts):
    from test_model_tp import paged_target_checks
    res, _ = paged_target_checks(model, prompts, collect_attention_layers)
    attn = model.model.layers[0].self_attn
    res["kv_b_rows"] = attn.kv_b_proj.weight.shape[0]
    res["latent_replicated"] = tuple(attn.kv_a_proj_with_mqa.weight.shape)
    res["local_heads"] = attn.num_local_heads
    return res


def _rank_all(setup_data):
    from test_model_tp import rank_all_checks
    return rank_all_checks(setup_data, _target_checks, lambda target, mtp: {
        "tied": [mtp.get_layer(s).shared_head.head is target.lm_head for s in range(mtp.num_mtp_layers)],
        "types": (type(target).__name__, type(mtp).__name__)})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_target_matches_transformers(setup, variant, tp):
    from test_model_tp import assert_target_matches
    data, runs, _ = setup
    ref = data[variant][2]
    for r in runs[tp]:
        t = r[variant]["target"]
        assert r[variant]["types"] == ("DeepseekV3ForCausalLM", "DeepseekV3MTP")
        assert t["top_equal"] and t["pad_finite"]
        assert_target_matches(t, ref, ATOL, RTOL, f"tp={tp} rank={r['rank']}")
        # heads split (kv_b_proj rows: heads/tp * (nope 12 + v 10)), latent projection replicated
        assert t["local_heads"] == 4 // tp and t["kv_b_rows"] == (4 // tp) * 22
        assert t["latent_replicated"] == (16 + 8, 64)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_tp_equals_tp1_and_arms_agree(setup, variant, tp):
    from test_model_tp import _mtp_batches, assert_mtp_arm_matches_tp1
    _, runs, _ = setup
    base = runs[1][0][variant]["mtp"]
    tied = [not VARIANTS[variant].get("mtp_head", True)] * VARIANTS[variant]["num_mtp_layers"]
    assert runs[1][0][variant]["tied"] == tied
    for (bname, step, arm), (out, _, top_ok, stats) in base.items():  # tp 1: no communication, arms identical
        assert top_ok and stats == {} and torch.equal(out, base[(bname, step, "fused")][0])
    for r in runs[tp]:
        assert r[variant]["tied"] == tied
        m = r[variant]["mtp"]
        for bname, _ in _mtp_batches(tp):
            for step in (0, 1):
                for arm in ("fused", "baseline", "sp"):
                    where = f"tp={tp} rank={r['rank']} {bname} step={step} {arm}"
                    assert_mtp_arm_matches_tp1(m[(bname, step, arm)], base[(bname, step, "fused")], arm, where,
                                               MTP_ATOL, MTP_RTOL)


def _hf_mtp_reference(hf, path, cfg, k, ids, pos, prev):
    """MTP layer ``k`` in float64 from transformers' own DeepseekV3DecoderLayer + the MTP weights
    (:func:`tiny_models.hf_mtp_block_reference`)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding
    return hf_mtp_block_reference(hf, path, cfg, k, ids, pos, prev, DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding)


@pytest.mark.parametrize("variant", ["qlora_yarn_interleave", "qproj_default_neox"])
def test_mtp_matches_independent_transformers_reference(setup, variant):
    data, _, hfs = setup
    path = data[variant][0]
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    cfg = target.config
    g = torch.Generator().manual_seed(7)
    ids, pos = torch.randint(0, cfg.vocab_size, (9,), generator=g), torch.arange(9)
    prev = torch.randn(9, cfg.hidden_size, generator=g)
    for step in range(2):
        k = step % cfg.num_nextn_predict_layers
        with torch.no_grad():
            got = mtp(ids, pos, prev, spec_step_idx=step)
        want = _hf_mtp_reference(hfs[variant], path, cfg, k, ids, pos, prev)
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
        assert torch.equal(mtp.get_top_tokens(got, step), mtp.compute_logits(got, step).argmax(-1))


# ------------------------------------------------------------------------------------------------- engine
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from test_engine_fixtures import make_model, mixed_prompts
    path = str(tmp_path_factory.mktemp("dsv3_engine"))
    hf, cfg = make_model(path, seed=11, num_mtp_layers=2, family="deepseek_v3", rope_parameters=DSV3_YARN)
    prompts = mixed_prompts(6, cfg.vocab_size, seed=2)
    return path, hf, cfg, prompts


def _llm(path, **kw):
    from mtpspec import LLM
    kw.setdefault("max_num_seqs", 4)
    return LLM(path, max_model_len=64, block_size=4, num_kv_blocks=128, seed=0, **kw)


def _generate(llm, prompts):
    from mtpspec import SamplingParams
    from test_engine_fixtures import token_prompts
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_greedy(engine_model):
    path, _, _, prompts = engine_model
    with _llm(path) as llm:
        return _generate(llm, prompts)


def test_plain_greedy_matches_transformers_generate(engine_model, plain_greedy):
    _, hf, _, prompts = engine_model
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, r in zip(prompts, plain_greedy):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out[0, len(p):].tolist() == r and len(r) == MAX_TOKENS


@pytest.mark.parametrize("k,local_argmax,fused", [(1, True, True), (3, False, False), (3, True, True)])
def test_mtp_spec_decoding_equals_plain_greedy(engine_model, plain_greedy, k, local_argmax, fused):
    path, _, _, prompts = engine_model
    with _llm(path, speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax},
              fuse_allreduce_rmsnorm=fused) as llm:
        assert _generate(llm, prompts) == plain_greedy
        m = llm.get_metrics()
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"]


def test_spec_decoding_with_oracle_drafts_covers_every_accepted_length(engine_model, plain_greedy):
    """Drafts from the true continuation, 30% corrupted, so verification accepts 0 .. k drafts."""
    from test_engine_fixtures import OracleDrafts
    path, _, cfg, prompts = engine_model
    from mtpspec import SamplingParams
    from test_engine_fixtures import token_prompts
    with _llm(path) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 6, ignore_eos=True)
        long = llm.generate(token_prompts(prompts), sp, use_tqdm=False)
    oracle = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, long)}
    with _llm(path, speculative_config={"num_speculative_tokens": 3}) as llm:
        llm.llm_engine.draft_hook = OracleDrafts(oracle, cfg.vocab_size, corrupt=0.3)
        assert _generate(llm, prompts) == plain_greedy
        hist = llm.get_metrics()["accepted_length_histogram"]
        assert sum(1 for h in hist if h) >= 3, hist


@pytest.mark.parametrize("k,local_argmax", [(1, False), (3, True)])
def test_graph_code_path_with_padding_equals_plain_greedy(engine_model, plain_greedy, k, local_argmax):
    """The CUDA-graph path's static padded buffers (``graph_mode="static"``: no capture on CPU):
    batches padded to 1, 2, 4, 8 sequences; padding rows (seq_len 0, slot -1) reach neither the
    latent cache nor emission."""
    path, _, _, prompts = engine_model
    with _llm(path, max_num_seqs=8, graph_mode="static",
              speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax}) as llm:
        for n in (3, 6, 1):
            assert _generate(llm, prompts[:n]) == plain_greedy[:n]
        assert llm.get_metrics()["num_eager_fallbacks"] == 0
        assert llm.executor.runner.fwd.num_graph_steps > 10
        assert llm.executor.runner.fwd.num_prefill_graph_steps >= 1  # n = 1: the one-sequence prefill units


@pytest.mark.parametrize("fused,seq_parallel,local_argmax", [(True, False, True), (False, False, False),
                                                              (True, True, True)])
def test_mtp_spec_decoding_tp2_equals_plain_greedy(engine_model, plain_greedy, fused, seq_parallel, local_argmax):
    path, _, _, prompts = engine_model
    with _llm(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3,
                                                                 "use_local_argmax_reduction": local_argmax},
              fuse_allreduce_rmsnorm=fused, sequence_parallel=seq_parallel, device="cpu") as llm:
        assert _generate(llm, prompts) == plain_greedy


# ------------------------------------------------------------------------------------------------- loader
@pytest.fixture(scope="module")
def loader_base(tmp_path_factory):
    from mtpspec.models.loader import read_checkpoint_tensors
    path = str(tmp_path_factory.mktemp("dsv3_loader"))
    _, cfg = make_tiny_checkpoint(path, seed=3, num_mtp_layers=1, family="deepseek_v3")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    return dict(read_checkpoint_tensors(path)), raw


def _write_variant(tmp_path, base, edit):
    from mtpspec.models.loader import save_checkpoint
    tensors, raw = dict(base[0]), dict(base[1])
    edit(tensors)
    save_checkpoint(str(tmp_path), tensors, raw)
    return str(tmp_path)


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.kv_b_proj.weight",
                                 "model.layers.3.self_attn.q_a_layernorm.weight",
                                 "model.layers.2.mlp.experts.5.up_proj.weight"])
def test_missing_tensor_is_named(tmp_path, loader_base, key, monkeypatch):
    from mtpspec.models import MissingKeyError
    from mtpspec.models import deepseek_v3
    path = _write_variant(tmp_path, loader_base, lambda t: t.pop(key))
    built = []
    monkeypatch.setattr(deepseek_v3.DeepseekV3Attention, "__init__",
                        lambda self, *a, **k: built.append(1) or (_ for _ in ()).throw(AssertionError("built")))
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.")) as info:
        load_models(path, dtype=torch.float32, device="cpu")
    assert info.value.key == key and not built  # checked before any module is built


def test_wrong_shape_names_expected_and_actual(tmp_path, loader_base):
    from mtpspec.models import ShapeMismatchError
    key = "model.layers.0.self_attn.kv_b_proj.weight"  # [4 * (12 + 10), 16]
    path = _write_variant(tmp_path, loader_base, lambda t: t.__setitem__(key, t[key].T.contiguous()))
    with pytest.raises(ShapeMismatchError, match=r"kv_b_proj\.weight'.*expected shape \[88, 16\], got \[16, 88\]") as e:
        load_models(path, dtype=torch.float32, device="cpu")
    assert (e.value.expected, e.value.actual) == ((88, 16), (16, 88))


@pytest.mark.parametrize("declared", [1, 2])
def test_declared_mtp_layer_absent_is_named_as_a_layer(tmp_path, loader_base, declared):
    """A plain ``save_pretrained`` checkpoint keeps ``DeepseekV3Config``'s default
    ``num_nextn_predict_layers=1`` but holds no MTP tensors: the error names the MTP layer, its
    prefix and the way out (no speculation), not one expert tensor of it; the target still loads."""
    from mtpspec.models import MissingKeyError, load_target_model
    from mtpspec.models.loader import save_checkpoint
    tensors, raw = dict(loader_base[0]), dict(loader_base[1], num_nextn_predict_layers=declared)
    if declared == 1:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}
    save_checkpoint(str(tmp_path), tensors, raw)
    missing = 3 + declared - 1
    way_out = r"-k 0, speculative_config=None" if declared == 1 else r"it holds 1: set num_nextn_predict_layers=1"
    with pytest.raises(MissingKeyError, match=rf"MTP layer {declared - 1}: nothing under 'model\.layers\.{missing}\.'"
                                              rf".*{way_out}") as e:
        load_models(str(tmp_path), dtype=torch.float32, device="cpu")
    assert e.value.key == f"model.layers.{missing}.enorm.weight"
    assert load_target_model(str(tmp_path), device="cpu") is not None


def test_export_round_trips_the_checkpoint(tmp_path, loader_base):
    """tp-1 models export exactly the tensors they were loaded from (per-expert layout), and a
    checkpoint in the fused expert layout loads to the same models."""
    from mtpspec.models import export_hf_state_dict
    tensors = loader_base[0]
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    path = _write_variant(tmp_path / "a", loader_base, lambda t: None)
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    out = export_hf_state_dict(target, mtp)
    assert set(out) == set(tensors)
    for key, t in tensors.items():
        assert torch.equal(out[key], t), key

    def fuse(t):
        for layer in range(1, 4):  # MoE layers 1, 2 and the MTP block 3
            pre = f"model.layers.{layer}.mlp.experts."
            gate_up = [torch.cat([t.pop(f"{pre}{e}.gate_proj.weight"), t.pop(f"{pre}{e}.up_proj.weight")])
                       for e in range(8)]
            t[f"{pre}gate_up_proj"] = torch.stack(gate_up)
            t[f"{pre}down_proj"] = torch.stack([t.pop(f"{pre}{e}.down_proj.weight") for e in range(8)])

    fused_path = _write_variant(tmp_path / "b", loader_base, fuse)
    target2, mtp2 = load_models(fused_path, dtype=torch.float32, device="cpu")
    assert export_hf_state_dict(target2, mtp2).keys() == out.keys()
    for key, t in export_hf_state_dict(target2, mtp2).items():
        assert torch.equal(t, out[key]), key


def test_paged_decode_through_the_triton_kernels_matches_transformers(setup, interp, monkeypatch):
    """The cached path (chunked prefill, then one token per step) with every Triton kernel on
    (the interpreter on CPU): the MLA decode / verify kernel, the latent KV write, norms, MoE."""
    from mtpspec.attention.backends import mla
    calls = []
    kernel = mla.mla_attention
    monkeypatch.setattr(mla, "mla_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    data, _, _ = setup
    path, prompts, ref, _ = data["qlora_yarn_interleave"]
    target, _ = load_models(path, dtype=torch.float32, device="cpu", load_mtp=False)
    got = _target_checks(target, prompts[1:3])["cached"]
    torch.testing.assert_close(torch.cat(got), torch.cat(ref[1:3]), atol=ATOL, rtol=RTOL)
    assert len(calls) >= 3 * 3  # 3 layers x (prefill chunk + 3 decode steps), at least


def test_default_block_size_is_the_architectures(engine_model, tmp_path) -> None:
    # MLA models default to 64-token cache blocks (whole bulk-copy key tiles), GLM-4.5 to 16; a
    # given --block-size wins.
    from mtpspec.engine.arg_utils import EngineArgs
    from test_engine_fixtures import make_model
    path = engine_model[0]
    assert EngineArgs(model=path).create_engine_config().cache_config.block_size == 64
    assert EngineArgs(model=path, block_size=16).create_engine_config().cache_config.block_size == 16
    make_model(str(tmp_path), seed=3)
    assert EngineArgs(model=str(tmp_path)).create_engine_config().cache_config.block_size == 16


def test_yarn_without_factor_is_an_error_as_in_transformers():
    """transformers refuses ``rope_type: yarn`` without ``factor``; reading it as plain rope (factor 1)
    would change long-context attention silently."""
    for key in ("rope_parameters", "rope_scaling"):
        params = {k: v for k, v in DSV3_YARN.items() if k != "factor"}
        with pytest.raises(ModelConfigError, match="rope_type 'yarn' needs a numeric 'factor'"):
            ModelConfig.from_dict(_raw(**{key: params}))
    with pytest.raises(ModelConfigError, match="numeric 'factor'.*'4'"):
        ModelConfig.from_dict(_raw(rope_parameters=dict(DSV3_YARN, factor="4")))
