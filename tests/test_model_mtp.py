"""MTP draft layers at tp 1 against an independent float64 reference written here in plain torch from
the checkpoint tensors (Hugging Face names), plus the known-fault checks: layer choice for
k > number of layers, the position-0 rule, post-norm recycling, a tied head, padding rows, and the
MTP layers' own KV cache. (tp 2 / 4, the fused / baseline / sequence-parallel arms: test_model_tp.py.)
"""

import math

import pytest
import torch

from mtpspec.layers.attention import (
    allocate_kv_caches, build_attention_metadata, collect_attention_layers, set_forward_context)
from mtpspec.models import load_models, save_checkpoint, supports_local_argmax
from mtpspec.models.loader import read_checkpoint_tensors
from tiny_models import make_tiny_checkpoint

ATOL, RTOL = 1e-4, 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    # Two MTP layers with distinct weights; final-norm weights far from 1 (post- vs pre-norm differ).
    path = str(tmp_path_factory.mktemp("two"))
    _, cfg = make_tiny_checkpoint(path, seed=21, num_mtp_layers=2, use_qk_norm=True, attention_bias=True)
    tensors = dict(read_checkpoint_tensors(path))
    g = torch.Generator().manual_seed(5)
    for k in range(2):
        tensors[f"model.layers.{cfg.num_hidden_layers + k}.shared_head.norm.weight"] = \
            3.0 + 3.0 * torch.rand(cfg.hidden_size, generator=g)
    import json
    import os
    raw = json.load(open(os.path.join(path, "config.json")))
    save_checkpoint(path, tensors, raw)
    out["two"] = path
    out["one"] = str(tmp_path_factory.mktemp("one"))
    make_tiny_checkpoint(out["one"], seed=22, num_mtp_layers=1)
    out["nohead"] = str(tmp_path_factory.mktemp("nohead"))
    make_tiny_checkpoint(out["nohead"], seed=23, num_mtp_layers=1, mtp_head=False)
    out["nohead_tied"] = str(tmp_path_factory.mktemp("nohead_tied"))
    make_tiny_checkpoint(out["nohead_tied"], seed=24, num_mtp_layers=1, mtp_head=False, tie_word_embeddings=True)
    return out


# ----------------------------------------------------------------------------- float64 reference
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, hd, rot, base):
    """Neox-style partial rotary (pairs i, i + rot/2) by the RoFormer pair formula, float64."""
    out = x.clone()
    half = rot // 2
    for i in range(half):
        ang = pos.double() * base ** (-2.0 * i / rot)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[..., i], x[..., i + half]
        out[..., i], out[..., i + half] = a * c - b * s, b * c + a * s
    return out


