"""Training plumbing: batched attention, the packed forward vs per-document forwards of the real
models, length bucketing, corpus chains, AdamW with master weights, LR schedule, router balancing."""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtpspec.config import ModelConfig
from mtpspec.layers.attention import Attention, build_attention_metadata, set_forward_context
from mtpspec.training.corpus import TokenDocs, chain_documents, generate_examples
from mtpspec.data.gsm8k import EOT, fewshot_prompt
from mtpspec.training.model_setup import build_models, make_config_dict
from mtpspec.training.optim import MasterWeightAdamW, RouterBalancer, lr_at
from mtpspec.training.packing import Batch, bucket_batches, make_batch, pad_fraction
from mtpspec.training.step import forward_loss

V = 301


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(make_config_dict("ci", V, 0, num_hidden_layers=2))
    target, mtp = build_models(cfg, torch.device("cpu"), torch.float32, seed=3)
    # larger weights than the 0.02 init so that differences would show
    with torch.no_grad():
        for p in list(target.parameters()) + list(mtp.parameters()):
            if p.dim() >= 2:
                p.mul_(10.0)
    return target, mtp


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2), (6, 1)])
def test_batched_attention_equals_per_sequence(heads, kv):
    torch.manual_seed(heads * 10 + kv)
    attn = Attention(heads, 8, 8 ** -0.5, kv)
    b, length = 3, 11
    q = torch.randn(b * length, heads * 8, dtype=torch.float64)
    k = torch.randn(b * length, kv * 8, dtype=torch.float64)
    v = torch.randn(b * length, kv * 8, dtype=torch.float64)
    with set_forward_context(build_attention_metadata([length] * b, [length] * b)):
        got = attn(q, k, v)
    for r in range(b):
        rows = slice(r * length, (r + 1) * length)
        ref = attn(q[rows], k[rows], v[rows])  # no context: one causal sequence
        # independent reference: explicit softmax with a causal mask, kv head = h // (heads / kv)
        qh = q[rows].view(length, heads, 8)
        kh = k[rows].view(length, kv, 8).repeat_interleave(heads // kv, 1)
        vh = v[rows].view(length, kv, 8).repeat_interleave(heads // kv, 1)
        s = torch.einsum("qhd,khd->hqk", qh, kh) / math.sqrt(8)
        s = s.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
        exp = torch.einsum("hqk,khd->qhd", s.softmax(-1), vh).reshape(length, heads * 8)
        torch.testing.assert_close(got[rows], exp, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ref, exp, rtol=1e-10, atol=1e-10)


def test_packed_forward_equals_per_document_forwards(models):
    # Two MTP depths with one MTP layer: depth 2 reuses layer 0 on its own depth-1 outputs, one
    # position further (the engine's second draft step).
    target, mtp = models
    g = torch.Generator().manual_seed(5)
    lens = [9, 1, 2, 3, 16, 13]
    width = 16
    ids = torch.randint(1, V, (len(lens), width), generator=g)
    for r, n in enumerate(lens):
        ids[r, n:] = 0  # padding (the EOT id) after each document
    batch = Batch(ids, torch.tensor(lens))
    out, hidden, _ = forward_loss(target, mtp, batch, torch.device("cpu"), 0.5, return_hidden=True, mtp_depth=2)
    # brute force: each document alone, positions from 0, no attention metadata
    nll = [0.0, 0.0, 0.0]
    cnt = [0, 0, 0]
    with torch.no_grad():
        for r, n in enumerate(lens):
            doc = ids[r, :n]
            h = target(doc, torch.arange(n))
            torch.testing.assert_close(hidden[r * width:r * width + n].detach(), h, rtol=1e-5, atol=1e-5)
            lt = target.compute_logits(h)
            for i in range(n - 1):
                nll[0] -= F.log_softmax(lt[i].double(), -1)[doc[i + 1]].item()
                cnt[0] += 1
            prev = h
            for k in (1, 2):
                if n < k + 1:
                    break
                nxt = torch.cat([doc[k:], torch.zeros(k, dtype=doc.dtype)])  # token i + k at row i
                prev = mtp(nxt, torch.arange(n) + k - 1, prev, spec_step_idx=k - 1)
                lm = mtp.compute_logits(prev, k - 1)
                for i in range(n - k - 1):
                    nll[k] -= F.log_softmax(lm[i].double(), -1)[doc[i + k + 1]].item()
                    cnt[k] += 1
    assert out.counts == cnt
    means = [a / b for a, b in zip(nll, cnt)]
    assert math.isclose(out.target_loss.item(), means[0], rel_tol=1e-5)
    for k in (1, 2):
        assert math.isclose(out.mtp_losses[k - 1].item(), means[k], rel_tol=1e-5)
    assert math.isclose(out.loss.item(), means[0] + 0.5 / 2 * (means[1] + means[2]), rel_tol=1e-5)


def test_mtp_uses_zero_embedding_at_position_zero(models):
    # The token at row 0 of the MTP input must not matter (the fused_eh_norm position-0 rule).
    target, mtp = models
    doc = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        h = target(doc, torch.arange(4))
        a = mtp(torch.tensor([6, 7, 8, 0]), torch.arange(4), h)
        b = mtp(torch.tensor([99, 7, 8, 0]), torch.arange(4), h)
        c = mtp(torch.tensor([6, 99, 8, 0]), torch.arange(4), h)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a[1], c[1])


def _docs(lengths):
    arrays = [np.arange(n, dtype=np.int32) + 1 for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenDocs(np.concatenate(arrays), offsets, np.zeros(len(lengths), dtype=np.int8))


def test_bucket_batches_cover_every_document_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500)
    lengths[:3] = [300, 1, 17]
    docs = _docs(lengths)
    batches = bucket_batches(docs.lengths, 2048, 300, np.random.default_rng(1))
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(500))
    for idx in batches:
        b = make_batch(docs, idx, pad_id=0, max_len=300)
        width = b.input_ids.shape[1]
        assert b.input_ids.numel() <= 2048 and (width % 16 == 0 or width == 300)
        for r, d in enumerate(idx):
            n = int(lengths[d])
            assert b.lengths[r] == n and b.input_ids[r, :n].tolist() == list(range(1, n + 1))
            assert (b.input_ids[r, n:] == 0).all()
        ids, pos, doc_end = b.flat(torch.device("cpu"))
        for r in range(len(idx)):
            assert pos[r * width:(r + 1) * width].tolist() == list(range(width))
            assert (doc_end[r * width:(r + 1) * width] == r * width + int(b.lengths[r])).all()
    assert 0.0 <= pad_fraction(docs, 2048, 300) < 0.25
    with pytest.raises(ValueError, match="tokens_per_batch"):
        bucket_batches(docs.lengths, 100, 300, rng)
    with pytest.raises(ValueError, match="lengths"):
        bucket_batches(np.array([301]), 2048, 300, rng)


