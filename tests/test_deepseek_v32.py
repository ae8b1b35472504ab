"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DSA layers, config, target, MTP, engine and loader errors.

Tiny random checkpoints written by ``transformers``' own ``DeepseekV32ForCausalLM.save_pretrained``
(random non-trivial norm weights, LayerNorm biases; ``index_topk`` 6, so prompts of 7+ tokens
really prune) plus random MTP layers with their own indexers (``tests/tiny_models.py``,
``family="deepseek_v32"``). GLM-5 reuses the helpers here (``tests/test_glm_moe_dsa.py``).

* layers: the indexer selects what ``transformers``' ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``
  select (both rope layouts, paged and not); sparse MLA with the whole context selected equals
  dense MLA (paged, block boundaries, length-1 sequences, graph padding rows, no cache) and with a
  partial selection equals a float64 masked-softmax reference; the KV sizing counts the indexer
  caches;
* ``precomputed_topk_pos`` (the MTP index-sharing seam): skips the scoring, still writes the
  indexer keys, is clamped to each row's causal range, and ``DeepseekV32MTP.index_selection``
  reads back what a layer used;
* target logits equal ``transformers`` (fp32, eager) at tp 1, 2 and 4 (one prompt at a time, a
  padded varlen batch, the paged caches: chunked prefill then decode), for default rope and YaRN;
  the selection really prunes there (dense attention gives other logits) and no top-k boundary
  is a near-tie (so the comparison is well posed);
* MTP: tp 2 / 4 equal tp 1, fused / baseline / SP tails agree, ``get_top_tokens`` = argmax, layer
  ``k`` equals an independent float64 reference built from ``transformers``' own
  ``DeepseekV32DecoderLayer`` with the MTP weights, and the MTP layer uses its own indexer, never
  the target's;
* engine: greedy == ``transformers`` ``generate``; MTP speculative decoding (2 MTP layers, k 1
  and 3, fused / unfused / SP, local argmax on / off, tp 1 and 2, the CUDA-graph code path with
  padded batches, run under the no-host-sync guard) emits exactly the plain greedy tokens;
* loader: a missing indexer tensor (target and MTP layer) or a wrong shape is named before any
  module is built; export round-trips.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch

torch.set_num_threads(1)

from mtpspec.config import ModelConfig, ModelConfigError
from mtpspec.distributed import launch
from mtpspec.layers.attention import (allocate_kv_caches, build_attention_metadata, collect_attention_layers,
                                      set_forward_context)
from mtpspec.models import load_models
from tiny_models import DSV3_YARN, DSV32_TINY_CONFIG, hf_mtp_block_reference, make_tiny_checkpoint

FAMILY = "deepseek_v32"
VARIANTS = {
    # default rope, 2 MTP layers with their own heads
    "default": dict(num_mtp_layers=2),
    # YaRN, tied MTP head, 4 groups pick 2, no top-k renormalisation
    "yarn_tied": dict(num_mtp_layers=1, mtp_head=False, rope_parameters=DSV3_YARN, n_group=4, topk_group=2,
                      num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=2.0),
}
PROMPT_LENS = (1, 7, 13, 4, 16)
ATOL, RTOL = 2e-4, 2e-5
MTP_ATOL, MTP_RTOL = 1e-4, 1e-5
#: smallest score gap allowed at a top-k boundary (ours and transformers' scores differ by rounding only)
MIN_BOUNDARY_GAP = 1e-5


# ------------------------------------------------------------------------------------------------ helpers
class TopkGuard:
    """Records, for every ``indexer_topk`` call of this process, how many rows had more selectable
    positions than ``index_topk`` (pruned) and the smallest score gap at any top-k boundary."""

    def __init__(self) -> None:
        self.calls = 0
        self.pruned_rows = 0
        self.min_gap = float("inf")

    @contextlib.contextmanager
    def active(self):
        import mtpspec.attention.backends.indexer as backend
        real = backend.indexer_topk

        def guarded(logits, k):
            self.calls += 1
            finite = torch.isfinite(logits).sum(-1)
            rows = finite > k
            self.pruned_rows += int(rows.sum())
            if bool(rows.any()):
                v = torch.sort(logits[rows], dim=-1, descending=True).values
                self.min_gap = min(self.min_gap, float((v[:, k - 1] - v[:, k]).min()))
            return real(logits, k)
        backend.indexer_topk = guarded
        try:
            yield self
        finally:
            backend.indexer_topk = real

    def assert_well_posed(self, min_pruned: int = 1) -> None:
        assert self.calls > 0 and self.pruned_rows >= min_pruned, (self.calls, self.pruned_rows)
        assert self.min_gap > MIN_BOUNDARY_GAP, f"a top-k boundary is a near-tie ({self.min_gap}); change the seed"