def ref_mtp_layer(tensors, cfg, k, input_ids, positions, prev, seq_lens, pre_norm=False):
    """One MTP layer step in float64. Sequences are consecutive row segments of ``seq_lens``
    rows, each attending causally within itself. Returns the post-norm state (or the pre-norm
    residual sum when ``pre_norm``)."""
    p = f"model.layers.{cfg.num_hidden_layers + k}."
    w = lambda n: tensors[p + n].double()  # noqa: E731
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    t = len(input_ids)
    emb = tensors["model.embed_tokens.weight"].double()[input_ids].clone()
    emb[positions == 0] = 0.0
    x = torch.cat([_rms(emb, w("enorm.weight"), eps), _rms(prev.double(), w("hnorm.weight"), eps)], -1)
    x = x @ w("eh_proj.weight").T
    # --- decoder block (attention) ---
    h = _rms(x, w("input_layernorm.weight"), eps)
    proj = {}
    for n, heads in (("q", nh), ("k", nkv), ("v", nkv)):
        y = h @ w(f"self_attn.{n}_proj.weight").T
        if cfg.attention_bias:
            y = y + w(f"self_attn.{n}_proj.bias")
        y = y.view(t, heads, hd)
        if cfg.use_qk_norm and n in ("q", "k"):
            y = _rms(y, w(f"self_attn.{n}_norm.weight"), eps)
        if n in ("q", "k"):
            y = _rope(y, positions, hd, cfg.rotary_dim, cfg.rope_theta)
        proj[n] = y
    attn = torch.zeros(t, nh, hd, dtype=torch.float64)
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        for head in range(nh):
            kvh = head // (nh // nkv)
            s = proj["q"][sl, head] @ proj["k"][sl, kvh].T / math.sqrt(hd)
            s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            attn[sl, head] = torch.softmax(s, -1) @ proj["v"][sl, kvh]
        start += n
    x = x + attn.view(t, nh * hd) @ w("self_attn.o_proj.weight").T
    # --- MoE ---
    h = _rms(x, w("post_attention_layernorm.weight"), eps)
    scores = torch.sigmoid(h @ w("mlp.gate.weight").T)
    choice = scores + w("mlp.gate.e_score_correction_bias")
    e, per = cfg.n_routed_experts, cfg.n_routed_experts // cfg.n_group
    moe = torch.zeros_like(x)
    for r in range(t):
        gsc = [choice[r, g * per:(g + 1) * per].topk(min(2, per)).values.sum().item() for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: -gsc[g])[:cfg.topk_group]
        allowed = [x_ for g in groups for x_ in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda x_: -choice[r, x_].item())[:cfg.num_experts_per_tok]
        wts = scores[r, chosen]
        if cfg.norm_topk_prob:
            wts = wts / wts.sum()
        wts = wts * cfg.routed_scaling_factor
        for wt, x_ in zip(wts, chosen):
            a = w(f"mlp.experts.{x_}.gate_proj.weight") @ h[r]
            b = w(f"mlp.experts.{x_}.up_proj.weight") @ h[r]
            moe[r] += wt * (w(f"mlp.experts.{x_}.down_proj.weight") @ (a * torch.sigmoid(a) * b))
    a = h @ w("mlp.shared_experts.gate_proj.weight").T
    b = h @ w("mlp.shared_experts.up_proj.weight").T
    moe = moe + (a * torch.sigmoid(a) * b) @ w("mlp.shared_experts.down_proj.weight").T
    x = x + moe
    return x if pre_norm else _rms(x, w("shared_head.norm.weight"), eps)


def _head(tensors, cfg, k):
    key = f"model.layers.{cfg.num_hidden_layers + k}.shared_head.head.weight"
    return tensors[key].double() if key in tensors else tensors.get("lm_head.weight",
                                                                    tensors["model.embed_tokens.weight"]).double()


def _inputs(cfg, seq_lens, seed):
    """Draft-step inputs for sequences of ``seq_lens`` rows: ids, positions 0.., random prev states."""
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    prev = torch.randn(t, cfg.hidden_size, generator=g) * 2
    return ids, pos, prev


def _run(mtp, ids, pos, prev, seq_lens, step):
    meta = build_attention_metadata(seq_lens, seq_lens, None)
    with set_forward_context(meta), torch.no_grad():
        return mtp(ids, pos, prev, spec_step_idx=step)


