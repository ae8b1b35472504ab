"""Target and MTP models at tp 1, 2 and 4 (gloo ranks), one launch per tp size for everything.

Target: tiny random checkpoints written by ``transformers``' ``save_pretrained`` (dense + MoE layers,
partial rotary, GQA; one variant with qk-norm, q/k/v bias, tied embeddings, 4 expert groups, no top-k
renormalisation) must give Hugging Face's own ``Glm4MoeForCausalLM`` logits (fp32) for several
prompts: one prompt at a time, all prompts in one flattened varlen batch with padding rows, and
through the paged KV cache (chunked prefill then decode steps). Each rank holds only its shards.

MTP (random MTP layers added to those checkpoints with our writer, one variant without
``shared_head.head``): for token counts 1, tp - 1, tp + 1, B * (1 + k) and a two-sequence batch,
and for spec steps 0 and 1, tp 2 / 4 equal tp 1; the fused arm equals the baseline arm; the
sequence-parallel path equals the plain path and sends no all-reduce; ``get_top_tokens`` equals
``compute_logits(...).argmax(-1)`` on every rank.
"""

import pytest
import torch

from mtpspec.distributed import comm_stats, get_tensor_model_parallel_rank, launch, reset_comm_stats
from mtpspec.layers.attention import allocate_kv_caches, build_attention_metadata, set_forward_context
from mtpspec.models import load_models, supports_local_argmax
from tiny_models import make_tiny_checkpoint

VARIANTS = {
    "plain": dict(num_mtp_layers=2),
    "qknorm_bias_tied": dict(num_mtp_layers=1, mtp_head=False, use_qk_norm=True, attention_bias=True,
                             tie_word_embeddings=True, n_group=4, topk_group=2, num_experts_per_tok=2,
                             norm_topk_prob=False, first_k_dense_replace=2, routed_scaling_factor=2.0,
                             partial_rotary_factor=0.25),
}
PROMPT_LENS = (1, 7, 13, 4)
ATOL, RTOL = 2e-4, 2e-5
MTP_ATOL, MTP_RTOL = 1e-4, 1e-5


def _mtp_batches(tp):
    """(name, seq_lens) draft batches: 1, tp - 1, tp + 1 and B * (1 + k) tokens, and two sequences."""
    counts = sorted({1, max(1, tp - 1), tp + 1, 3 * (1 + 2)})
    return [(f"T={n}", [n]) for n in counts] + [("two_seqs", [5, 2])]


def make_check_inputs(hf, cfg, g, prompt_lens):
    """``(prompts, ref, mtp_inputs)`` for the target / MTP checks (shared with test_deepseek_v3):
    random prompts of ``prompt_lens``, transformers' logits of each, and the MTP draft batches of
    every tp (token ids, positions, previous hidden states, seq_lens) drawn from ``g``."""
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in prompt_lens]
    with torch.no_grad():
        ref = [hf(p[None]).logits[0] for p in prompts]
    mtp_inputs = {}
    for tp in (1, 2, 4):
        for bname, lens in _mtp_batches(tp):
            t = sum(lens)
            mtp_inputs[bname] = (torch.randint(0, cfg.vocab_size, (t,), generator=g),
                                 torch.cat([torch.arange(n) + (3 if j else 0) for j, n in enumerate(lens)]),
                                 torch.randn(t, cfg.hidden_size, generator=g), lens)
    return prompts, ref, mtp_inputs