def make_setup(tmp_path_factory, family, variants, prompt_lens, seed0, target_checks, extras):
    """Checkpoints for ``variants`` and one launch per tp size (1 in this process with the
    :class:`TopkGuard`, 2 and 4 as gloo ranks) running every target / MTP check."""
    from test_model_tp import make_check_inputs, rank_all_checks
    g = torch.Generator().manual_seed(4321)
    data, hfs = {}, {}
    for i, (name, overrides) in enumerate(variants.items()):
        path = str(tmp_path_factory.mktemp(name))
        hf, cfg = make_tiny_checkpoint(path, seed=seed0 + i, family=family, **overrides)
        prompts, ref, mtp_inputs = make_check_inputs(hf, cfg, g, prompt_lens)
        data[name] = (path, prompts, ref, mtp_inputs)
        hfs[name] = hf
    guard = TopkGuard()
    with guard.active():
        runs = {1: [rank_all_checks(data, target_checks, extras)]}
    for tp in (2, 4):
        runs[tp] = launch(rank_all_checks, tp, data, target_checks, extras, timeout_s=600)
    return data, runs, hfs, guard


def dsa_target_checks(model, prompts):
    """paged_target_checks (test_model_tp) + how the layers are split / replicated on this rank."""
    from test_model_tp import paged_target_checks
    res, done = paged_target_checks(model, prompts, collect_attention_layers)
    res["complete"] = done == [len(p) for p in prompts]
    attn = model.model.layers[0].self_attn
    res["local_heads"] = attn.num_local_heads
    res["indexers"] = [None if layer.self_attn.indexer is None else tuple(layer.self_attn.indexer.wq_b.weight.shape)
                       for layer in model.model.layers]
    res["weights_proj_dtype"] = attn.indexer.weights_proj.weight.dtype
    res["selection_cleared"] = model.index_selection.topk_pos is None
    return res


def dsa_extras(target, mtp):
    return {"tied": [mtp.get_layer(s).shared_head.head is target.lm_head for s in range(mtp.num_mtp_layers)],
            "types": (type(target).__name__, type(mtp).__name__),
            "mtp_indexers": [mtp.get_layer(s).mtp_block.self_attn.indexer is not None
                             for s in range(mtp.num_mtp_layers)]}


def check_target(data, runs, variant, tp, names, indexer_rows):
    from test_model_tp import assert_target_matches
    ref = data[variant][2]
    for r in runs[tp]:
        t = r[variant]["target"]
        assert r[variant]["types"] == names and all(r[variant]["mtp_indexers"])
        assert t["top_equal"] and t["pad_finite"] and t["complete"] and t["selection_cleared"]
        assert_target_matches(t, ref, ATOL, RTOL, f"tp={tp} rank={r['rank']}")
        assert t["local_heads"] == 4 // tp  # MLA heads split; the indexer replicated on every rank, fp32 weights
        assert t["indexers"] == indexer_rows and t["weights_proj_dtype"] == torch.float32


def check_mtp_tp(runs, variant, tp, variants):
    from test_model_tp import _mtp_batches, assert_mtp_arm_matches_tp1
    base = runs[1][0][variant]["mtp"]
    tied = [not variants[variant].get("mtp_head", True)] * variants[variant]["num_mtp_layers"]
    assert runs[1][0][variant]["tied"] == tied
    for (_, step, _), (out, _, top_ok, stats) in base.items():
        assert top_ok and stats == {}
    for r in runs[tp]:
        assert r[variant]["tied"] == tied
        m = r[variant]["mtp"]
        for bname, _ in _mtp_batches(tp):
            for step in (0, 1):
                for arm in ("fused", "baseline", "sp"):
                    where = f"tp={tp} rank={r['rank']} {bname} step={step} {arm}"
                    assert_mtp_arm_matches_tp1(m[(bname, step, arm)], base[(bname, step, "fused")], arm, where,
                                               MTP_ATOL, MTP_RTOL)