# ----------------------------------------------------------------------------- tests
def test_mtp_matches_float64_reference_layer_choice_and_chain(ckpts):
    """2 layers, k = 3: steps use layers 0, 1, 0; each step recycles the previous step's output."""
    path = ckpts["two"]
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    tensors = dict(read_checkpoint_tensors(path))
    cfg = mtp.config
    assert mtp.num_mtp_layers == 2 and supports_local_argmax(mtp)
    assert [mtp.layer_index(s) for s in range(3)] == [0, 1, 0]
    seq_lens = [6, 3]
    ids, pos, prev = _inputs(cfg, seq_lens, 1)
    ref_prev = prev.double()
    for step in range(3):
        out = _run(mtp, ids, pos, prev, seq_lens, step)
        ref = ref_mtp_layer(tensors, cfg, step % 2, ids, pos, ref_prev, seq_lens)
        other = ref_mtp_layer(tensors, cfg, 1 - step % 2, ids, pos, ref_prev, seq_lens)
        torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
        assert (out.double() - other).abs().max() > 0.1  # the layers really differ
        logits = mtp.compute_logits(out, spec_step_idx=step)
        torch.testing.assert_close(logits.double(), ref @ _head(tensors, cfg, step % 2).T, atol=5e-4, rtol=RTOL)
        assert torch.equal(mtp.get_top_tokens(out, spec_step_idx=step), logits.argmax(-1))
        # Recycle: the next step's previous hidden states are this step's post-norm output.
        prev, ref_prev = out, ref
        ids = torch.roll(ids, -1)


def test_single_layer_used_for_every_step(ckpts):
    path = ckpts["one"]
    _, mtp = load_models(path, dtype=torch.float32, device="cpu")
    tensors = dict(read_checkpoint_tensors(path))
    ids, pos, prev = _inputs(mtp.config, [5], 2)
    assert [mtp.layer_index(s) for s in range(3)] == [0, 0, 0]
    ref = ref_mtp_layer(tensors, mtp.config, 0, ids, pos, prev, [5])
    for step in range(3):
        torch.testing.assert_close(_run(mtp, ids, pos, prev, [5], step).double(), ref, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="spec_step_idx"):
        mtp.get_layer(-1)


def test_position0_embedding_row_zeroed_and_no_other(ckpts):
    _, mtp = load_models(ckpts["one"], dtype=torch.float32, device="cpu")
    cfg, h = mtp.config, mtp.config.hidden_size
    seq_lens = [4, 1, 3]  # rows 0, 4 and 5 are at position 0
    ids, pos, prev = _inputs(cfg, seq_lens, 3)
    layer = mtp.get_layer(0)
    eh = layer.eh_input(mtp.embed_tokens(ids), pos, prev)
    zero_rows = (eh[:, :h] == 0).all(-1)
    assert zero_rows.tolist() == (pos == 0).tolist()
    assert (eh[:, h:] != 0).any(-1).all()  # the hidden-state half is never zeroed
    base = _run(mtp, ids, pos, prev, seq_lens, 0)
    ids2 = ids.clone()
    ids2[pos == 0] = (ids2[pos == 0] + 17) % cfg.vocab_size  # tokens at position 0 do not matter
    assert torch.equal(_run(mtp, ids2, pos, prev, seq_lens, 0), base)
    ids3 = ids.clone()
    ids3[2] = (ids3[2] + 17) % cfg.vocab_size  # a token at position 2 does
    changed = (_run(mtp, ids3, pos, prev, seq_lens, 0) - base).abs().amax(-1) > 0
    assert changed.tolist() == [False, False, True, True, False, False, False, False]


def test_recycled_state_is_post_norm(ckpts):
    """Final-norm weights in [3, 6]: the output equals the post-norm reference and is far from the
    pre-norm residual sum and from a doubly-normed state; the logits apply only the head."""
    path = ckpts["two"]
    _, mtp = load_models(path, dtype=torch.float32, device="cpu")
    tensors = dict(read_checkpoint_tensors(path))
    cfg = mtp.config
    ids, pos, prev = _inputs(cfg, [7], 4)
    out = _run(mtp, ids, pos, prev, [7], 0).double()
    post = ref_mtp_layer(tensors, cfg, 0, ids, pos, prev, [7])
    pre = ref_mtp_layer(tensors, cfg, 0, ids, pos, prev, [7], pre_norm=True)
    wn = tensors[f"model.layers.{cfg.num_hidden_layers}.shared_head.norm.weight"].double()
    twice = _rms(post, wn, cfg.rms_norm_eps)
    torch.testing.assert_close(out, post, atol=ATOL, rtol=RTOL)
    assert (out - pre).abs().max() > 1.0 and (out - twice).abs().max() > 1.0
    logits = mtp.compute_logits(out.float()).double()
    torch.testing.assert_close(logits, post @ _head(tensors, cfg, 0).T, atol=5e-4, rtol=RTOL)
    assert (logits - twice @ _head(tensors, cfg, 0).T).abs().max() > 1.0