def assert_target_matches(t, ref, atol, rtol, where):
    """The single, batched and cached logits of target result ``t`` all match ``ref``."""
    for name in ("single", "batched", "cached"):
        got = torch.cat(t[name]) if isinstance(t[name], list) else t[name]
        torch.testing.assert_close(got, torch.cat(ref), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{where} {name}: {m}")


def assert_mtp_arm_matches_tp1(result, base, arm, where, atol, rtol):
    """One MTP arm's ``(out, logits, top_ok, stats)`` at tp > 1: top tokens = argmax, hidden and
    logits match tp 1's fused ``base``, and the arm issued the expected collectives."""
    out, logits, top_ok, stats = result
    assert top_ok, f"{where}: get_top_tokens != argmax(compute_logits)"
    ref_out, ref_logits = base[:2]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol,
                               msg=lambda msg: f"{where} hidden vs tp1: {msg}")
    torch.testing.assert_close(logits, ref_logits, atol=5 * atol, rtol=rtol,
                               msg=lambda msg: f"{where} logits vs tp1: {msg}")
    if arm == "sp":
        assert "all_reduce" not in stats, f"{where}: SP path issued {stats}"
        assert stats["all_gather"]["calls"] == 3 and stats["reduce_scatter"]["calls"] == 2
    else:
        assert stats["all_reduce"]["calls"] == 2, f"{where}: {stats}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1234)
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        path = str(tmp_path_factory.mktemp(name))
        hf, cfg = make_tiny_checkpoint(path, seed=40 + i, **overrides)
        prompts, ref, mtp_inputs = make_check_inputs(hf, cfg, g, PROMPT_LENS)
        out[name] = (path, prompts, ref, mtp_inputs)
    runs = {1: [_rank_all(out)]}
    for tp in (2, 4):
        runs[tp] = launch(_rank_all, tp, out, timeout_s=600)
    return out, runs