def check_pruning_matters(hf, prompts, ref, path):
    """transformers with the selection switched off (index_topk beyond any length) gives other
    logits on these prompts, so the sparse selection is what the comparison tests; and our target
    with every indexer keeping the whole context (context <= index_topk) equals that dense model."""
    indexers = [m for m in hf.modules() if type(m).__name__.endswith("Indexer")]
    assert indexers
    saved = [m.index_topk for m in indexers]
    try:
        for m in indexers:
            m.index_topk = 10 ** 6
        with torch.no_grad():
            dense = [hf(p[None]).logits[0] for p in prompts]
    finally:
        for m, k in zip(indexers, saved):
            m.index_topk = k
    diff = max(float((a - b).abs().max()) for a, b in zip(dense, ref))
    assert diff > 1e-2, diff
    target = load_models(path, dtype=torch.float32, device="cpu", load_mtp=False)[0]
    for layer in target.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.k_cache.impl.index_topk = 64  # > every prompt
    with torch.no_grad():
        for p, want in zip(prompts, dense):
            got = target.compute_logits(target(p, torch.arange(len(p))))
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def hf_mtp_reference(hf, path, cfg, k, ids, pos, prev):
    """MTP layer ``k`` in float64 from transformers' own decoder layer of the architecture
    (``DeepseekV32DecoderLayer`` / ``GlmMoeDsaDecoderLayer``, its indexer included) loaded with the
    MTP block's weights (:func:`tiny_models.hf_mtp_block_reference`). One causal sequence."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32
    import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as glm5

    def build(hf_cfg, idx):
        extra = idx + 1 - len(hf_cfg.mlp_layer_types)
        hf_cfg.mlp_layer_types = list(hf_cfg.mlp_layer_types) + ["sparse"] * extra
        glm = hasattr(hf_cfg, "indexer_types")
        if glm:
            hf_cfg.indexer_types = list(hf_cfg.indexer_types) + ["full"] * extra  # MTP blocks run their own indexer
        layer = (glm5.GlmMoeDsaDecoderLayer if glm else v32.DeepseekV32DecoderLayer)(hf_cfg, idx)
        assert layer.self_attn.indexer is not None
        return layer
    return hf_mtp_block_reference(hf, path, cfg, k, ids, pos, prev, build, v32.DeepseekV32RotaryEmbedding)


def check_mtp_reference(hfs, data, variant):
    """Every MTP layer equals :func:`hf_mtp_reference` on a 12-token sequence (pruned past 6)."""
    path = data[variant][0]
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    cfg = target.config
    g = torch.Generator().manual_seed(7)
    ids, pos = torch.randint(0, cfg.vocab_size, (12,), generator=g), torch.arange(12)
    prev = torch.randn(12, cfg.hidden_size, generator=g)
    guard = TopkGuard()
    for step in range(max(2, cfg.num_nextn_predict_layers)):
        k = step % cfg.num_nextn_predict_layers
        with torch.no_grad(), guard.active():
            got = mtp(ids, pos, prev, spec_step_idx=step)
        want = hf_mtp_reference(hfs[variant], path, cfg, k, ids, pos, prev)
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
        assert torch.equal(mtp.get_top_tokens(got, step), mtp.compute_logits(got, step).argmax(-1))
        sel = mtp.index_selection(step)
        assert sel.shape == (12, cfg.index_topk) and int((sel >= 0).sum(-1).min()) == 1
    guard.assert_well_posed(min_pruned=5)


def check_mtp_uses_its_own_indexer(path):
    """The MTP layer's output depends on its own indexer's weights and not at all on the target's."""
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    cfg = target.config
    g = torch.Generator().manual_seed(3)
    ids, pos = torch.randint(0, cfg.vocab_size, (12,), generator=g), torch.arange(12)
    prev = torch.randn(12, cfg.hidden_size, generator=g)
    with torch.no_grad():
        base = mtp(ids, pos, prev)
        base_sel = mtp.index_selection(0).clone()
        for layer in target.model.layers:  # scramble every target indexer
            if layer.self_attn.indexer is not None:
                for p in layer.self_attn.indexer.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
        assert torch.equal(mtp(ids, pos, prev), base)
        own = mtp.get_layer(0).mtp_block.self_attn.indexer
        own.weights_proj.weight.neg_()
        changed = mtp(ids, pos, prev)
    assert not torch.equal(mtp.index_selection(0), base_sel)
    assert float((changed - base).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------ config
def _raw(**over):
    raw = dict(DSV32_TINY_CONFIG, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
    raw.update(over)
    return raw


def test_config_fields_and_errors():
    cfg = ModelConfig.from_dict(_raw())
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (6, 16, 8)
    assert cfg.rope_interleave and not cfg.indexer_rope_interleave
    assert cfg.indexer_types == ("full",) * 3 and all(cfg.layer_has_indexer(i) for i in range(5))
    defaults = ModelConfig.from_dict({k: v for k, v in _raw().items() if not k.startswith("index_")})
    assert (defaults.index_topk, defaults.index_head_dim, defaults.index_n_heads) == (2048, 128, 64)
    cfg.verify_tensor_parallel(4)
    assert cfg.index_share_for_mtp_iteration is None
    assert ModelConfig.from_dict(_raw(index_share_for_mtp_iteration=True)).index_share_for_mtp_iteration is True
    from mtpspec.config import SpeculativeConfig
    from mtpspec.engine.arg_utils import resolve_index_share
    shared = ModelConfig.from_dict(_raw(index_share_for_mtp_iteration=True))
    assert resolve_index_share(SpeculativeConfig(), shared).index_share_for_mtp_iteration is True  # the checkpoint's
    assert resolve_index_share(SpeculativeConfig(), cfg).index_share_for_mtp_iteration is False
    for over, msg in [(dict(index_share_for_mtp_iteration="yes"), "'index_share_for_mtp_iteration' must be true"),
                      (dict(q_lora_rank=None), "needs q_lora_rank"),
                      (dict(rope_interleave=False), "rope_interleave=false is not supported for DeepseekV32"),
                      (dict(indexer_rope_interleave=True), "indexer_rope_interleave=True contradicts"),
                      (dict(indexer_types=["full", "shared", "full"]), "runs its indexer in every layer"),
                      (dict(index_head_dim=4), "index_head_dim=4 is smaller than qk_rope_head_dim=8"),
                      (dict(index_topk=0), "index_topk=0"),
                      (dict(mlp_layer_types=["dense", "dense", "sparse"]), "mlp_layer_types=.* disagrees"),
                      (dict(attention_bias=True), "attention_bias=True is not supported for DeepseekV32ForCausalLM"),
                      (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
                       "unsupported rope_type 'llama3' for DeepseekV32ForCausalLM")]:
        with pytest.raises(ModelConfigError, match=msg):
            ModelConfig.from_dict(_raw(**over))
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        cfg.verify_tensor_parallel(3)


# ------------------------------------------------------------------------------------------------ layers
def _hf_indexer_case(family, seed, lens):
    """A transformers indexer of ``family`` with random weights, and ours with the same weights."""
    import transformers

    from mtpspec.layers.indexer import Indexer
    from mtpspec.layers.rotary_embedding import RotaryEmbedding
    from tiny_models import FAMILIES, _randomise
    cfg_name, _, base = FAMILIES[family]
    hf_cfg = getattr(transformers, cfg_name)(**{k: v for k, v in base.items() if k != "rope_theta"},
                                              rope_parameters=DSV3_YARN)
    mod = transformers.models.deepseek_v32.modeling_deepseek_v32 if family == "deepseek_v32" else \
        transformers.models.glm_moe_dsa.modeling_glm_moe_dsa
    hf_idx = (mod.DeepseekV32Indexer if family == "deepseek_v32" else mod.GlmMoeDsaIndexer)(hf_cfg, 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_idx.named_parameters():
            p.copy_(_randomise(f"indexer.{name}", p, g))
    ours = Indexer(hf_cfg.hidden_size, hf_cfg.q_lora_rank, hf_cfg.index_n_heads, hf_cfg.index_head_dim,
                   hf_cfg.index_topk, hf_cfg.qk_rope_head_dim, family != "deepseek_v32", torch.float32)
    for name, p in ours.named_parameters():
        p.weight_loader(p, dict(hf_idx.named_parameters())[name])
    cfg = ModelConfig.from_dict({**base, "architectures": [FAMILIES[family][1]], "rope_parameters": DSV3_YARN})
    rope = RotaryEmbedding(8, 8, 256, cfg.rope_theta, False, torch.tensor(cfg.rope_inv_freq(cfg.rope_theta)),
                           cfg.rope_attention_factor)
    seqs = [(torch.randn(n, hf_cfg.hidden_size, generator=g), torch.randn(n, hf_cfg.q_lora_rank, generator=g))
            for n in lens]
    return hf_cfg, mod, hf_idx, ours, rope, seqs


def _hf_selection(hf_cfg, mod, hf_idx, x, qr):
    """transformers' top-k of one sequence, as a set per row (causally valid positions only)."""
    n = x.shape[0]
    pos = torch.arange(n)
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding
    cos, sin = DeepseekV32RotaryEmbedding(hf_cfg)(x[None], pos[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None]
    idx = hf_idx(x[None], qr[None], (cos, sin), mask, pos[None])[0]
    return [{int(s) for s in row if int(s) <= i} for i, row in enumerate(idx)]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_selects_what_transformers_selects(family):
    """Our Indexer (paged: two sequences, chunked prefill then one-token steps, reversed blocks;
    and without a cache) keeps the same positions as transformers' indexer of the architecture
    (half-split rope for DeepSeek-V3.2, interleaved for GLM-5; YaRN factor on both)."""
    hf_cfg, mod, hf_idx, ours, rope, seqs = _hf_indexer_case(family, 11, (13, 9))
    want = [_hf_selection(hf_cfg, mod, hf_idx, x, qr) for x, qr in seqs]
    guard = TopkGuard()
    with torch.no_grad(), guard.active():
        for (x, qr), w in zip(seqs, want):  # no metadata: one causal sequence
            got = ours(x, qr, torch.arange(x.shape[0]), rope.cos_sin_cache)
            assert [{int(s) for s in row if s >= 0} for row in got] == w
        allocate_kv_caches(ours, num_blocks=8, block_size=4, dtype=torch.float32)
        tables = [[3, 2, 1, 0], [7, 6, 5]]
        done = [0, 0]
        while done != [x.shape[0] for x, _ in seqs]:
            active = [i for i in range(2) if done[i] < seqs[i][0].shape[0]]
            q = [1 if done[i] else seqs[i][0].shape[0] - 3 for i in active]
            meta = build_attention_metadata(q, [done[i] + n for i, n in zip(active, q)], [tables[i] for i in active], 4)
            x = torch.cat([seqs[i][0][done[i]:done[i] + n] for i, n in zip(active, q)])
            qr = torch.cat([seqs[i][1][done[i]:done[i] + n] for i, n in zip(active, q)])
            pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in zip(active, q)])
            with set_forward_context(meta):
                got = ours(x, qr, pos, rope.cos_sin_cache)
            row = 0
            for i, n in zip(active, q):
                assert [{int(s) for s in r if s >= 0} for r in got[row:row + n]] == want[i][done[i]:done[i] + n]
                row += n
                done[i] += n
    guard.assert_well_posed(min_pruned=10)


def _latent_problem(seed, lens, starts, bs=4, heads=3, r=8, rope=4):
    """Random new latent rows of sequences with ``starts[i]`` cached positions before ``lens[i]``
    new ones; a cache holding the old positions; metadata with one padding row + one padding
    sequence."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    tables, nxt = [], 0
    for n, s in zip(lens, starts):
        nb = -(-(n + s) // bs)
        tables.append(list(range(nxt + nb - 1, nxt - 1, -1)))
        nxt += nb
    cache = torch.randn(nxt + 1, bs, r + rope, generator=g)
    t = sum(lens)
    rows = dict(ql=torch.randn(t + 1, heads, r, generator=g), qp=torch.randn(t + 1, heads, rope, generator=g),
                c=torch.randn(t + 1, r, generator=g), k=torch.randn(t + 1, rope, generator=g))
    meta = build_attention_metadata(list(lens) + [1], [n + s for n, s in zip(lens, starts)] + [1],
                                    tables + [[nxt]], bs, num_tokens=t + 1)
    # the padding sequence: q_len 0, seq_len 0, no real row (as the CUDA-graph padding)
    meta.query_start_loc[-1] = t
    meta.seq_lens[-1] = 0
    meta.slot_mapping[t] = -1
    meta.query_lens, meta.seq_lens_list = [], []
    assert b + 1 == meta.num_seqs
    return cache, rows, meta, heads, r, rope


@pytest.mark.parametrize("cached", [True, False])
def test_sparse_mla_with_whole_context_equals_dense_mla(cached):
    """Context <= index_topk: every causal position selected -> dense MLA (block boundaries,
    length-1 sequences, one padding row and one padding sequence; with and without a cache)."""
    from mtpspec.layers.mla_attention import MLAAttention
    from mtpspec.layers.sparse_mla_attention import SparseMLAAttention
    lens, starts = ([3, 1, 5, 1], [6, 0, 2, 4]) if cached else ([3, 1, 5, 1], [0, 0, 0, 0])
    cache, x, meta, h, r, rope = _latent_problem(5, lens, starts)
    dense, sparse = MLAAttention(h, r, rope, 0.3), SparseMLAAttention(h, r, rope, 0.3)
    if cached:
        dense.kv_cache, sparse.kv_cache = cache.clone(), cache.clone()
    else:
        meta.block_tables = None
    t = x["ql"].shape[0]
    everything = torch.arange(12, dtype=torch.int32).expand(t, 12)  # past each row's position: dropped
    with torch.no_grad(), set_forward_context(meta):
        want = dense(x["ql"], x["qp"], x["c"], x["k"])
        got = sparse(x["ql"], x["qp"], x["c"], x["k"], everything)
        shuffled = sparse(x["ql"], x["qp"], x["c"], x["k"], everything.flip(1).contiguous())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(shuffled, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # padding row
    if cached:
        assert torch.equal(sparse.kv_cache, dense.kv_cache)  # same latent writes, padding slot untouched


def test_sparse_mla_partial_selection_equals_masked_reference():
    """A random partial selection (some -1, some future positions) equals a float64 softmax over
    exactly the selected causal positions."""
    from mtpspec.layers.sparse_mla_attention import SparseMLAAttention
    lens, starts = [3, 2, 4], [6, 9, 0]
    cache, x, meta, h, r, rope = _latent_problem(8, lens, starts)
    layer = SparseMLAAttention(h, r, rope, 0.3)
    layer.kv_cache = cache.clone()
    g = torch.Generator().manual_seed(1)
    t = x["ql"].shape[0]
    sel = torch.stack([torch.randperm(12, generator=g)[:5] for _ in range(t)]).to(torch.int32)
    sel[sel % 4 == 3] = -1
    with torch.no_grad(), set_forward_context(meta):
        got = layer(x["ql"], x["qp"], x["c"], x["k"], sel)
    row = 0
    bs = cache.shape[1]
    for i, (n, s) in enumerate(zip(lens, starts)):
        table = meta.block_tables[i].long()
        for j in range(n):
            p = s + j
            keep = sorted({int(v) for v in sel[row] if 0 <= v <= p})
            slots = [int(table[v // bs]) * bs + v % bs for v in keep]
            kv = layer.kv_cache.view(-1, r + rope)[slots].double()
            q = torch.cat([x["ql"][row], x["qp"][row]], -1).double()
            pr = torch.softmax(q @ kv.T * 0.3, -1) if keep else None
            want = pr @ kv[:, :r] if keep else torch.zeros(h, r, dtype=torch.float64)
            torch.testing.assert_close(got[row].double(), want, atol=1e-6, rtol=1e-6)
            row += 1


def test_layers_run_without_host_sync():
    """Indexer + sparse MLA with caches on metadata without host lists (padding row and sequence)."""
    from test_paged_attention import no_host_sync

    from mtpspec.layers.sparse_mla_attention import SparseMLAAttention
    hf_cfg, mod, hf_idx, indexer, rope, seqs = _hf_indexer_case("glm_moe_dsa", 2, (9,))
    lens, starts = [3, 1, 5], [6, 0, 2]
    cache, x, meta, h, r, rp = _latent_problem(4, lens, starts)
    layer = SparseMLAAttention(h, r, rp, 0.3)
    layer.kv_cache = cache
    allocate_kv_caches(indexer, num_blocks=cache.shape[0], block_size=cache.shape[1], dtype=torch.float32)
    t = x["ql"].shape[0]
    g = torch.Generator().manual_seed(0)
    hid, qr = torch.randn(t, hf_cfg.hidden_size, generator=g), torch.randn(t, hf_cfg.q_lora_rank, generator=g)
    pos = torch.tensor([6, 7, 8, 0, 2, 3, 4, 5, 6, 0])
    with torch.no_grad(), set_forward_context(meta), no_host_sync():
        sel = indexer(hid, qr, pos, rope.cos_sin_cache)
        out = layer(x["ql"], x["qp"], x["c"], x["k"], sel)
    assert sel.shape == (t, 6) and bool((sel[-1] == -1).all()) and bool((out[-1] == 0).all())


# ------------------------------------------------------------------------------------- target + MTP, tp 1 2 4
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory, FAMILY, VARIANTS, PROMPT_LENS, 60, dsa_target_checks, dsa_extras)


def test_selection_prunes_and_has_no_near_ties(setup):
    data, _, hfs, guard = setup
    guard.assert_well_posed(min_pruned=20)
    for name in VARIANTS:
        check_pruning_matters(hfs[name], data[name][1], data[name][2], data[name][0])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_target_matches_transformers(setup, variant, tp):
    data, runs, _, _ = setup
    check_target(data, runs, variant, tp, ("DeepseekV32ForCausalLM", "DeepseekV32MTP"), [(8 * 16, 24)] * 3)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_tp_equals_tp1_and_arms_agree(setup, variant, tp):
    check_mtp_tp(setup[1], variant, tp, VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_matches_independent_transformers_reference(setup, variant):
    data, _, hfs, _ = setup
    check_mtp_reference(hfs, data, variant)


def test_mtp_uses_its_own_indexer(setup):
    check_mtp_uses_its_own_indexer(setup[0]["default"][0])


def test_kv_cache_spec_counts_the_indexer_keys(setup):
    """Per block and layer: latent (kv_lora_rank + rope) + indexer keys (index_head_dim), target and MTP."""
    from mtpspec.engine.kv_cache import attention_layers, bytes_per_block
    target, mtp = load_models(setup[0]["default"][0], dtype=torch.float32, device="cpu")
    layers = attention_layers(target, mtp)
    assert len(layers) == 2 * (3 + 2)
    assert bytes_per_block(layers, 4, torch.bfloat16) == (3 + 2) * 4 * 2 * ((16 + 8) + 16)


def test_precomputed_selection_seam(setup):
    """``AttentionMetadata.precomputed_topk_pos``: no scoring, keys still written, same output as
    the selection the indexer computed; an all-positions selection is clamped to the causal range
    (= dense, as the indexer with index_topk beyond the context); a bad shape is an error."""
    import mtpspec.attention.backends.indexer as backend
    target, mtp = load_models(setup[0]["default"][0], dtype=torch.float32, device="cpu")
    cfg = target.config
    g = torch.Generator().manual_seed(5)
    lens, starts = [5, 4], [4, 0]
    t = sum(lens)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    pos = torch.cat([torch.arange(s, s + n) for n, s in zip(lens, starts)])
    prev = torch.randn(t, cfg.hidden_size, generator=g)
    meta = build_attention_metadata(lens, [n + s for n, s in zip(lens, starts)], [[0, 1, 2], [4, 3]], 4)
    layer = mtp.get_layer(0).mtp_block.self_attn

    def run(**kw):
        allocate_kv_caches(mtp, num_blocks=6, block_size=4, dtype=torch.float32)
        for c in (layer.mla_attn.kv_cache, layer.indexer.k_cache.kv_cache):
            c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(9)))  # the cached context
        m = copy.copy(meta)
        for key, v in kw.items():
            setattr(m, key, v)
        with torch.no_grad(), set_forward_context(m):
            out = mtp(ids, pos, prev)
        return out, layer.indexer.k_cache.kv_cache.clone(), layer.mla_attn.kv_cache.clone()

    calls = []
    real = backend.indexer_logits
    backend.indexer_logits = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        out, keys, latent = run()
        sel = mtp.index_selection(0).clone()
        assert len(calls) == 1 and sel.shape == (t, 6)
        assert int((sel >= 0).sum()) == sum(min(int(p) + 1, 6) for p in pos)  # min(context, index_topk) per row
        out2, keys2, latent2 = run(precomputed_topk_pos=sel)
        assert len(calls) == 1  # the indexer's scoring did not run
        assert torch.equal(out2, out) and torch.equal(keys2, keys) and torch.equal(latent2, latent)
        assert mtp.index_selection(0) is not None and torch.equal(mtp.index_selection(0), sel)
        everything = torch.arange(16).expand(t, 16).contiguous()
        dense_given, _, _ = run(precomputed_topk_pos=everything)
        layer.indexer.k_cache.impl.index_topk = 100
        dense_indexer, _, _ = run()
        torch.testing.assert_close(dense_given, dense_indexer, atol=1e-6, rtol=1e-6)
        assert float((dense_given - out).abs().max()) > 1e-3  # the selection prunes here
        with pytest.raises(ValueError, match="precomputed_topk_pos must be"):
            run(precomputed_topk_pos=sel[:-1])
    finally:
        backend.indexer_logits = real


# ------------------------------------------------------------------------------------------------- engine
MAX_TOKENS = 12


def make_engine_model(tmp_path_factory, family, num_mtp_layers, seed, **overrides):
    from test_engine_fixtures import make_model, mixed_prompts
    path = str(tmp_path_factory.mktemp(f"{family}_engine"))
    hf, cfg = make_model(path, seed=seed, num_mtp_layers=num_mtp_layers, family=family, **overrides)
    return path, hf, cfg, mixed_prompts(6, cfg.vocab_size, seed=2)


def engine_llm(path, **kw):
    from mtpspec import LLM
    kw.setdefault("max_num_seqs", 4)
    return LLM(path, max_model_len=64, block_size=4, num_kv_blocks=128, seed=0, **kw)


def engine_generate(llm, prompts):
    from mtpspec import SamplingParams
    from test_engine_fixtures import token_prompts
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), sp, use_tqdm=False)]


def check_greedy_matches_generate(hf, prompts, plain):
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, r in zip(prompts, plain):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out[0, len(p):].tolist() == r and len(r) == MAX_TOKENS


def check_spec(path, prompts, plain, k, local_argmax, fused, tp=1, seq_parallel=False):
    kw = dict(tensor_parallel_size=tp, device="cpu", sequence_parallel=seq_parallel) if tp > 1 else {}
    with engine_llm(path, speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax},
                    fuse_allreduce_rmsnorm=fused, **kw) as llm:
        assert engine_generate(llm, prompts) == plain
        m = llm.get_metrics()
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"]


def check_graph_path_sync_free(path, prompts, plain, k, local_argmax, monkeypatch):
    """The CUDA-graph code path (``graph_mode="static"``): batches padded to 1, 2, 4, 8 sequences,
    every graph unit run on the captured metadata (no host lists) under the no-host-sync guard."""
    from test_paged_attention import no_host_sync

    from mtpspec.engine.forward import GraphedForward
    from mtpspec.layers.vocab_parallel_embedding import VocabParallelEmbedding
    units = []

    def guarded_run(self, key, fn, bp, step, rows=None):
        meta = self._meta(bp, host=False, step=step, rows=rows)
        with no_host_sync():
            out = fn(meta)
        units.append(key[0])
        return out

    monkeypatch.setattr(GraphedForward, "_run", guarded_run)
    with engine_llm(path, max_num_seqs=8, graph_mode="static",
                    speculative_config={"num_speculative_tokens": k, "use_local_argmax_reduction": local_argmax}) as llm:
        runner = llm.executor.runner
        for model in (runner.target, runner.mtp):  # CPU validates token ids with a sync; GPUs do not
            for m in model.modules():
                if isinstance(m, VocabParallelEmbedding):
                    m.validate_ids = False
        for n in (3, 6, 1):
            assert engine_generate(llm, prompts[:n]) == plain[:n]
        assert llm.get_metrics()["num_eager_fallbacks"] == 0
        assert runner.fwd.num_graph_steps > 10
        assert runner.fwd.num_prefill_graph_steps >= 1  # n = 1: the one-sequence prefill units
    assert {"verify", "firsttop"} <= set(units) and (k == 1 or "step" in units), units


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    return make_engine_model(tmp_path_factory, FAMILY, 2, 11, rope_parameters=DSV3_YARN)


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


@pytest.mark.parametrize("k,local_argmax,fused", [(1, True, True), (3, False, False)])
def test_mtp_spec_decoding_equals_plain_greedy(engine_model, plain_greedy, k, local_argmax, fused):
    check_spec(engine_model[0], engine_model[3], plain_greedy, k, local_argmax, fused)


def test_graph_code_path_with_padding_equals_plain_greedy(engine_model, plain_greedy, monkeypatch):
    check_graph_path_sync_free(engine_model[0], engine_model[3], plain_greedy, 3, True, monkeypatch)


@pytest.mark.parametrize("fused,seq_parallel,local_argmax", [(True, True, True), (False, False, False)])
def test_mtp_spec_decoding_tp2_equals_plain_greedy(engine_model, plain_greedy, fused, seq_parallel, local_argmax):
    check_spec(engine_model[0], engine_model[3], plain_greedy, 3, local_argmax, fused, tp=2,
               seq_parallel=seq_parallel)


# ------------------------------------------------------------------------------------------------- loader
def loader_base_for(tmp_path_factory, family, name):
    from mtpspec.models.loader import read_checkpoint_tensors
    path = str(tmp_path_factory.mktemp(name))
    make_tiny_checkpoint(path, seed=3, num_mtp_layers=1, family=family)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    return dict(read_checkpoint_tensors(path)), raw


def write_variant(tmp_path, base, edit):
    from mtpspec.models.loader import save_checkpoint
    tensors, raw = dict(base[0]), dict(base[1])
    edit(tensors)
    save_checkpoint(str(tmp_path), tensors, raw)
    return str(tmp_path)


def check_missing_tensor_is_named(tmp_path, base, key, monkeypatch):
    """The missing key is named and no module was built (checked before construction)."""
    from mtpspec.layers import indexer
    from mtpspec.models import MissingKeyError
    path = write_variant(tmp_path, base, lambda t: t.pop(key))
    built = []
    monkeypatch.setattr(indexer.Indexer, "__init__",
                        lambda self, *a, **k: built.append(1) or (_ for _ in ()).throw(AssertionError("built")))
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.")) as info:
        load_models(path, dtype=torch.float32, device="cpu")
    assert info.value.key == key and not built


@pytest.fixture(scope="module")
def loader_base(tmp_path_factory):
    return loader_base_for(tmp_path_factory, FAMILY, "dsv32_loader")


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.indexer.wk.weight",
                                 "model.layers.0.self_attn.indexer.k_norm.bias",
                                 "model.layers.3.self_attn.indexer.weights_proj.weight",  # the MTP layer's
                                 "model.layers.2.self_attn.q_a_layernorm.weight"])
def test_missing_tensor_is_named(tmp_path, loader_base, key, monkeypatch):
    check_missing_tensor_is_named(tmp_path, loader_base, key, monkeypatch)


def test_wrong_indexer_shape_names_expected_and_actual(tmp_path, loader_base):
    from mtpspec.models import ShapeMismatchError
    key = "model.layers.0.self_attn.indexer.wq_b.weight"  # [8 heads * 16, q_lora 24]
    path = write_variant(tmp_path, loader_base, lambda t: t.__setitem__(key, t[key].T.contiguous()))
    with pytest.raises(ShapeMismatchError, match=r"wq_b\.weight'.*expected shape \[128, 24\], got \[24, 128\]"):
        load_models(path, dtype=torch.float32, device="cpu")


def test_export_round_trips_the_checkpoint(tmp_path, loader_base):
    from mtpspec.models import export_hf_state_dict
    tensors = loader_base[0]
    path = write_variant(tmp_path, loader_base, lambda t: None)
    target, mtp = load_models(path, dtype=torch.bfloat16, device="cpu")
    assert target.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    target, mtp = load_models(path, dtype=torch.float32, device="cpu")
    out = export_hf_state_dict(target, mtp)
    assert set(out) == set(tensors) and any(".indexer." in k for k in out)
    for key, t in tensors.items():
        assert torch.equal(out[key], t), key


def test_paged_decode_through_the_triton_kernels_matches_transformers(setup, interp, monkeypatch):
    """The cached path (chunked prefill, then one token per step) and the no-cache forwards with
    every Triton kernel on (the interpreter on CPU): indexer key write and logits, sparse MLA."""
    import mtpspec.attention.backends.indexer as indexer_backend
    import mtpspec.attention.backends.sparse_mla as sparse_backend
    calls = {"indexer_logits": 0, "sparse_mla_attention": 0}
    for mod, name in ((indexer_backend, "indexer_logits"), (sparse_backend, "sparse_mla_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k:
                            calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **k))
    data = setup[0]
    path, prompts, ref, _ = data["default"]
    target = load_models(path, dtype=torch.float32, device="cpu", load_mtp=False)[0]
    res = dsa_target_checks(target, prompts[1:3])
    for name in ("single", "batched", "cached"):
        got = torch.cat(res[name]) if isinstance(res[name], list) else res[name]
        torch.testing.assert_close(got, torch.cat(ref[1:3]), atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
    assert min(calls.values()) >= 3 * (2 + 1 + 3)  # 3 layers x (2 single + batched + prefill chunk + 3 steps)
