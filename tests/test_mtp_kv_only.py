"""The MTP KV-only pass (a step without drafts, k = 0) writes exactly the cache entries of the full pass.

For GLM-4.5 (GQA, qk-norm and q/k/v bias), DeepSeek-V3 (MLA) and DeepSeek-V3.2 (DSA: MLA + indexer keys):
two copies of the same randomly filled caches, the MTP model's ``forward`` on one and ``forward_kv_only``
on the other under the same metadata (a prefill from position 0, a decode row and a 3-row verify segment,
rows in the middle of blocks, a padding row); every cache (attention, indexer keys, the other MTP layer's)
must be bit-equal afterwards, the written slots must have changed and every other slot must still hold
the fill. Bit-equal on the CPU: the KV-only pass runs the forward's ops in the forward's order on the same
rows (the GQA K/V GEMM on the K/V rows of the fused weight gives the same dot products on the CPU torch
path). Also with an fp8 KV cache (non-unit ``k_scale`` / ``v_scale``), the proposer's ``write_kv_only``
against ``propose``'s first pass, FP8 weights in ``QKVParallelLinear.forward_kv``, and tp 2 (gloo ranks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mtpspec.distributed import launch
from mtpspec.layers.attention import (allocate_kv_caches, build_attention_metadata, collect_attention_layers,
                                      set_forward_context)
from mtpspec.models import load_models
from tiny_models import make_tiny_checkpoint

FAMILIES = {"glm4_moe": dict(num_mtp_layers=2, use_qk_norm=True, attention_bias=True),
            "deepseek_v3": dict(num_mtp_layers=1),
            "deepseek_v32": dict(num_mtp_layers=2)}
BS, NUM_BLOCKS = 4, 12
#: (query_len, seq_len, blocks): a prefill from position 0, a decode row, a verify segment mid-block
SEQS = [(6, 6, [5, 0]), (1, 7, [2, 7]), (3, 11, [1, 3, 9])]
FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for i, (family, kw) in enumerate(FAMILIES.items()):
        path = str(tmp_path_factory.mktemp(family))
        make_tiny_checkpoint(path, seed=70 + i, family=family, **kw)
        out[family] = path
    return out


def step_inputs(cfg, seed=0, padding=1):
    """``(ids, pos, prev, meta)`` of :data:`SEQS` plus ``padding`` rows (slot -1)."""
    g = torch.Generator().manual_seed(seed)
    meta = build_attention_metadata([q for q, _, _ in SEQS], [s for _, s, _ in SEQS], [b for _, _, b in SEQS], BS,
                                    num_tokens=sum(q for q, _, _ in SEQS) + padding)
    t = meta.slot_mapping.shape[0]
    pos = torch.cat([torch.arange(s - q, s) for q, s, _ in SEQS] + [torch.zeros(padding, dtype=torch.long)])
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    prev = torch.randn(t, cfg.hidden_size, generator=g)
    return ids, pos, prev, meta


def fill_caches(model, dtype, seed=9):
    """Allocate ``model``'s caches and fill them with the same random values every time; fp8 caches get
    non-unit scales (set on the layers, as the forward's write reads them)."""
    caches = allocate_kv_caches(model, num_blocks=NUM_BLOCKS, block_size=BS, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    if dtype == FP8:
        for layer in collect_attention_layers(model):
            layer.k_scale, layer.v_scale = 0.5, 0.25
    return caches


def slot_rows(c):
    """A cache as ``[num_slots, ...]`` (GQA ``[2, nb, bs, h, d]`` -> ``[nb * bs, 2, h, d]``)."""
    return c.flatten(1, 2).transpose(0, 1) if c.dim() == 5 else c.flatten(0, 1)


def bits(c):
    return c.view(torch.uint8) if c.dtype == FP8 else c


def run_pass(mtp, inputs, dtype, step, kv_only):
    ids, pos, prev, meta = inputs
    fill_caches(mtp, dtype)
    with torch.no_grad(), set_forward_context(meta):
        if kv_only:
            assert mtp.forward_kv_only(ids, pos, prev, spec_step_idx=step) is None
        else:
            mtp(ids, pos, prev, spec_step_idx=step)
    return [c.clone() for c in (layer.kv_cache for layer in collect_attention_layers(mtp))]


def check_same_writes(mtp, inputs, dtype, step):
    """Both passes leave bit-equal caches; the used layer's written slots changed, all else is the fill."""
    meta = inputs[3]
    initial = [c.clone() for c in fill_caches(mtp, dtype)]
    full = run_pass(mtp, inputs, dtype, step, kv_only=False)
    kv = run_pass(mtp, inputs, dtype, step, kv_only=True)
    used = set(map(id, collect_attention_layers(mtp.get_layer(step))))
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    others = torch.ones(NUM_BLOCKS * BS, dtype=torch.bool)
    others[written] = False
    layers = collect_attention_layers(mtp)
    n_used = 0
    for layer, c0, cf, ck in zip(layers, initial, full, kv):
        assert torch.equal(bits(ck), bits(cf)), f"{type(layer).__name__}: kv-only cache differs from forward's"
        r0, rk = slot_rows(bits(c0)), slot_rows(bits(ck))
        if id(layer) in used:
            n_used += 1
            assert torch.equal(rk[others], r0[others])
            changed = (rk[written] != r0[written]).flatten(1).any(1)
            assert bool(changed.all()), f"{type(layer).__name__}: a written slot kept its fill"
        else:
            assert torch.equal(rk, r0), "another MTP layer's cache was touched"
    return n_used


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=["model_dtype", "fp8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_only_writes_what_forward_writes(ckpts, family, dtype):
    target, mtp = load_models(ckpts[family], dtype=torch.float32, device="cpu")
    inputs = step_inputs(target.config)
    for step in range(mtp.num_mtp_layers + 1):  # the last step wraps to layer 0
        n_used = check_same_writes(mtp, inputs, dtype, step)
        assert n_used == (2 if family == "deepseek_v32" else 1)  # DSA: latent + indexer keys


def test_kv_only_runs_no_query_and_no_indexer_selection(ckpts):
    """Only the K/V side runs: no q_a_proj / q_b_proj, no o_proj, no MLP, no indexer scoring, and the
    layer's recorded selection is left alone."""
    import mtpspec.attention.backends.indexer as backend
    target, mtp = load_models(ckpts["deepseek_v32"], dtype=torch.float32, device="cpu")
    ids, pos, prev, meta = step_inputs(target.config)
    fill_caches(mtp, torch.float32)
    attn = mtp.get_layer(0).mtp_block.self_attn
    calls = []
    hooks = [m.register_forward_hook(lambda m, i, o, n=name: calls.append(n))
             for name, m in (("q_a_proj", attn.q_a_proj), ("q_b_proj", attn.q_b_proj), ("o_proj", attn.o_proj),
                             ("wq_b", attn.indexer.wq_b), ("weights_proj", attn.indexer.weights_proj),
                             ("mlp", mtp.get_layer(0).mtp_block.mlp))]
    real = backend.indexer_logits
    backend.indexer_logits = lambda *a, **k: calls.append("scoring") or real(*a, **k)
    try:
        with torch.no_grad(), set_forward_context(meta):
            mtp.forward_kv_only(ids, pos, prev)
            assert calls == [] and mtp.index_selection(0) is None
            mtp(ids, pos, prev)
        assert {"q_a_proj", "q_b_proj", "o_proj", "wq_b", "weights_proj", "mlp", "scoring"} <= set(calls)
    finally:
        backend.indexer_logits = real
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=["model_dtype", "fp8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_only_layer_has_no_host_sync(ckpts, family, dtype):
    """The layer's KV-only pass (what a CUDA graph would capture) on metadata without host lists makes
    no device -> host copy and writes what it writes with them."""
    import copy

    from test_paged_attention import no_host_sync
    target, mtp = load_models(ckpts[family], dtype=torch.float32, device="cpu")
    ids, pos, prev, meta = step_inputs(target.config)
    bare = copy.copy(meta)
    bare.query_lens, bare.seq_lens_list = [], []
    emb = mtp.embed_tokens(ids)
    results = []
    for m, guard in ((meta, contextlib.nullcontext), (bare, no_host_sync)):
        fill_caches(mtp, dtype)
        with torch.no_grad(), set_forward_context(m), guard():
            mtp.get_layer(0).forward_kv_only(emb, pos, prev)
        results.append([bits(layer.kv_cache).clone() for layer in collect_attention_layers(mtp)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("block", [(32, 16), (48, 16)], ids=["block_aligned", "per_row_scales"])
def test_qkv_forward_kv_equals_forward_columns_with_fp8_weights(block):
    """FP8 block-scaled QKV: the K/V rows sliced with their scales (aligned: 128-style blocks of 32 rows at
    q_size 64; unaligned shards keep per-row scales) give forward's k / v columns bit for bit (CPU path)."""
    from mtpspec.layers.fp8 import fp8_weights
    from mtpspec.layers.linear import QKVParallelLinear
    with fp8_weights(block):
        p = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    p.weight.data.copy_(torch.randn(p.weight.shape, generator=g).to(FP8))
    p.weight_scale_inv.data.copy_(torch.rand(p.weight_scale_inv.shape, generator=g) + 0.5)
    p.bias.data.copy_(torch.randn(p.bias.shape, generator=g))
    x = torch.randn(7, 64, generator=g)
    assert p.scale_block_n == (32 if block[0] == 32 else 1)
    assert torch.equal(p.forward_kv(x), p(x)[:, p.q_size:])


# ------------------------------------------------------------------------------------------- the proposer
class FirstPassOnly:
    """A DraftForward whose draft steps do nothing: ``propose`` then leaves only its first pass's writes."""

    def __init__(self, fwd):
        self.fwd, self.kv_only_layers = fwd, []

    def mtp_first(self, *a):
        return self.fwd.mtp_first(*a)

    def mtp_first_top(self, *a):
        return self.fwd.mtp_first_top(*a)

    def mtp_step(self, ids, pos, hidden, meta, step, top):
        return hidden, (torch.zeros_like(ids) if top is not None else None)

    def mtp_kv_only(self, ids, pos, hidden, meta, step):
        self.kv_only_layers.append(step)
        return self.fwd.mtp_kv_only(ids, pos, hidden, meta, step)


def prepared_step(cfg, seed=1):
    from mtpspec.step_io import PreparedStep
    ids, pos, prev, meta = step_inputs(cfg, seed, padding=0)
    q = [a for a, _, _ in SEQS]
    starts = [s - a for a, s, _ in SEQS]
    seg = torch.tensor([0, q[0], q[0] + q[1]])
    inp = PreparedStep(input_ids=ids, positions=pos, attn_metadata=meta, block_tables=meta.block_tables,
                       start_positions=torch.tensor(starts), seg_starts=seg, sample_rows=seg, num_decodes=2,
                       num_prefills=1, k=0, draft_token_ids=None, decode_meta=None, prefill_meta=None,
                       accept_uniforms=None, decode_sample_uniforms=None, prefill_uniforms=None,
                       host_query_lens=q, host_start_positions=starts)
    return inp, prev


@pytest.mark.parametrize("family,k", [("deepseek_v32", 2), ("glm4_moe", 1)])
def test_proposer_write_kv_only_equals_first_pass(ckpts, family, k):
    """``write_kv_only`` leaves the caches ``propose``'s first pass leaves (every used layer, DSA keys too),
    through ``fwd.mtp_kv_only`` once per used layer; DSA index sharing stays off and records nothing."""
    from mtpspec.spec_decode.draft_forward import EagerDraftForward
    from mtpspec.spec_decode.mtp_proposer import MTPProposer
    target, mtp = load_models(ckpts[family], dtype=torch.float32, device="cpu")
    share = family == "deepseek_v32"
    prop = MTPProposer(mtp, k, False, BS, target.config.max_position_embeddings, index_share=share, max_num_seqs=4)
    inp, hidden = prepared_step(target.config)
    new = torch.tensor([11, 12, 13])
    last = torch.tensor([5, 0, 1])  # the prefill's last row, the decode, the verify's second row
    fwd = FirstPassOnly(EagerDraftForward(mtp))
    fill_caches(mtp, torch.float32)
    prop.propose(inp, hidden, new, last, fwd=fwd)
    ref = [c.clone() for c in (layer.kv_cache for layer in collect_attention_layers(mtp))]
    fill_caches(mtp, torch.float32)
    initial = [c.clone() for c in (layer.kv_cache for layer in collect_attention_layers(mtp))]
    before = [(s.anchor_rows.clone(), s.anchor_sel.clone(), s.anchor_pos.clone()) for s in prop.index_share]
    for s in prop.index_share:
        s.set_mode("record")  # a stale mode must not make the kv-only pass record
    assert prop.write_kv_only(inp, hidden, new, last, fwd=fwd) is None
    assert fwd.kv_only_layers == prop._used_layers() == list(range(min(k, mtp.num_mtp_layers)))
    got = [layer.kv_cache for layer in collect_attention_layers(mtp)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert sum(not torch.equal(a, b) for a, b in zip(got, initial)) == (4 if share else 1)
    for s, (rows, sel, apos) in zip(prop.index_share, before):
        assert s.mode == "off" and s.num_scoring_calls == 1  # its layer's first pass in propose only
        assert torch.equal(s.anchor_sel, sel) and torch.equal(s.anchor_pos, apos) and torch.equal(s.anchor_rows, rows)
    # the shifted ids matter: the new token at the last valid row, not the row's own next id
    fill_caches(mtp, torch.float32)
    prop.write_kv_only(inp, hidden, torch.tensor([14, 12, 13]), last, fwd=fwd)
    assert not all(torch.equal(layer.kv_cache, r) for layer, r in zip(collect_attention_layers(mtp), ref))


# ------------------------------------------------------------------------------------------------- tp 2
def _rank_caches(path, family, dtype, sequence_parallel=False):
    """This rank's MTP caches after forward and after forward_kv_only (each layer, each step)."""
    target, mtp = load_models(path, dtype=torch.float32, device="cpu", sequence_parallel=sequence_parallel)
    inputs = step_inputs(target.config)
    out = []
    for step in range(mtp.num_mtp_layers):
        full = run_pass(mtp, inputs, dtype, step, kv_only=False)
        kv = run_pass(mtp, inputs, dtype, step, kv_only=True)
        out.append(([bits(c) for c in full], [bits(c) for c in kv]))
    return out


@pytest.mark.parametrize("family,sp", [("glm4_moe", False), ("deepseek_v32", False), ("glm4_moe", True)])
def test_kv_only_tp2_equals_forward_on_each_rank(ckpts, family, sp):
    """At tp 2 (gloo): GQA kv heads split by rank, MLA / indexer replicated; each rank's caches agree
    (``sp``: against the sequence-parallel forward, whose eh_proj runs on token shards)."""
    runs = launch(_rank_caches, 2, ckpts[family], family, torch.float32, sp, timeout_s=300)
    for rank, steps in enumerate(runs):
        for full, kv in steps:
            for a, b in zip(full, kv):
                assert torch.equal(a, b), f"rank {rank}"
    if family == "glm4_moe":  # the ranks hold different kv heads
        assert not torch.equal(runs[0][0][0][0], runs[1][0][0][0])
