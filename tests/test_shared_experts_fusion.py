"""Shared experts fused into the routed experts (``FusedMoE.absorb_shared_experts``, the engine's
default; ``--disable-shared-experts-fusion`` turns it off).

The fused MoE must equal the unfused one (shared MLP + routed experts, added) on every path:
torch (dense, gather, grouped) and the Triton kernels (the GPU, else the interpreter), with 1 and 2
shared experts, expert groups, at tp 1 and over 2 gloo ranks; the router emits the shared ids
``E ..`` with weight 1.0 after the routed ones; models loaded with ``fuse_shared_experts`` give the
unfused logits (target and MTP), at tp 2 those of tp 1 unfused; a fused model refuses export; the
engine fuses by default (target and MTP layers) and keeps the MLP when told not to, with the same
greedy tokens either way.
"""

import os

import pytest
import torch

from mtpspec.config import ModelConfig
from mtpspec.distributed import launch
from mtpspec.layers.fused_moe import grouped_topk
from mtpspec.models import load_models
from mtpspec.models.glm4_moe import Glm4MoeMoE
from mtpspec.models.loader import initialize_dummy_weights
from tiny_models import make_tiny_checkpoint


def _moe_config(n_shared, n_group):
    return ModelConfig.from_dict(dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=n_shared, n_group=n_group,
        topk_group=min(2, n_group), routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=64))


def _fused_equals_unfused(n_shared, n_group, kernels, dev="cpu"):
    torch.manual_seed(0)
    cfg = _moe_config(n_shared, n_group)
    with torch.device(dev):
        moe = Glm4MoeMoE(cfg, reduce_results=True, params_dtype=torch.float32)
    initialize_dummy_weights(moe, low=-0.2, high=0.2)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    xs = {t: torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).to(dev) for t in (1, 3, 40)}
    with torch.no_grad():
        ref = {t: moe(x) for t, x in xs.items()}
        ref_gate = moe.gate(xs[3])
        assert moe.fuse_shared_experts()
        assert moe.shared_experts is None and moe.experts.w13_weight.shape[0] == 8 + n_shared
        assert not moe.fuse_shared_experts()  # nothing left to fuse
        w, ids = moe.gate(xs[3])
        assert ids.shape == (3, 3 + n_shared)
        assert torch.equal(ids[:, 3:].cpu(), torch.arange(8, 8 + n_shared).expand(3, n_shared))
        assert torch.equal(w[:, 3:].cpu(), torch.ones(3, n_shared))
        assert torch.equal(ids[:, :3].sort(1)[0], ref_gate[1].sort(1)[0])
        out = {}
        for t, x in xs.items():
            out[t] = {}
            paths = ["kernel"] if kernels else ["gather", "dense", "grouped"]
            for path in paths:
                moe.experts.select_path = lambda *a, p=path: p
                out[t][path] = moe(x)
    return ref, out


@pytest.mark.parametrize("n_shared,n_group", [(1, 1), (2, 4)])
def test_fused_moe_equals_shared_mlp_plus_routed(n_shared, n_group):
    ref, out = _fused_equals_unfused(n_shared, n_group, False)
    for t in ref:
        for path, o in out[t].items():
            torch.testing.assert_close(o, ref[t], rtol=1e-5, atol=1e-6, msg=lambda m: f"T={t} {path}: {m}")


@pytest.mark.parametrize("n_shared,n_group", [(1, 1), (2, 4)])
def test_fused_moe_kernels_equal_unfused(kdev, n_shared, n_group):
    """The Triton router, GEMMs and pair sum (a GPU, else the interpreter)."""
    ref, out = _fused_equals_unfused(n_shared, n_group, True, kdev)
    for t in ref:
        torch.testing.assert_close(out[t]["kernel"], ref[t], rtol=1e-5, atol=1e-6, msg=lambda m: f"T={t}: {m}")


def _rank_fused_vs_unfused(n_shared):
    ref, out = _fused_equals_unfused(n_shared, 1, False)
    return {t: max((o - ref[t]).abs().max().item() for o in out[t].values()) for t in ref}


def test_fused_moe_tp2_equals_unfused_on_every_rank():
    """Each rank's shared MLP shard becomes its shared experts' shard; after the all-reduce the
    fused layer equals the unfused one (same random shards on both ranks)."""
    for rank_err in launch(_rank_fused_vs_unfused, 2, 2):
        assert max(rank_err.values()) < 1e-5, rank_err