def test_chains_use_every_example_once_in_fewshot_form():
    ex = [{"question": f"Q{i}?", "answer": f"{i}+0 = <<{i}+0={i}>>{i}\n#### {i}"} for i in range(40)]
    docs = chain_documents(ex, random.Random(3), single_prob=0.5, num_shots=5)
    used = [int(q[1:]) for d in docs for q in __import__("re").findall(r"Question: (Q\d+)\?", d)]
    assert sorted(used) == list(range(40))
    sizes = [d.count("Question:") for d in docs]
    assert set(sizes[:-1]) <= {1, 6} and 1 in sizes and 6 in sizes
    for d in docs:
        assert d.endswith(EOT) and d.count(EOT) == 1
        parts = d[:-len(EOT)].split("\n\n")
        if len(parts) == 6:
            qs = [{"question": p.split("\n")[0][len("Question: "):], "answer": p.split("Answer: ", 1)[1]} for p in parts]
            assert d == fewshot_prompt(qs[:5], qs[5]["question"]) + " " + qs[5]["answer"] + EOT


def test_generate_examples_parallel_matches_serial():
    a = generate_examples(20_500, seed=4, workers=1)
    b = generate_examples(20_500, seed=4, workers=2)
    assert a == b


def test_master_weight_adamw_matches_fp32_adamw():
    torch.manual_seed(0)
    w32 = torch.nn.Parameter(torch.randn(8, 5))
    b32 = torch.nn.Parameter(torch.randn(5))
    wbf = torch.nn.Parameter(w32.detach().to(torch.bfloat16).float().to(torch.bfloat16))
    bbf = torch.nn.Parameter(b32.detach().to(torch.bfloat16))
    ref_w = torch.nn.Parameter(wbf.detach().float().clone())
    ref_b = torch.nn.Parameter(bbf.detach().float().clone())
    ref = torch.optim.AdamW([{"params": [ref_w], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
                            lr=0.01, betas=(0.9, 0.95))
    opt = MasterWeightAdamW([wbf, bbf], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        gw, gb = torch.randn(8, 5).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)
        wbf.grad, bbf.grad = gw.clone(), gb.clone()
        ref_w.grad, ref_b.grad = gw.float(), gb.float()
        opt.step(grad_clip=0)
        opt.zero_grad()
        ref.step()
    torch.testing.assert_close(opt.masters[0], ref_w.detach(), rtol=0, atol=0)
    torch.testing.assert_close(opt.masters[1], ref_b.detach(), rtol=0, atol=0)
    assert wbf.dtype == torch.bfloat16 and torch.equal(wbf.detach(), ref_w.detach().to(torch.bfloat16))


def test_grad_clip_and_lr_schedule():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = MasterWeightAdamW([p], lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert opt.step(grad_clip=1.0) == pytest.approx(5.0)
    assert lr_at(0, 0.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(50, 0.5, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert lr_at(99, 1.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(99, 3.0, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_router_balancer_pushes_bias_towards_idle_experts(models):
    target, mtp = models
    bal = RouterBalancer([target, mtp.model], speed=0.01)
    assert bal.gates
    before = [g.e_score_correction_bias.detach().clone() for g in bal.gates]
    x = torch.randint(0, V, (64,))
    hidden = target(x, torch.arange(64))
    hidden.sum().backward()  # grads enabled: the hook counts
    g0 = bal.gates[0]
    c = bal.counts[id(g0)].clone()
    assert c.sum() == 64 * g0.top_k
    worst = bal.step()
    assert worst == pytest.approx(float(c.max() / c.mean())) and not bal.counts
    delta = g0.e_score_correction_bias.detach() - before[0]
    torch.testing.assert_close(delta, 0.01 * torch.sign(c.mean() - c))
    assert not g0.e_score_correction_bias.requires_grad
    target.zero_grad(set_to_none=True)
    mtp.zero_grad(set_to_none=True)


def test_saved_moe_checkpoint_matches_transformers(models, tmp_path):
    # The config dict of the recipe (tied embeddings, q/k/v bias, half rotary, MoE after the
    # first layer, MTP layer) means the same model to transformers as to mtpspec.
    import json

    import transformers

    from mtpspec.models import export_hf_state_dict, save_checkpoint
    target, mtp = models
    with torch.no_grad():
        for m in target.modules():
            if hasattr(m, "e_score_correction_bias") and m.e_score_correction_bias is not None:
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.3)
    raw = make_config_dict("ci", V, 0, num_hidden_layers=2)
    raw["torch_dtype"] = "float32"
    save_checkpoint(str(tmp_path), export_hf_state_dict(target, mtp), raw)
    assert "lm_head.weight" not in json.dumps(list(export_hf_state_dict(target, mtp)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, V, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = target.compute_logits(target(ids, torch.arange(37)))
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