@pytest.mark.parametrize("name", ["nohead", "nohead_tied"])
def test_missing_head_is_tied_to_lm_head(ckpts, name):
    target, mtp = load_models(ckpts[name], dtype=torch.float32, device="cpu")
    layer = mtp.get_layer(0)
    assert layer.shared_head.tied and layer.shared_head.head is target.lm_head
    if name == "nohead_tied":
        assert target.lm_head.weight is target.model.embed_tokens.weight
    ids, pos, prev = _inputs(mtp.config, [5], 5)
    out = _run(mtp, ids, pos, prev, [5], 0)
    logits = mtp.compute_logits(out)
    assert torch.isfinite(logits).all() and logits.abs().max() > 1.0
    assert torch.equal(logits, target.compute_logits(out))
    tensors = dict(read_checkpoint_tensors(ckpts[name]))
    ref = ref_mtp_layer(tensors, mtp.config, 0, ids, pos, prev, [5]) @ _head(tensors, mtp.config, 0).T
    torch.testing.assert_close(logits.double(), ref, atol=5e-4, rtol=RTOL)


def test_padding_rows_stay_finite_and_isolated(ckpts):
    """CUDA-graph padding: zero embeddings ids, position 0, zero hidden states, slot -1 rows after the
    real tokens. They give finite (zero-input) rows and leave the real rows unchanged."""
    _, mtp = load_models(ckpts["one"], dtype=torch.float32, device="cpu")
    ids, pos, prev = _inputs(mtp.config, [6], 6)
    base = _run(mtp, ids, pos, prev, [6], 0)
    pad = 5
    meta = build_attention_metadata([6], [6], None, num_tokens=6 + pad)
    with set_forward_context(meta), torch.no_grad():
        out = mtp(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]),
                  torch.cat([pos, torch.zeros(pad, dtype=torch.long)]),
                  torch.cat([prev, torch.zeros(pad, mtp.config.hidden_size)]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:6], base, atol=1e-6, rtol=1e-6)
    # An all-zero row (zero embedding at position 0, zero hidden state) is finite too.
    with torch.no_grad():
        z = mtp(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros(1, mtp.config.hidden_size))
    assert torch.isfinite(z).all()


def test_mtp_layers_have_their_own_kv_cache(ckpts):
    """Prefill 7 draft rows through the MTP layers' paged cache, then one decode row: equals the
    no-cache forward of all 8 rows."""
    target, mtp = load_models(ckpts["two"], dtype=torch.float32, device="cpu")
    layers = collect_attention_layers(mtp)
    assert len(layers) == 2 and not set(map(id, layers)) & set(map(id, collect_attention_layers(target)))
    ids, pos, prev = _inputs(mtp.config, [8], 7)
    full = _run(mtp, ids, pos, prev, [8], 1)
    allocate_kv_caches(mtp, num_blocks=6, block_size=2, dtype=torch.float32)
    table = [[5, 0, 3, 1]]
    with torch.no_grad():
        with set_forward_context(build_attention_metadata([7], [7], table, 2)):
            first = mtp(ids[:7], pos[:7], prev[:7], spec_step_idx=1)
        with set_forward_context(build_attention_metadata([1], [8], table, 2)):
            last = mtp(ids[7:], pos[7:], prev[7:], spec_step_idx=1)
    torch.testing.assert_close(torch.cat([first, last]), full, atol=1e-5, rtol=1e-5)
    assert layers[0].kv_cache.abs().sum() == 0 and layers[1].kv_cache.abs().sum() > 0  # only layer 1 ran