@pytest.mark.parametrize("where", ["torch", "triton"])
def test_router_shared_columns_torch_and_triton(request, where):
    """The shared columns after the routed ones, on the torch ops (CPU) and the Triton router."""
    dev = request.getfixturevalue("kdev") if where == "triton" else "cpu"
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(5, 16, generator=g), 0.1 * torch.randn(16, generator=g)
    base = grouped_topk(logits, bias, 4, 4, 2, True, 1.5)
    w, ids = grouped_topk(logits.to(dev), bias.to(dev), 4, 4, 2, True, 1.5, num_shared_experts=2)
    w, ids = w.cpu(), ids.cpu()
    assert ids.shape == w.shape == (5, 6)
    assert torch.equal(ids[:, 4:], torch.tensor([[16, 17]] * 5)) and torch.equal(w[:, 4:], torch.ones(5, 2))
    order, base_order = ids[:, :4].argsort(1), base[1].argsort(1)
    assert torch.equal(ids[:, :4].gather(1, order), base[1].gather(1, base_order))
    torch.testing.assert_close(w[:, :4].gather(1, order), base[0].gather(1, base_order), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuse"))
    make_tiny_checkpoint(path, num_mtp_layers=1, n_shared_experts=2, n_group=4, topk_group=2)
    return path


def test_loaded_models_fused_give_the_unfused_logits(tiny):
    prompt = torch.tensor([3, 17, 5, 9, 40, 2])
    res = {}
    for fuse in (False, True):
        target, mtp = load_models(tiny, dtype=torch.float32, device="cpu", fuse_shared_experts=fuse)
        moes = [m for m in list(target.modules()) + list(mtp.modules()) if isinstance(m, Glm4MoeMoE)]
        assert moes and all((m.shared_experts is None) == fuse for m in moes)
        with torch.no_grad():
            h = target(prompt, torch.arange(len(prompt)))
            layer = mtp.get_layer(0)
            d = layer(mtp.embed_tokens(prompt), torch.arange(len(prompt)), h)
            res[fuse] = (target.compute_logits(h), mtp.compute_logits(d, 0))
    for a, b in zip(res[False], res[True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _rank_logits(path, fuse):
    torch.manual_seed(0)
    target, mtp = load_models(path, dtype=torch.float32, device="cpu", fuse_shared_experts=fuse)
    prompt = torch.tensor([3, 17, 5, 9, 40, 2, 11, 7])
    with torch.no_grad():
        h = target(prompt, torch.arange(len(prompt)))
        d = mtp.get_layer(0)(mtp.embed_tokens(prompt), torch.arange(len(prompt)), h)
        return target.compute_logits(h), mtp.compute_logits(d, 0)


def test_fused_tp2_from_a_checkpoint_equals_unfused_tp1(tiny):
    """Each rank's slice of the checkpoint's shared MLP (2 shared experts: gate / up rows and down
    columns cut per rank) becomes its shared experts; tp 2 fused equals tp 1 unfused."""
    ref = launch(_rank_logits, 1, tiny, False)[0]
    # fp32 sums in another order: a few ulps of the largest logit (~30 with transformers 5.25's init: 1e-5 absolute
    # was under 3 ulps there and failed by 2e-5; a wrong shard moves logits by O(1))
    tol = [dict(rtol=1e-5, atol=2e-6 * float(r.abs().max())) for r in ref]
    for rank, (t, m) in enumerate(launch(_rank_logits, 2, tiny, True)):
        torch.testing.assert_close(t, ref[0], **tol[0], msg=lambda msg: f"target rank {rank}: {msg}")
        torch.testing.assert_close(m, ref[1], **tol[1], msg=lambda msg: f"MTP rank {rank}: {msg}")


def test_export_refuses_a_fused_model(tiny):
    from mtpspec.models import export_hf_state_dict
    target, mtp = load_models(tiny, dtype=torch.float32, device="cpu")
    assert any("shared_experts" in key for key in export_hf_state_dict(target, mtp))
    target, mtp = load_models(tiny, dtype=torch.float32, device="cpu", fuse_shared_experts=True)
    with pytest.raises(ValueError, match="fused"):
        export_hf_state_dict(target, mtp)


def test_engine_fuses_by_default_and_the_flag_keeps_the_mlp(tiny):
    from mtpspec import LLM, SamplingParams
    from mtpspec.engine.arg_utils import EngineArgs
    import argparse
    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--disable-shared-experts-fusion"])
    assert EngineArgs.from_cli_args(args).disable_shared_experts_fusion
    tokens = {}
    for disable in (False, True):
        llm = LLM(tiny, device="cpu", dtype="float32", max_model_len=64, disable_shared_experts_fusion=disable,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        try:
            runner = llm.llm_engine.executor.runner
            for model in (runner.target, runner.mtp):  # the target's MoE layers and the MTP layer's
                moes = [m for m in model.modules() if isinstance(m, Glm4MoeMoE)]
                assert moes and all((m.shared_experts is not None) == disable for m in moes)
            out = llm.generate([{"prompt_token_ids": [3, 17, 5, 9]}, {"prompt_token_ids": [8, 1]}],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
            tokens[disable] = [o.outputs[0].token_ids for o in out]
        finally:
            llm.shutdown()
    assert tokens[False] == tokens[True]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