def paged_target_checks(model, prompts, attention_layers):
    """Target forward checks shared with test_deepseek_v3: each prompt alone, all prompts in one
    padded batch, and a paged-cache decode (prefill all but the last 3 tokens, then one token a
    step, reversed block order). ``attention_layers(model)`` gives the layers whose cache is
    dropped at the end. Returns ``(res, done)``."""
    res = {}
    with torch.no_grad():
        res["single"] = [model.compute_logits(model(p, torch.arange(len(p)))) for p in prompts]
        pad = 2
        ids = torch.cat(prompts + [torch.zeros(pad, dtype=torch.long)])
        pos = torch.cat([torch.arange(len(p)) for p in prompts] + [torch.zeros(pad, dtype=torch.long)])
        meta = build_attention_metadata([len(p) for p in prompts], [len(p) for p in prompts], None,
                                        num_tokens=len(ids))
        with set_forward_context(meta):
            h = model(ids, pos)
        logits = model.compute_logits(h)
        res["batched"] = logits[:-pad]
        res["top_equal"] = torch.equal(model.get_top_tokens(h), logits.argmax(-1))
        res["pad_finite"] = bool(torch.isfinite(h).all())
        bs = 4
        allocate_kv_caches(model, num_blocks=16, block_size=bs, dtype=torch.float32)
        tables, nxt = [], 0
        for p in prompts:
            n = -(-len(p) // bs)
            tables.append(list(range(nxt + n - 1, nxt - 1, -1)))  # reversed block order
            nxt += n
        done = [0] * len(prompts)
        cached = [[] for _ in prompts]
        while True:  # first step: prefill all but the last 3 tokens; then one token per step
            active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            if not active:
                break
            qlens = [1 if done[i] else max(1, len(prompts[i]) - 3) for i in active]
            ids = torch.cat([prompts[i][done[i]:done[i] + q] for i, q in zip(active, qlens)])
            pos = torch.cat([torch.arange(done[i], done[i] + q) for i, q in zip(active, qlens)])
            meta = build_attention_metadata(qlens, [done[i] + q for i, q in zip(active, qlens)],
                                            [tables[i] for i in active], bs)
            with set_forward_context(meta):
                lg = model.compute_logits(model(ids, pos))
            row = 0
            for i, q in zip(active, qlens):
                cached[i].append(lg[row:row + q])
                row += q
                done[i] += q
        for layer in attention_layers(model):
            layer.kv_cache = None
        res["cached"] = [torch.cat(c) for c in cached]
    return res, done


def _target_checks(model, prompts):
    res, done = paged_target_checks(model, prompts, lambda m: [layer.self_attn.attn for layer in m.model.layers])
    res["complete"] = done == [len(p) for p in prompts]
    res["qkv_rows"] = model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    res["w13"] = tuple(model.model.layers[-1].mlp.experts.w13_weight.shape)
    res["local_argmax"] = supports_local_argmax(model)
    return res


def _mtp_checks(mtp, inputs):
    res = {}
    arms = {"fused": (True, False), "baseline": (False, False), "sp": (True, True)}
    with torch.no_grad():
        for bname, (ids, pos, prev, lens) in inputs.items():  # every tp's batches, at every tp
            meta = build_attention_metadata(lens, [p + 1 for p in [int(pos[sum(lens[:j + 1]) - 1])
                                                                    for j in range(len(lens))]], None)
            for step in (0, 1):
                for arm, (fuse, sp) in arms.items():
                    mtp.set_variant(fuse, sp)
                    layer = mtp.get_layer(step)
                    emb = mtp.embed_tokens(ids)
                    reset_comm_stats()
                    with set_forward_context(meta):
                        out = layer(emb, pos, prev)
                    stats = comm_stats()
                    logits = mtp.compute_logits(out, step)
                    top = mtp.get_top_tokens(out, step)
                    res[(bname, step, arm)] = (out, logits, torch.equal(top, logits.argmax(-1)), stats)
        mtp.set_variant(True, False)
    return res


def rank_all_checks(setup_data, target_checks, extras):
    """One rank's results over every variant of ``setup_data`` (shared with test_deepseek_v3):
    ``target_checks(target, prompts)``, :func:`_mtp_checks` and ``extras(target, mtp)``."""
    torch.manual_seed(0)
    out = {"rank": get_tensor_model_parallel_rank()}
    for name, (path, prompts, _, mtp_inputs) in setup_data.items():
        target, mtp = load_models(path, dtype=torch.float32, device="cpu")
        out[name] = {"target": target_checks(target, prompts), "mtp": _mtp_checks(mtp, mtp_inputs),
                     **extras(target, mtp)}
    return out


def _rank_all(setup_data):
    return rank_all_checks(setup_data, _target_checks,
                           lambda target, mtp: {"tied": mtp.get_layer(0).shared_head.head is target.lm_head})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_target_matches_transformers(setup, variant, tp):
    data, runs = setup
    _, _, ref, _ = data[variant]
    for r in runs[tp]:
        t = r[variant]["target"]
        assert t["local_argmax"] and t["complete"] and t["top_equal"] and t["pad_finite"]
        assert_target_matches(t, ref, ATOL, RTOL, f"tp={tp} rank={r['rank']}")
        # Each rank holds only its shard: q heads split, kv heads (2) split or replicated.
        assert t["qkv_rows"] == (4 // tp + 2 * max(1, 2 // tp)) * 32
        assert t["w13"] == (8, 2 * 32 // tp, 64)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_tp_equals_tp1_and_arms_agree(setup, variant, tp):
    data, runs = setup
    base = runs[1][0][variant]["mtp"]
    assert runs[1][0][variant]["tied"] == (variant == "qknorm_bias_tied")
    for r in runs[tp]:
        assert r[variant]["tied"] == (variant == "qknorm_bias_tied")
        m = r[variant]["mtp"]
        for bname, _ in _mtp_batches(tp):
            for step in (0, 1):
                fused = m[(bname, step, "fused")]
                for arm in ("fused", "baseline", "sp"):
                    out = m[(bname, step, arm)][0]
                    where = f"tp={tp} rank={r['rank']} {bname} step={step} {arm}"
                    # Against tp 1 (same arm code path at tp 1 is the plain local computation),
                    # and the communication each arm issues.
                    assert_mtp_arm_matches_tp1(m[(bname, step, arm)], base[(bname, step, "fused")], arm, where,
                                               MTP_ATOL, MTP_RTOL)
                    assert torch.isfinite(out).all(), where
                    # Arms against each other at this tp.
                    torch.testing.assert_close(out, fused[0], atol=MTP_ATOL, rtol=MTP_RTOL,
                                               msg=lambda msg: f"{where} vs fused arm: {msg}")


def test_mtp_tp1_arms_identical(setup):
    _, runs = setup
    for variant in VARIANTS:
        m = runs[1][0][variant]["mtp"]
        for (bname, step, arm), (out, _, top_ok, stats) in m.items():
            assert top_ok and stats == {}
            assert torch.equal(out, m[(bname, step, "fused")][0])
