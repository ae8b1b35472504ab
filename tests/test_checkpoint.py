"""Checkpoint loader and writer: every bad-checkpoint case raises its named error before any model is
returned; dtype conversion; sharded and single-file layouts; both expert layouts; writer round trip
(our export equals the original tensors bit for bit, and transformers loads what we write)."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import mtpspec.models.glm4_moe as glm4_moe
from mtpspec.models import (
    CorruptCheckpointError, MissingKeyError, ShapeMismatchError, UnexpectedKeyError, UnsupportedDtypeError,
    export_hf_state_dict, load_models, load_target_model, save_checkpoint)
from mtpspec.models.loader import CheckpointReader, read_checkpoint_tensors
from mtpspec.config import ModelConfigError
from tiny_models import make_tiny_checkpoint


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base"))
    hf, cfg = make_tiny_checkpoint(path, seed=31, num_mtp_layers=1)
    raw = json.load(open(os.path.join(path, "config.json")))
    return path, dict(read_checkpoint_tensors(path)), raw, hf


def _variant(tmp_path, base, edit=None, **save_kw):
    _, tensors, raw, _ = base
    tensors = dict(tensors)
    if edit is not None:
        edit(tensors)
    save_checkpoint(str(tmp_path), tensors, raw, **save_kw)
    return str(tmp_path)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _CountBuilds:
    def __init__(self, monkeypatch):
        self.n = 0
        orig = glm4_moe.Glm4MoeForCausalLM.__init__

        def counting(inner_self, *a, **kw):
            self.n += 1
            orig(inner_self, *a, **kw)
        monkeypatch.setattr(glm4_moe.Glm4MoeForCausalLM, "__init__", counting)


# ------------------------------------------------------------------------------------------ errors
def test_missing_key_named_and_nothing_built(tmp_path, base, monkeypatch):
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    path = _variant(tmp_path, base, lambda t: t.pop(key))
    builds = _CountBuilds(monkeypatch)
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.")) as info:
        load_models(path, device="cpu")
    assert info.value.key == key and builds.n == 0


def test_missing_mtp_key_only_matters_for_mtp(tmp_path, base):
    key = "model.layers.3.eh_proj.weight"
    path = _variant(tmp_path, base, lambda t: t.pop(key))
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.")):
        load_models(path, device="cpu")
    assert load_target_model(path, device="cpu") is not None


@pytest.mark.parametrize("key", ["model.layers.2.mlp.experts.8.up_proj.weight", "model.layers.4.enorm.weight",
                                 "model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.bias"])
def test_unexpected_key_named(tmp_path, base, key):
    path = _variant(tmp_path, base, lambda t: t.__setitem__(key, torch.zeros(3)))
    with pytest.raises(UnexpectedKeyError, match=key.replace(".", r"\.")):
        load_models(path, device="cpu")
    with pytest.raises(UnexpectedKeyError, match=key.replace(".", r"\.")):
        load_target_model(path, device="cpu")


def test_shape_mismatch_names_expected_and_actual(tmp_path, base):
    key = "model.layers.1.self_attn.o_proj.weight"  # [64, 128]
    path = _variant(tmp_path, base, lambda t: t.__setitem__(key, t[key].T.contiguous()))
    with pytest.raises(ShapeMismatchError, match=r"o_proj\.weight'.*expected shape \[64, 128\], got \[128, 64\]") as e:
        load_models(path, device="cpu")
    assert (e.value.expected, e.value.actual) == ((64, 128), (128, 64))


@pytest.mark.parametrize("bad", [torch.int32, torch.float64])
def test_unsupported_tensor_dtype(tmp_path, base, bad):
    _, tensors, raw, _ = base
    tensors = dict(tensors)
    key = "model.norm.weight"
    tensors[key] = tensors[key].to(bad)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedDtypeError, match=r"model\.norm\.weight.*unsupported dtype"):
        load_models(str(tmp_path), device="cpu")
    with pytest.raises(UnsupportedDtypeError, match="tensor 'model.norm.weight' has unsupported dtype"):
        save_checkpoint(str(tmp_path / "w"), {key: tensors[key]})


def test_fp8_tensors_without_quantization_config_are_named(tmp_path, base):
    """FP8 tensors (DeepSeek-V3's: float8_e4m3fn weights + ``weight_scale_inv`` block scales) in a
    checkpoint whose config.json has no FP8 ``quantization_config`` are refused by name, whichever
    of the two is met first (FP8 checkpoints themselves: tests/test_fp8_weights.py)."""
    _, tensors, raw, _ = base
    key = "model.layers.1.self_attn.o_proj.weight"
    for with_scale in (True, False):
        t = dict(tensors)
        t[key] = t[key].to(torch.float8_e4m3fn)
        if with_scale:
            t[key + "_scale_inv"] = torch.ones(1, 1)
        d = tmp_path / str(with_scale)
        d.mkdir()
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(raw))
        err = UnexpectedKeyError if with_scale else UnsupportedDtypeError
        name = key + "_scale_inv" if with_scale else key
        hint = r"quantized checkpoints other than FP8 block-scaled" if with_scale else \
            r"an FP8 tensor, but config.json has no quantization_config"
        with pytest.raises(err, match=name.replace(".", r"\.") + r".*" + hint):
            load_models(str(d), device="cpu")
    with pytest.raises(ModelConfigError, match="quant_method 'awq'"):
        (tmp_path / "config.json").write_text(json.dumps(dict(raw, quantization_config={"quant_method": "awq"})))
        load_models(str(tmp_path), device="cpu")


def test_unsupported_load_dtype(base):
    for bad in (torch.float64, "int8"):
        with pytest.raises(UnsupportedDtypeError, match="unsupported load dtype"):
            load_models(base[0], dtype=bad, device="cpu")


def test_truncated_and_corrupt_files(tmp_path, base):
    path = _variant(tmp_path / "t", base)
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:-1000])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_models(path, device="cpu")
    open(f, "wb").write(b"\x20\x00\x00\x00\x00\x00\x00\x00{definitely not a header}" + data[100:200])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_models(path, device="cpu")


def test_sharded_index_errors(tmp_path, base):
    path = _variant(tmp_path, base, max_shard_bytes=40_000)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    key = "model.layers.1.self_attn.q_proj.weight"
    wrong = next(n for n in files if n != index["weight_map"][key])
    bad = json.loads(json.dumps(index))
    bad["weight_map"][key] = wrong
    json.dump(bad, open(index_path, "w"))
    with pytest.raises(CorruptCheckpointError, match=f"maps '{key}' to {wrong}, which does not hold it"):
        load_models(path, device="cpu")
    json.dump(index, open(index_path, "w"))
    os.remove(os.path.join(path, files[1]))
    with pytest.raises(CorruptCheckpointError, match=f"{files[1]}.*does not exist"):
        load_models(path, device="cpu")
    open(index_path, "w").write("{oops")
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors index"):
        load_models(path, device="cpu")


def test_non_finite_tensor_fails_after_partial_load_and_returns_nothing(tmp_path, base):
    """The last layer's expert weight holds a NaN: loading fails midway; the caller never gets a
    model, and a model already in use (loaded earlier) is untouched."""
    good = load_target_model(base[0], device="cpu")
    before = _params(good)
    key = "model.layers.2.mlp.experts.7.down_proj.weight"

    def poison(t):
        t[key] = t[key].clone()
        t[key][3, 4] = float("nan")
    path = _variant(tmp_path, base, poison)
    result = None
    with pytest.raises(CorruptCheckpointError, match=f"{key}.*NaN"):
        result = load_models(path, device="cpu")
    assert result is None
    after = _params(good)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_both_expert_layouts_at_once_is_rejected(tmp_path, base):
    def add_fused(t):
        t["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 64)
        t["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)
    path = _variant(tmp_path, base, add_fused)
    with pytest.raises(UnexpectedKeyError, match="stored both per expert and fused"):
        load_models(path, device="cpu")


# ------------------------------------------------------------------------------------------ layouts
def test_sharded_fused_experts_and_dtypes_load_the_same(tmp_path, base):
    path0, tensors, raw, _ = base
    t_ref, m_ref = load_models(path0, dtype=torch.float32, device="cpu")
    ref = {**_params(t_ref), **{f"mtp.{k}": v for k, v in _params(m_ref).items()}}

    sharded = _variant(tmp_path / "sharded", base, max_shard_bytes=30_000)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))

    def fuse(t):  # transformers' in-memory layout: [E, 2I, H] gate rows first, [E, H, I]
        for layer in (1, 2, 3):
            p = f"model.layers.{layer}.mlp.experts"
            gate = [t.pop(f"{p}.{e}.gate_proj.weight") for e in range(8)]
            up = [t.pop(f"{p}.{e}.up_proj.weight") for e in range(8)]
            down = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
            t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            t[f"{p}.down_proj"] = torch.stack(down)
    fused = _variant(tmp_path / "fused", base, fuse)
    for path in (sharded, fused):
        t, m = load_models(path, dtype=torch.float32, device="cpu")
        got = {**_params(t), **{f"mtp.{k}": v for k, v in _params(m).items()}}
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), path

    # dtype conversion: a bf16 checkpoint loads bit-exactly as bf16, exactly widened as fp32;
    # an fp32 checkpoint loads as fp16 by rounding; the router stays fp32.
    bf16 = _variant(tmp_path / "bf16", base, dtype=torch.bfloat16)
    assert json.load(open(os.path.join(bf16, "config.json")))["dtype"] == raw["dtype"]
    with CheckpointReader(bf16) as rd:
        assert {rd.dtype_name(k) for k in rd.keys()} == {"BF16"}
    tb, _ = load_models(bf16, dtype=torch.bfloat16, device="cpu")
    tf, _ = load_models(bf16, dtype=torch.float32, device="cpu")
    th, _ = load_models(path0, dtype="float16", device="cpu")
    qkv_b = tb.model.layers[0].self_attn.qkv_proj.weight
    q_key = "model.layers.0.self_attn.q_proj.weight"
    assert qkv_b.dtype == torch.bfloat16 and torch.equal(qkv_b[:128], tensors[q_key].to(torch.bfloat16))
    assert torch.equal(tf.model.layers[0].self_attn.qkv_proj.weight[:128], tensors[q_key].to(torch.bfloat16).float())
    assert torch.equal(th.model.layers[0].self_attn.qkv_proj.weight[:128], tensors[q_key].half())
    for model in (tb, th):
        assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
        assert model.model.layers[1].mlp.experts.w13_weight.dtype != torch.float32
    ids = torch.arange(5) * 7
    with torch.no_grad():
        lf = t_ref.compute_logits(t_ref(ids, torch.arange(5)))
        lb = tb.compute_logits(tb(ids, torch.arange(5))).float()
    assert lb.dtype == torch.float32 and (lb - lf).abs().max() < 0.1 * lf.abs().max()


def test_export_round_trip_and_transformers_reads_our_writer(tmp_path, base):
    path0, tensors, raw, hf = base
    target, mtp = load_models(path0, dtype=torch.float32, device="cpu")
    exported = export_hf_state_dict(target, mtp)
    assert exported.keys() == tensors.keys()
    assert all(torch.equal(exported[k], tensors[k]) for k in tensors)
    # Writing twice into the same folder: the second (single-file) write removes the old shards.
    out = str(tmp_path / "rewritten")
    save_checkpoint(out, exported, raw, max_shard_bytes=20_000)
    names = save_checkpoint(out, exported, raw)
    assert names == ["model.safetensors", "config.json"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from transformers import Glm4MoeForCausalLM
    reread = Glm4MoeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(reread(ids).logits, hf(ids).logits)
    # Exporting a model with a tied MTP head leaves the head out.
    nohead = str(tmp_path / "nohead")
    save_checkpoint(nohead, {k: v for k, v in tensors.items() if "shared_head.head" not in k}, raw)
    t2, m2 = load_models(nohead, device="cpu")
    assert "model.layers.3.shared_head.head.weight" not in export_hf_state_dict(t2, m2)


def test_export_round_trip_bias_qk_norm_and_mixed_mtp_head_ties(tmp_path):
    """Export slices q/k/v weights and biases by their spec rows; a tied head (layer N) is left out
    while layer N + 1's own head is written."""
    path = str(tmp_path / "src")
    make_tiny_checkpoint(path, seed=5, num_mtp_layers=2, attention_bias=True, use_qk_norm=True)
    raw = json.load(open(os.path.join(path, "config.json")))
    tensors = {k: v for k, v in read_checkpoint_tensors(path) if k != "model.layers.3.shared_head.head.weight"}
    mixed = str(tmp_path / "mixed")
    save_checkpoint(mixed, tensors, raw)
    target, mtp = load_models(mixed, dtype=torch.float32, device="cpu")
    assert mtp.tie_heads == [True, False]
    exported = export_hf_state_dict(target, mtp)
    assert exported.keys() == tensors.keys()
    assert "model.layers.1.self_attn.k_proj.bias" in exported and "model.layers.4.shared_head.head.weight" in exported
    assert all(torch.equal(exported[k], tensors[k]) for k in tensors)


def test_mtp_layers_beyond_the_config_and_a_tied_head_present_are_named(tmp_path, base, caplog):
    """A new-user pass (2026-12-05): MTP tensors with ``num_nextn_predict_layers: 0`` were "unexpected"
    with no hint of the field; with ``tie_word_embeddings`` the checkpoint's own ``lm_head`` was dropped
    without a word (vLLM drops it too; now a warning names it)."""
    _, tensors, raw, _ = base
    save_checkpoint(str(tmp_path / "a"), dict(tensors), {**raw, "num_nextn_predict_layers": 0})
    with pytest.raises(UnexpectedKeyError, match=r"model\.layers\.3\..*counted by num_nextn_predict_layers"):
        load_target_model(str(tmp_path / "a"), device="cpu")
    assert "lm_head.weight" in tensors and not raw.get("tie_word_embeddings")
    save_checkpoint(str(tmp_path / "b"), dict(tensors), {**raw, "tie_word_embeddings": True})
    with caplog.at_level("WARNING", logger="mtpspec.models.loader"):
        model = load_target_model(str(tmp_path / "b"), device="cpu")
    assert model is not None and "'lm_head.weight', which differs from model.embed_tokens.weight" in caplog.text
    caplog.clear()  # an identical copy (a review: checkpoints converted from .bin store one) is not worth a word
    same = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    save_checkpoint(str(tmp_path / "c"), same, {**raw, "tie_word_embeddings": True})
    with caplog.at_level("WARNING", logger="mtpspec.models.loader"):
        assert load_target_model(str(tmp_path / "c"), device="cpu") is not None
    assert "lm_head" not in caplog.text
