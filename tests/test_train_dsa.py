"""The GLM-5-architecture recipe (``mtpspec train --arch glm_moe_dsa``): presets, the training-time DSA
forward (mtpspec/training/dsa.py) against the engine's forward and brute-force references, the
indexer's KL objective (DeepSeek-V3.2-Exp sec. 2.1) and its separation from the language-model
loss, the MTP loss on this architecture, and a CPU smoke run of the CLI whose checkpoint loads in
mtpspec and transformers and decodes losslessly with MTP drafts, index sharing on and off."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from mtpspec.config import ModelConfig
from mtpspec.layers.attention import build_attention_metadata, set_forward_context
from mtpspec.training.dsa import (DsaTraining, head_mean_probs, indexer_kl, selection_mask, sequence_rows)
from mtpspec.training.model_setup import DSA_PRESETS, build_models, count_parameters, make_config_dict
from mtpspec.training.packing import Batch
from mtpspec.training.step import forward_loss

V = 301
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One CPU thread for the whole module (deterministic, and fair to tests running beside it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(index_topk=6, scale=10.0, seed=3, mode="sparse"):
    """The ci preset at vocab V with ``index_topk``, weights scaled up (the 0.02 init gives near-uniform
    attention and indexer logits, which would make the comparisons weak), DSA training installed."""
    raw = make_config_dict("ci", V, 0, arch="glm_moe_dsa", index_topk=index_topk)
    target, mtp = build_models(ModelConfig.from_dict(raw), CPU, torch.float32, seed=seed)
    with torch.no_grad():
        for p in list(target.parameters()) + list(mtp.parameters()):
            if p.dim() >= 2:
                p.mul_(scale)
    return target, mtp, DsaTraining([target, mtp], mode=mode)


def _ids(b, length, seed=1):
    return torch.randint(1, V, (b, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ presets
def test_demo_preset_is_glm5_shaped_and_small():
    raw = make_config_dict("demo", 10_007, 0, arch="glm_moe_dsa")
    cfg = ModelConfig.from_dict(raw)
    assert raw["architectures"] == ["GlmMoeDsaForCausalLM"] and raw["model_type"] == "glm_moe_dsa"
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group and cfg.q_lora_rank and cfg.num_nextn_predict_layers == 1
    assert "shared" in cfg.arch.indexer_types and cfg.arch.indexer_types[0] == "full"
    assert raw["index_share_for_mtp_iteration"] is False and raw["tie_word_embeddings"]
    from mtpspec.models.registry import get_architecture
    mtp_keys = get_architecture(cfg.architecture).mtp_weight_specs(cfg)
    n = cfg.num_hidden_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.indexer.wq_b.weight", "self_attn.indexer.weights_proj.weight", "mlp.gate.weight"):
        assert f"model.layers.{n}.{name}" in mtp_keys
    target, mtp = build_models(cfg, CPU, torch.bfloat16)
    counts = count_parameters(target, mtp)
    assert counts["total"] * 2 < 25e6  # bf16 bytes: "well under 30 MB" with the tokenizer (0.7 MB)
    # The GLM-4.5 defaults are unchanged.
    assert make_config_dict("demo", 10_007, 0)["architectures"] == ["Glm4MoeForCausalLM"]
    with pytest.raises(ValueError, match="unknown architecture"):
        make_config_dict("demo", 10_007, 0, arch="llama")
    with pytest.raises(ValueError, match="unknown model preset"):
        make_config_dict("demo-dense", 10_007, 0, arch="glm_moe_dsa")


def test_demo_index_topk_prunes_every_5shot_gsm8k_prompt():
    """The figure the preset states: with the bundled tokenizer (the recipe's: same data, same seed),
    all 1,319 5-shot GSM8K test prompts (eval's shots: the first 5 train rows) are longer than
    index_topk, the shortest 666 tokens."""
    from tokenizers import Tokenizer

    from mtpspec import demo_model_path
    from mtpspec.data.gsm8k import load_gsm8k, resolve_gsm8k
    from mtpspec.entrypoints.eval_gsm8k import build_prompts
    tok = Tokenizer.from_file(os.path.join(demo_model_path(), "tokenizer.json"))
    prompts = build_prompts(load_gsm8k(resolve_gsm8k("test")), load_gsm8k(resolve_gsm8k("train")), 5)
    lengths = [len(e.ids) for e in tok.encode_batch(prompts)]
    assert len(lengths) == 1319 and min(lengths) == 666 and max(lengths) == 836
    assert sum(n > DSA_PRESETS["demo"]["index_topk"] for n in lengths) == 1319


# ------------------------------------------------------------------------------------ forward
def test_sparse_training_forward_equals_the_engine_forward():
    target, mtp, dsa = _models()
    ids = _ids(3, 20).reshape(-1)
    pos = torch.arange(20).repeat(3)
    with torch.no_grad(), set_forward_context(build_attention_metadata([20] * 3, [20] * 3, None)):
        h = target(ids, pos)
        m = mtp(ids, pos, h)
        with dsa.inference():
            h_ref = target(ids, pos)
            m_ref = mtp(ids, pos, h_ref)
        dsa.set_mode("dense")
        h_dense = target(ids, pos)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-5)
    assert (h_dense - h_ref).abs().max() > 1e-2  # the selection (6 of up to 20) really prunes
    # no metadata: one causal sequence, as the acceptance simulation runs it
    with torch.no_grad():
        dsa.set_mode("sparse")
        one = target(ids[:20], pos[:20])
        with dsa.inference():
            one_ref = target(ids[:20], pos[:20])
    torch.testing.assert_close(one, one_ref, rtol=1e-5, atol=1e-5)


def test_dense_mode_is_full_causal_attention():
    """With index_topk >= the row length every causal key is selected: dense training mode, sparse
    training mode and the engine forward agree."""
    target, mtp, dsa = _models(index_topk=32)
    ids, pos = _ids(2, 24).reshape(-1), torch.arange(24).repeat(2)
    outs = []
    with torch.no_grad(), set_forward_context(build_attention_metadata([24] * 2, [24] * 2, None)):
        for mode in ("dense", "sparse"):
            dsa.set_mode(mode)
            outs.append(target(ids, pos))
        with dsa.inference():
            outs.append(target(ids, pos))
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], rtol=1e-5, atol=1e-5)


def test_row_layout_errors_and_shared_layer_without_selection():
    with set_forward_context(build_attention_metadata([5, 6], [5, 6], None)):
        with pytest.raises(ValueError, match="one length L"):
            sequence_rows(11)
    with set_forward_context(build_attention_metadata([4, 4], [4, 4], [[0], [1]], block_size=4)):
        with pytest.raises(ValueError, match="without a KV cache"):
            sequence_rows(8)
    target, mtp, dsa = _models()
    shared = target.model.layers[1].self_attn
    assert shared.indexer is None
    with pytest.raises(RuntimeError, match="shares the DSA selection"):
        shared(torch.arange(8), torch.randn(8, 32))
    with pytest.raises(ValueError, match="mode"):
        dsa.set_mode("half")


# ------------------------------------------------------------------------------------ KL objective
def test_indexer_kl_and_target_distribution_match_brute_force():
    g = torch.Generator().manual_seed(0)
    b, nh, length, d = 2, 3, 7, 5
    q, k = torch.randn(b, nh, length, d, generator=g), torch.randn(b, nh, length, d, generator=g)
    logits = torch.randn(b, length, length, generator=g)
    causal = torch.ones(length, length).tril().bool()
    topk = torch.tensor([[j for j in range(max(0, i - 2), i + 1)] + [-1] * (3 - min(i + 1, 3)) for i in range(length)])
    sel = selection_mask(topk.repeat(b, 1), b, length)
    for allowed in (causal[None].expand(b, length, length), causal[None] & sel):
        p = head_mean_probs(q, k, allowed, 0.7)
        kl = indexer_kl(p, logits, allowed)
        for bi in range(b):
            for t in range(length):
                keys = [s for s in range(length) if allowed[bi, t, s]]
                ref_p = torch.zeros(len(keys), dtype=torch.float64)
                for h in range(nh):
                    sc = torch.tensor([float(q[bi, h, t] @ k[bi, h, s]) * 0.7 for s in keys], dtype=torch.float64)
                    ref_p += torch.softmax(sc, 0) / nh
                ref_q = torch.log_softmax(logits[bi, t, keys].double(), 0)
                ref = float((ref_p * (ref_p.log() - ref_q)).sum())
                torch.testing.assert_close(p[bi, t, keys].double(), ref_p, rtol=1e-5, atol=1e-6)
                assert math.isclose(float(kl[bi, t]), ref, rel_tol=1e-4, abs_tol=1e-6)
        assert (p[~allowed] == 0).all()


def test_lm_loss_never_reaches_the_indexer_and_kl_reaches_only_it():
    target, mtp, dsa = _models()
    batch = Batch(_ids(2, 20), torch.tensor([20, 14]))
    params = {n: p for m in (target, mtp) for n, p in m.named_parameters()}
    for mode in ("dense", "sparse"):
        dsa.set_mode(mode)
        out = forward_loss(target, mtp, batch, CPU, 0.5, mtp_depth=2, dsa=dsa)
        assert len(out.dsa_stats["indexer_kl_calls"]) == 1 + 2  # target layer 0 (layer 1 shared) + 2 MTP depths
        lm = out.target_loss + sum(out.mtp_losses)
        grads = torch.autograd.grad(lm, list(params.values()), allow_unused=True, retain_graph=True)
        got = {n for (n, _), gr in zip(params.items(), grads) if gr is not None and gr.abs().sum() > 0}
        assert got and not any(".indexer." in n for n in got), mode
        grads = torch.autograd.grad(out.indexer_loss, list(params.values()), allow_unused=True)
        got = {n for (n, _), gr in zip(params.items(), grads) if gr is not None and gr.abs().sum() > 0}
        assert got and all(".indexer." in n for n in got), (mode, got)
        # the indexer of the target's full layer and the MTP layer's own indexer both learn
        assert any(n.startswith("model.layers.0.") for n in got) and any("mtp_block" in n for n in got)
        # loss = LM + MTP + kl_weight * L^I
        assert math.isclose(out.loss.item(), (out.target_loss + 0.5 / 2 * sum(out.mtp_losses)
                                              + out.indexer_loss).item(), rel_tol=1e-6)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_strided_kl_is_the_all_rows_kl_on_every_nth_row(mode):
    """kl_row_stride = 3: each call's L^I is the valid-row mean of the all-rows per-row KL over rows
    off, off + 3, ... (off drawn from torch's generator), the forward's output is unchanged, and
    the KL's gradient still reaches only the indexers."""
    from mtpspec.training.dsa import dsa_attention_forward, DsaRecord
    target, mtp, dsa = _models()
    attn = target.model.layers[0].self_attn
    b, length, stride = 2, 20, 3
    h = torch.randn(b * length, 32, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(length).repeat(b)
    valid = torch.arange(b * length) < length + 14  # second row: 14 real tokens
    with set_forward_context(build_attention_metadata([length] * b, [length] * b, None)):
        full = DsaRecord(valid=valid)
        out_full = dsa_attention_forward(attn, pos, h, mode, full)
        torch.manual_seed(11)
        off = int(torch.randint(stride, (1,)))
        torch.manual_seed(11)
        strided = DsaRecord(valid=valid)
        out_str = dsa_attention_forward(attn, pos, h, mode, strided, kl_row_stride=stride)
    torch.testing.assert_close(out_str, out_full, rtol=0, atol=0)
    rows = torch.arange(off, length, stride)
    # reference: the all-rows KL per row, through a record whose valid mask keeps only `rows`
    keep = torch.zeros(b, length, dtype=torch.bool)
    keep[:, rows] = True
    with set_forward_context(build_attention_metadata([length] * b, [length] * b, None)):
        ref = DsaRecord(valid=valid & keep.reshape(-1))
        dsa_attention_forward(attn, pos, h, mode, ref)
    assert math.isclose(float(strided.kl[0].detach()), float(ref.kl[0].detach()), rel_tol=1e-5, abs_tol=1e-7)
    assert not math.isclose(float(strided.kl[0].detach()), float(full.kl[0].detach()), rel_tol=1e-3)  # a subset
    params = dict(target.named_parameters())
    grads = torch.autograd.grad(strided.kl[0], list(params.values()), allow_unused=True)
    got = {n for (n, _), g in zip(params.items(), grads) if g is not None and g.abs().sum() > 0}
    assert got and all(".indexer." in n for n in got)
    with pytest.raises(ValueError, match="row stride"):
        DsaTraining([target, mtp], kl_row_stride=0)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_kl_decreases_on_a_fixed_batch(mode):
    """A few AdamW steps on the indexers alone (the main model fixed) pull their distribution
    towards the attention's: L^I falls well below its start and the recall of the dense attention
    mass by the top-k rises."""
    target, mtp, dsa = _models(mode=mode, scale=20.0)  # peaked attention: a distribution worth learning
    batch = Batch(_ids(4, 32, seed=7), torch.tensor([32, 32, 30, 25]))
    idx = [p for n, p in list(target.named_parameters()) + list(mtp.named_parameters()) if ".indexer." in n]
    for _, p in list(target.named_parameters()) + list(mtp.named_parameters()):
        p.requires_grad_(False)
    for p in idx:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(idx, lr=3e-2, weight_decay=0.0)
    kls, recalls = [], []
    for _ in range(20):
        out = forward_loss(target, mtp, batch, CPU, 0.5, mtp_depth=1, dsa=dsa, measure_dsa=True)
        kls.append(out.indexer_loss.item())
        recalls.append(out.dsa_stats["index_recall"])
        opt.zero_grad()
        out.indexer_loss.backward()
        opt.step()
    assert kls[-1] < 0.5 * kls[0], kls
    assert recalls[-1] > recalls[0] + 0.1, recalls


def test_mtp_loss_on_the_dsa_model_equals_per_document_forwards():
    """forward_loss (sparse DSA, 2 MTP depths with the one MTP layer) == each document run alone with
    the engine's forward: the DeepSeek-V3 MTP loss (eq. 25) holds for this architecture."""
    target, mtp, dsa = _models()
    lens, width = [16, 3, 11], 16
    ids = _ids(3, width, seed=5)
    for r, n in enumerate(lens):
        ids[r, n:] = 0
    out = forward_loss(target, mtp, Batch(ids, torch.tensor(lens)), CPU, 0.5, mtp_depth=2, dsa=dsa)
    nll, cnt = [0.0, 0.0, 0.0], [0, 0, 0]
    with torch.no_grad(), dsa.inference():
        for r, n in enumerate(lens):
            doc = ids[r, :n]
            h = target(doc, torch.arange(n))
            lt = target.compute_logits(h)
            for i in range(n - 1):
                nll[0] -= F.log_softmax(lt[i].double(), -1)[doc[i + 1]].item()
                cnt[0] += 1
            prev = h
            for k in (1, 2):
                if n < k + 1:
                    break
                nxt = torch.cat([doc[k:], torch.zeros(k, dtype=doc.dtype)])
                prev = mtp(nxt, torch.arange(n) + k - 1, prev, spec_step_idx=k - 1)
                lm = mtp.compute_logits(prev, k - 1)
                for i in range(n - k - 1):
                    nll[k] -= F.log_softmax(lm[i].double(), -1)[doc[i + k + 1]].item()
                    cnt[k] += 1
    assert out.counts == cnt
    means = [a / c for a, c in zip(nll, cnt)]
    assert math.isclose(out.target_loss.item(), means[0], rel_tol=1e-5)
    for k in (1, 2):
        assert math.isclose(out.mtp_losses[k - 1].item(), means[k], rel_tol=1e-5)


# ------------------------------------------------------------------------------ CLI smoke run
STEPS, DENSE_STEPS, PHASE1_STEPS = 16, 4, 12
CLI = ["train", "--arch", "glm_moe_dsa", "--preset", "ci", "--gsm8k-limit", "300", "--holdout", "20",
       "--num-synthetic", "1500", "--tokenizer-synthetic", "1500", "--gsm8k-epochs", "1", "--max-len", "512",
       "--tokens-per-batch", "2048", "--max-steps", str(STEPS), "--max-minutes", "0", "--lr", "1e-2",
       "--warmup-steps", "4", "--log-every", "1", "--eval-every", "0", "--eval-docs", "6", "--accept-prompts", "1",
       "--accept-max-new", "8", "--device", "cpu", "--dtype", "float32", "--save-dtype", "float32", "--no-progress",
       "--distill-fraction", "0.25", "--distill-lr", "1e-2", "--distill-warmup-steps", "2",
       "--indexer-warmup-fraction", "0.25"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mtpspec.entrypoints.cli import main
    out = str(tmp_path_factory.mktemp("dsa_ci_model"))
    assert main(CLI + ["--output-dir", out]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        return out, json.load(f)


def _records(out, kind):
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_cli_run_dense_warmup_then_sparse_then_distillation(run):
    """Dense attention for the first quarter of the steps, sparse after it; the MTP loss at 3 depths in
    phase 1 (DeepSeek-V3 eq. 25) and the distilled depth 1 in phase 2; the indexer's KL every step
    (phase 2: the MTP layer's own indexer); the losses fall."""
    out, summary = run
    recs = _records(out, "train")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)) and summary["steps"] == STEPS
    assert [r["dsa_mode"] for r in recs] == ["dense"] * DENSE_STEPS + ["sparse"] * (STEPS - DENSE_STEPS)
    assert [r["phase"] for r in recs] == [1] * PHASE1_STEPS + [2] * (STEPS - PHASE1_STEPS)
    assert all(len(r["mtp_loss"]) == 3 for r in recs[:PHASE1_STEPS])
    assert all(len(r["mtp_loss"]) == 1 for r in recs[PHASE1_STEPS:])
    assert recs[PHASE1_STEPS]["lr"] == pytest.approx(1e-2 / 2)  # phase 2 restarts its warm-up
    assert all(r["indexer_kl"] is not None and r["indexer_kl"] >= 0 for r in recs)
    assert [(r["step"], r["mode"]) for r in _records(out, "dsa")] == [(DENSE_STEPS, "sparse")]
    assert summary["dsa"]["sparse_start"]["step"] == DENSE_STEPS and summary["dsa"]["index_topk"] == 16
    last = recs[PHASE1_STEPS - 4:PHASE1_STEPS]
    assert sum(r["target_loss"] for r in last) / 4 < recs[0]["target_loss"] - 1.0
    assert sum(r["mtp_loss"][0] for r in last) / 4 < recs[0]["mtp_loss"][0] - 1.0
    v = summary["final_val"]
    assert v["dsa_mode"] == "sparse" and v["indexer_kl"] >= 0 and 0 < v["index_recall"] <= 1
    assert summary["acceptance_holdout_zero_shot"]["k1"]["acceptance_length"] >= 1.0


def test_checkpoint_layout_loads_in_mtpspec_and_transformers(run):
    out, _ = run
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["architectures"] == ["GlmMoeDsaForCausalLM"] and raw["index_share_for_mtp_iteration"] is False
    from mtpspec.models.loader import read_checkpoint_tensors
    tensors = dict(read_checkpoint_tensors(out))
    n = raw["num_hidden_layers"]
    for i, kind in enumerate(raw["indexer_types"]):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in tensors) == (kind == "full")
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight",
                 "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias",
                 "self_attn.indexer.weights_proj.weight"):
        assert f"model.layers.{n}.{name}" in tensors, name
    assert f"model.layers.{n}.shared_head.head.weight" not in tensors and "lm_head.weight" not in tensors

    from tokenizers import Tokenizer

    from mtpspec.data.gsm8k import format_query, load_gsm8k, resolve_gsm8k
    from mtpspec.models import load_models
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ids = torch.tensor(tok.encode(format_query(load_gsm8k(resolve_gsm8k("test"))[0]["question"])).ids)
    n_tok, topk = len(ids), raw["index_topk"]
    assert n_tok > topk  # the selection prunes
    assert raw["indexer_types"] == ["full", "shared"]  # one selection for the whole target (below)
    target, mtp = load_models(out, dtype=torch.float32, device="cpu")
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    seen = {}

    def keep_selection(module, args, out):  # returns None: the output stays
        seen["pos"] = out[0]
    hook = hf.model.layers[0].self_attn.indexer.register_forward_hook(keep_selection)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    hook.remove()
    hf_pos = seen["pos"]  # [T, index_topk] transformers' selection (its top-k has no tie rule)
    # 1. Every tensor but the indexer's: with transformers' selection, mtpspec gives transformers' logits.
    meta = build_attention_metadata([n_tok], [n_tok], None)
    meta.precomputed_topk_pos = hf_pos
    attn0 = target.model.layers[0].self_attn
    got = {}

    def keep_input(module, args):
        got["x"] = args[1]
    pre = attn0.register_forward_pre_hook(keep_input)
    with torch.no_grad(), set_forward_context(meta):
        ours = target.compute_logits(target(ids, torch.arange(n_tok)))
    pre.remove()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # 2. The indexer's tensors: transformers' selection is the top-k of mtpspec's indexer logits, up to
    # near-ties (a barely trained indexer has many; their order depends on rounding).
    from mtpspec.training.dsa import indexer_scores
    with torch.no_grad():
        x = got["x"]
        q_resid = attn0.q_a_layernorm(attn0.q_a_proj(x))
        logits = indexer_scores(attn0.indexer, x, q_resid, torch.arange(n_tok), attn0.rotary_emb.cos_sin_cache, 1,
                                n_tok)[0]
    rows = torch.arange(topk, n_tok)  # rows with more causal positions than index_topk
    kth = logits[rows].topk(topk, dim=-1).values[:, -1]
    picked_min = logits[rows].gather(1, hf_pos[rows].long()).min(-1).values
    finite = logits[rows][torch.isfinite(logits[rows])]  # -inf past each row's position
    tol = 1e-5 * float(finite.abs().max()) + 1e-7  # a row-flipped wk, noise on k_norm.bias: gaps of 1e-3 .. 0.5
    assert (picked_min >= kth - tol).all(), (picked_min - kth).min()


@pytest.fixture(scope="module")
def prompts(run):
    from tokenizers import Tokenizer

    from mtpspec.data.gsm8k import format_query, load_gsm8k, resolve_gsm8k
    tok = Tokenizer.from_file(os.path.join(run[0], "tokenizer.json"))
    return [tok.encode(format_query(r["question"])).ids for r in load_gsm8k(resolve_gsm8k("test"))[:3]]


def _generate(path, prompts, k=0, share=None):
    from mtpspec import LLM, SamplingParams
    spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k, "index_share_for_mtp_iteration": share}
    llm = LLM(path, dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=4)
    try:
        if k:
            assert llm.engine_config.speculative_config.index_share_for_mtp_iteration is share
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k,share", [(1, False), (1, True), (3, False), (3, True)])
def test_checkpoint_decodes_losslessly_with_mtp(run, prompts, k, share):
    """Greedy with MTP drafts (index sharing on and off) == greedy without, on GSM8K questions longer
    than index_topk (prompt + draft context past it, so the selections prune and sharing reuses a
    pruned selection). At CI sizes the model is barely trained; decoding of varied outputs through
    the same engine path is test_glm_moe_dsa / test_index_share's."""
    out, _ = run
    assert min(map(len, prompts)) > json.load(open(os.path.join(out, "config.json")))["index_topk"]
    plain, _ = _generate(out, prompts)
    got, metrics = _generate(out, prompts, k, share)
    assert got == plain
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] == k * metrics["num_drafts"]


