"""``--load-format dummy`` (vLLM's): random weights from ``config.json`` alone, for benchmarks of
shapes that have no checkpoint. The folder needs no safetensors; every parameter is U(-1e-3, 1e-3),
deterministic, the MTP model's tied embedding / head are the target's; the engine runs on it
(tp 1 and 2); an unknown format is refused by name."""

import json
import os
import shutil

import pytest
import torch

from mtpspec.config import ModelConfig
from mtpspec.engine.arg_utils import EngineArgs
from mtpspec.models.loader import load_models
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["glm4_moe", "glm_moe_dsa"])
def config_only(request, tmp_path_factory):
    """A folder holding only a tiny model's config.json (the checkpoint it came from is deleted)."""
    full = str(tmp_path_factory.mktemp(f"full_{request.param}"))
    make_tiny_checkpoint(full, family=request.param)
    out = str(tmp_path_factory.mktemp(f"cfg_{request.param}"))
    shutil.copy(os.path.join(full, "config.json"), out)
    return out


def test_dummy_weights_are_small_uniform_deterministic_and_tied(config_only):
    target, mtp = load_models(config_only, dtype="float32", device="cpu", load_format="dummy")
    again, _ = load_models(config_only, dtype="float32", device="cpu", load_format="dummy")
    for (name, p), (_, q) in zip(target.named_parameters(), again.named_parameters()):
        assert p.abs().max() <= 1e-3 and p.abs().max() > 0, name
        assert torch.equal(p, q), name
    # not one value everywhere: each parameter has its own stream
    firsts = {float(p.flatten()[0]) for p in target.parameters()}
    assert len(firsts) > 3
    assert mtp is not None
    tp = {id(p) for p in target.parameters()}
    shared = [n for n, p in mtp.named_parameters() if id(p) in tp]
    assert shared, "the MTP model shares the target's embedding / head"
    # the shared parameters kept the target's values (not re-drawn under the MTP model's names)
    emb = target.get_input_embeddings().weight
    assert torch.equal(emb, again.get_input_embeddings().weight)


def test_auto_needs_the_checkpoint_and_unknown_formats_are_refused(config_only):
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        load_models(config_only, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_models(config_only, dtype="float32", device="cpu", load_format="pt")
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs(model=config_only, load_format="gguf").create_engine_config()
    import argparse
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args(["--load-format", "dummy"])).load_format == "dummy"
    with pytest.raises(SystemExit):
        p.parse_args(["--load-format", "npz"])


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_generates_on_dummy_weights(config_only, tp):
    from mtpspec import LLM, SamplingParams
    if tp == 2 and ModelConfig.from_pretrained(config_only).num_attention_heads % 2:
        pytest.skip("heads not divisible by 2")
    llm = LLM(config_only, tensor_parallel_size=tp, dtype="float32", device="cpu", load_format="dummy",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9, 10]}] * 2,
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with open(os.path.join(config_only, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert all(0 <= t < vocab for t in outs[0].outputs[0].token_ids)


def test_make_dummy_model_layer_override(tmp_path):
    """benchmarks/make_dummy_model.py: a preset's config, its depth overridable (every layer and the
    MTP layer dense), valid for ModelConfig; a non-positive depth is refused."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(repo, "benchmarks", "make_dummy_model.py")
    env = {**os.environ, "PYTHONPATH": repo}
    out = tmp_path / "m"
    p = subprocess.run([sys.executable, script, str(out), "--preset", "cpu-smoke", "--num-hidden-layers", "3"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 3 and raw["first_k_dense_replace"] == 4 and raw["hidden_size"] == 256
    assert ModelConfig.from_dict(raw).num_hidden_layers == 3 and (out / "tokenizer.json").exists()
    p = subprocess.run([sys.executable, script, str(tmp_path / "bad"), "--num-hidden-layers", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "--num-hidden-layers must be >= 1" in p.stderr


def test_sharing_weights_holds_equal_parameters_once(config_only):
    """``loader.sharing_weights`` (``bench arms --in-process``): later loads of the same model reuse the
    first loads' parameter tensors (a plain target first, then target + MTP: the MTP layer's are
    recorded then), a different dtype or a parameter whose values differ is not shared, nothing is
    shared outside the context; engines built under it generate what an unshared engine does."""
    from mtpspec import LLM, SamplingParams
    from mtpspec.models.loader import sharing_weights
    kw = dict(device="cpu", load_format="dummy")
    reg = {}
    with sharing_weights(reg):
        t0, _ = load_models(config_only, dtype="float32", load_mtp=False, **kw)
        t1, m1 = load_models(config_only, dtype="float32", **kw)
        t2, m2 = load_models(config_only, dtype="float32", **kw)
        h, _ = load_models(config_only, dtype="bfloat16", load_mtp=False, **kw)
    first = {id(p) for p in t0.parameters()}
    assert all(id(p) in first for p in list(t1.parameters()) + list(t2.parameters()))
    mtp_own = {id(p) for p in m1.parameters()} - first
    assert mtp_own and all(id(p) in first | mtp_own for p in m2.parameters())
    assert not any(id(p) in first for p in h.parameters())  # another dtype: its own tensors
    assert not any(id(p) in first for p in load_models(config_only, dtype="float32", load_mtp=False, **kw)[0]
                   .parameters())  # outside the context
    name, p0 = next(iter(t0.named_parameters()))
    with torch.no_grad():
        p0.add_(1.0)  # the recorded tensor no longer equals a fresh load's: that one is not shared
    with sharing_weights(reg):
        t3, _ = load_models(config_only, dtype="float32", load_mtp=False, **kw)
    got = dict(t3.named_parameters())
    assert got[name] is not p0 and torch.equal(got[name] + 1.0, p0)
    assert sum(id(p) in first for p in t3.parameters()) == len(first) - 1

    prompts = [{"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 5, 2]}]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    params = []

    def tokens(**extra):
        llm = LLM(config_only, dtype="float32", max_num_seqs=4, **kw, **extra)
        try:
            params.append(list(llm.llm_engine.executor.runner.target.parameters()))  # kept alive: ids stay unique
            return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.shutdown()

    alone = tokens(speculative_config=spec)
    with sharing_weights({}):
        assert tokens() == alone == tokens(speculative_config=spec)
    ids = [{id(p) for p in ps} for ps in params]
    assert ids[1] == ids[2] and not ids[0] & ids[1]  # the engines' own models shared theirs