def test_mtp_only_distillation_from_the_checkpoint(run, tmp_path, capsys):
    """``--init-from`` a DSA checkpoint + ``--freeze-target`` + ``--mtp-distill``: the target (its
    indexers and the shared embedding included) comes back bit-identical, the MTP layer changes (its
    own indexer too: the KL trains it), a mismatched ``--arch`` is refused,
    and without ``--arch`` the model's own is used."""
    from mtpspec.entrypoints.cli import main
    from mtpspec.models.loader import read_checkpoint_tensors
    src, _ = run
    out = str(tmp_path / "distilled")
    argv = ["train", "--init-from", src, "--freeze-target", "--mtp-distill", "1.0", "--gsm8k-limit", "300",
            "--holdout", "20", "--num-synthetic", "300", "--gsm8k-epochs", "1", "--max-len", "512",
            "--tokens-per-batch", "1024", "--max-steps", "6", "--max-minutes", "0", "--lr", "1e-2", "--warmup-steps",
            "2", "--eval-every", "0", "--eval-docs", "4", "--accept-prompts", "0", "--device", "cpu", "--dtype",
            "float32", "--save-dtype", "float32", "--no-progress", "--distill-fraction", "0",
            "--indexer-warmup-fraction", "0", "--output-dir", out]
    assert main(argv[:1] + ["--arch", "glm4_moe"] + argv[1:]) == 2  # an explicit --arch that is not the model's
    assert "pass --arch glm_moe_dsa" in capsys.readouterr().err and not os.path.exists(out)  # refused before writing
    assert main(argv) == 0  # no --arch: the model's own
    before, after = dict(read_checkpoint_tensors(src)), dict(read_checkpoint_tensors(out))
    assert before.keys() == after.keys()
    mtp_prefix = f"model.layers.{json.load(open(os.path.join(src, 'config.json')))['num_hidden_layers']}."
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(mtp_prefix) for k in changed), changed
    assert any(".indexer." in k for k in changed) and any(".indexer." not in k for k in changed)


def test_bad_dsa_flags_are_refused():
    from mtpspec.training.train import TrainConfig, check_config
    check_config(TrainConfig(arch="glm_moe_dsa", index_topk=128))
    check_config(TrainConfig(distill_fraction=0.9))  # GLM-4.5: the indexer's warm-up fraction is not read
    for cfg, msg in [(TrainConfig(arch="llama"), "--arch"), (TrainConfig(index_topk=64), "applies to --arch"),
                     (TrainConfig(arch="glm_moe_dsa", index_topk=-1), "--index-topk"),
                     (TrainConfig(arch="glm_moe_dsa", indexer_warmup_fraction=0.8), "indexer-warmup-fraction"),
                     (TrainConfig(arch="glm_moe_dsa", indexer_kl_weight=-1.0), "indexer-kl-weight"),
                     (TrainConfig(arch="glm_moe_dsa", indexer_kl_row_stride=0), "indexer-kl-row-stride"),
                     (TrainConfig(arch="glm_moe_dsa", init_from="x", index_topk=64), "keeps its own")]:
        with pytest.raises(ValueError, match=msg):
            check_config(cfg)
