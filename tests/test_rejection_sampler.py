"""Rejection sampler: greedy acceptance logic and the distribution of emitted tokens.

The statistical tests draw many independent verifications with fixed draft and target
distributions and compare, for every output slot, the emitted tokens with the target
distribution of that slot (chi-square goodness of fit; p-value from the regularised upper
incomplete gamma function). ``test_chi_square_has_power`` runs the same check on a deliberately
wrong sampler and requires it to fail, so the check cannot pass vacuously.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtpspec.sample import rejection_sampler as rs
from mtpspec.sample import sampler as sampler_mod
from mtpspec.sample.counter_rng import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniforms, seed_to_u64
from mtpspec.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from mtpspec.sample.sampler import Sampler, SamplingMetadata

P_VALUE_FLOOR = 1e-4  # fixed seeds make each run deterministic; a correct sampler sits far above


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed ``counts`` against ``probs`` (zero-prob bins must be empty)."""
    n = counts.sum()
    if n == 0:
        raise AssertionError("no samples to test")
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 brute force: temperature, keep top-k, then smallest top-p nucleus, renormalise."""
    out = []
    for row in logits.double():
        p = torch.softmax(row / temperature, dim=-1).numpy()
        order = sorted(range(len(p)), key=lambda i: -p[i])
        keep = order[:top_k] if top_k > 0 else order
        q = np.zeros_like(p)
        q[keep] = p[keep]
        q /= q.sum()
        nucleus, mass = [], 0.0
        for i in keep:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += q[i]
        r = np.zeros_like(p)
        r[nucleus] = q[nucleus]
        out.append(r / r.sum())
    return np.stack(out)


def _meta(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingMetadata:
    return SamplingMetadata.build([temperature] * n, [top_k] * n, [top_p] * n, torch.device("cpu"))


def _slot_p_values(out: torch.Tensor, n_acc: torch.Tensor, target: np.ndarray) -> list:
    """For each slot j: tokens emitted at j (rows with num_accepted >= j) against target[j]."""
    vocab = target.shape[-1]
    pvals = []
    for j in range(target.shape[0]):
        rows = n_acc >= j
        toks = out[rows, j]
        assert (toks != PLACEHOLDER_TOKEN_ID).all()
        assert (out[n_acc < j, j] == PLACEHOLDER_TOKEN_ID).all()
        counts = np.bincount(toks.numpy(), minlength=vocab)
        pvals.append(chi_square_p_value(counts, target[j]))
    return pvals


def _run(draws: int, k: int, vocab: int, one_hot_drafts: bool, temperature: float, top_k: int,
         top_p: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    target = reference_probs(target_logits, temperature, top_k, top_p)
    if one_hot_drafts:
        # A fixed greedy draft per slot: the target's most likely token at even slots, its
        # second most likely at odd ones (so acceptance is neither certain nor rare).
        order = target_logits[:k].argsort(dim=-1, descending=True)
        fixed = torch.stack([order[j, j % 2] for j in range(k)])
        drafts = fixed.unsqueeze(0).expand(draws, k).clone()
        draft_probs = None
    else:
        q = torch.softmax(target_logits[:k] / temperature + torch.randn(k, vocab, generator=g), dim=-1)
        drafts = torch.multinomial(q, draws, replacement=True, generator=g).T.contiguous()
        draft_probs = q.unsqueeze(0).expand(draws, k, vocab)
    meta = _meta(draws, temperature, top_k, top_p)
    accept_u = torch.rand(draws, k, generator=g, dtype=torch.float64)
    sample_u = torch.rand(draws, k + 1, generator=g, dtype=torch.float64)
    res = RejectionSampler()(drafts, target_logits.unsqueeze(0).expand(draws, k + 1, vocab), meta,
                             accept_u, sample_u, draft_probs)
    return res, target


@pytest.mark.parametrize("one_hot_drafts", [True, False])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.7), (5, 0.8)])
def test_emitted_tokens_follow_target_distribution(one_hot_drafts: bool, top_k: int, top_p: float) -> None:
    seed = 1000 + 10 * top_k + int(top_p * 10) + one_hot_drafts
    res, target = _run(30000, 3, 7, one_hot_drafts, 0.8, top_k, top_p, seed)
    # Enough rows reach every slot for the test there to mean something.
    assert (res.num_accepted == 3).sum() > 1000, torch.bincount(res.num_accepted)
    pvals = _slot_p_values(res.output_token_ids, res.num_accepted, target)
    assert min(pvals) > P_VALUE_FLOOR, pvals


def _wrong_residual(target_probs, draft_token_ids, draft_probs):
    """Deliberately broken: recovers from p instead of norm(max(0, p - q))."""
    return target_probs


@pytest.mark.parametrize("one_hot_drafts", [True, False])
def test_chi_square_has_power(monkeypatch: pytest.MonkeyPatch, one_hot_drafts: bool) -> None:
    monkeypatch.setattr(rs, "_residual_weights", _wrong_residual)
    res, target = _run(30000, 3, 7, one_hot_drafts, 0.8, 0, 1.0, 77 + one_hot_drafts)
    pvals = _slot_p_values(res.output_token_ids, res.num_accepted, target)
    assert min(pvals) < 1e-12, pvals


def test_chi_square_detects_acceptance_without_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting every draft (ignoring p/q) must also be caught."""
    orig = rs.random_verify

    def accept_all(draft_token_ids, target_logits, meta, accept_uniforms, sample_uniforms, draft_probs=None):
        return orig(draft_token_ids, target_logits, meta, torch.zeros_like(accept_uniforms) - 1.0,
                    sample_uniforms, draft_probs)

    monkeypatch.setattr(rs, "random_verify", accept_all)
    res, target = _run(20000, 2, 6, False, 1.0, 0, 1.0, 5)
    assert min(_slot_p_values(res.output_token_ids, res.num_accepted, target)) < 1e-12


def _greedy_reference(drafts: list, argmax: list) -> list:
    out = []
    for j, d in enumerate(drafts):
        if d != argmax[j]:
            return out + [argmax[j]]
        out.append(d)
    return out + [argmax[len(drafts)]]


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_acceptance_logic(request, k: int, kernel: bool) -> None:
    """Against a python reference; ``kernel``: the one-launch Triton acceptance (a GPU, else the
    interpreter: ``mtpspec.ops.accept``), else the torch ops."""
    dev = request.getfixturevalue("kdev") if kernel else "cpu"
    g = torch.Generator().manual_seed(k)
    b, vocab = 64, 11
    logits = torch.randn(b, k + 1, vocab, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (b, k), generator=g)
    # Make row r match the target on its first (r % (k + 1)) drafts.
    for r in range(b):
        m = r % (k + 1)
        drafts[r, :m] = argmax[r, :m]
    res = RejectionSampler()(drafts.to(dev), logits.to(dev), _meta(b, 0.0))
    res = rs.RejectionOutput(res.output_token_ids.cpu(), res.num_accepted.cpu())
    for r in range(b):
        ref = _greedy_reference(drafts[r].tolist(), argmax[r].tolist())
        got = res.output_token_ids[r].tolist()
        assert got[:len(ref)] == ref and all(t == PLACEHOLDER_TOKEN_ID for t in got[len(ref):])
        assert int(res.num_accepted[r]) == len(ref) - 1
    assert set(res.num_accepted.tolist()) == set(range(k + 1))


def test_mixed_greedy_and_random_rows() -> None:
    g = torch.Generator().manual_seed(3)
    b, k, vocab = 16, 2, 9
    logits = torch.randn(b, k + 1, vocab, generator=g)
    drafts = logits.argmax(-1)[:, :k].clone()
    drafts[::3, 0] = (drafts[::3, 0] + 1) % vocab
    temps = [0.0 if r % 2 == 0 else 1.0 for r in range(b)]
    meta = SamplingMetadata.build(temps, [0] * b, [1.0] * b, torch.device("cpu"))
    au = torch.rand(b, k, generator=g, dtype=torch.float64)
    su = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    mixed = RejectionSampler()(drafts, logits, meta, au, su)
    greedy = RejectionSampler()(drafts, logits, _meta(b, 0.0))
    rand = RejectionSampler()(drafts, logits, _meta(b, 1.0), au, su)
    for r in range(b):
        src = greedy if temps[r] == 0.0 else rand
        assert torch.equal(mixed.output_token_ids[r], src.output_token_ids[r])
        assert int(mixed.num_accepted[r]) == int(src.num_accepted[r])


def test_zero_probability_draft_is_always_rejected() -> None:
    b, k, vocab = 200, 1, 5
    logits = torch.zeros(b, k + 1, vocab)
    logits[:, :, 2] = -float("inf")  # token 2 has p = 0
    drafts = torch.full((b, k), 2)
    u = torch.rand(b, k, dtype=torch.float64)
    res = RejectionSampler()(drafts, logits, _meta(b, 1.0), u, torch.rand(b, k + 1, dtype=torch.float64))
    assert (res.num_accepted == 0).all()
    assert (res.output_token_ids[:, 0] != 2).all()


def test_certain_draft_is_always_accepted() -> None:
    b, k, vocab = 50, 2, 5
    logits = torch.full((b, k + 1, vocab), -float("inf"))
    logits[:, :, 4] = 0.0  # p is one-hot at 4
    drafts = torch.full((b, k), 4)
    res = RejectionSampler()(drafts, logits, _meta(b, 0.5), torch.rand(b, k, dtype=torch.float64),
                             torch.rand(b, k + 1, dtype=torch.float64))
    assert (res.num_accepted == k).all() and (res.output_token_ids == 4).all()


def test_shape_errors() -> None:
    rsm = RejectionSampler()
    with pytest.raises(ValueError, match="k \\+ 1"):
        rsm(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5), _meta(2, 0.0))
    with pytest.raises(ValueError, match="uniforms"):
        rsm(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), _meta(2, 1.0))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.6)])
def test_plain_sampler_distribution(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(11 + top_k)
    vocab, n = 8, 40000
    logits = torch.randn(1, vocab, generator=g) * 2
    target = reference_probs(logits, 1.3, top_k, top_p)[0]
    u = torch.rand(n, generator=g, dtype=torch.float64)
    toks = Sampler()(logits.expand(n, vocab), _meta(n, 1.3, top_k, top_p), u)
    assert chi_square_p_value(np.bincount(toks.numpy(), minlength=vocab), target) > P_VALUE_FLOOR


def test_plain_sampler_greedy_and_extreme_temperature() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 0.0, 0.0]])
    toks = Sampler()(logits, _meta(2, 0.0), torch.zeros(2, dtype=torch.float64))
    assert toks.tolist() == [1, 0]  # first maximum on ties
    tiny = Sampler()(logits * 1e4, _meta(2, 1e-6), torch.full((2,), 0.999, dtype=torch.float64))
    assert tiny.tolist()[1] == 0 and tiny.tolist()[0] in (1, 2)


def test_counter_uniforms_are_uniform_and_keyed() -> None:
    keys = [seed_to_u64(s) for s in range(200)]
    pos = np.tile(np.arange(250, dtype=np.int64), (200, 1))
    u = counter_uniforms(keys, pos, STREAM_SAMPLE)
    assert u.shape == (200, 250) and (u >= 0).all() and (u < 1).all()
    counts = np.bincount((u * 20).astype(int).ravel(), minlength=20)
    assert chi_square_p_value(counts, np.full(20, 0.05)) > P_VALUE_FLOOR
    v = counter_uniforms(keys, pos, STREAM_ACCEPT)
    assert abs(np.corrcoef(u.ravel(), v.ravel())[0, 1]) < 0.02
    # Same (seed, position, stream) -> same value, whatever the rest of the batch holds.
    again = counter_uniforms([keys[7]], pos[7:8, 100:110], STREAM_SAMPLE)
    assert np.array_equal(again[0], u[7, 100:110])
    assert seed_to_u64(-1) != seed_to_u64(1) and seed_to_u64(2 ** 70) == seed_to_u64(2 ** 70)
    with pytest.raises(ValueError, match="positions"):
        counter_uniforms(keys, pos[:5], STREAM_SAMPLE)


def test_inverse_cdf_never_picks_zero_weight() -> None:
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]]).expand(5, 5)
    u = torch.tensor([0.0, 0.3, 0.5, 0.999999, 1.0 - 2 ** -53], dtype=torch.float64)
    idx = sampler_mod.sample_inverse_cdf(w, u)
    assert idx.tolist() == [1, 1, 3, 3, 3]
    assert math.isclose(1 / 3, 1 / 3)


# ------------------------------------------------------------------ sampled (Gumbel-max) drafts
def _sampled_run(draws: int, k: int, vocab: int, temperature: float, top_k: int, top_p: float, seed: int,
                 tp: int, monkeypatch: pytest.MonkeyPatch):
    """Drafts drawn by vocab-parallel Gumbel-max from MTP-like logits at ``temperature``, verified
    with the shard-wise residual, ``tp`` shards simulated in one process (the packed rows of each
    shard stacked in rank order, which is what the all-gather does)."""
    from mtpspec.sample import gumbel as gm
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    target = reference_probs(target_logits, temperature, top_k, top_p)
    draft_logits = (target_logits[:k] + torch.randn(k, vocab, generator=g)).expand(draws, k, vocab).contiguous()
    temp = torch.full((draws,), temperature)
    keys = torch.arange(draws, dtype=torch.int64) * 7919 + seed
    pos = torch.arange(k).expand(draws, k) + 100
    per = -(-vocab // tp)
    shards = [(r * per, max(0, min(vocab - r * per, per))) for r in range(tp)]

    def pick(local_fn):
        return gm.pick_gumbel(torch.stack([local_fn(v0, nr) for v0, nr in shards]))

    drafts, log_q, lse = [], [], []
    for j in range(k):
        rows = gm.row_hash(keys, pos[:, j], gm.STREAM_DRAFT)
        got = pick(lambda v0, nr: gm.local_gumbel_top(draft_logits[:, j, v0:v0 + per], v0, nr, temp, rows))
        drafts.append(got.token_ids), log_q.append(got.log_q), lse.append(got.lse)
    drafts, log_q, lse = torch.stack(drafts, 1), torch.stack(log_q, 1), torch.stack(lse, 1)
    d = rs.SampledDrafts(torch.ones(draws, dtype=torch.bool), torch.zeros(draws, dtype=torch.bool), draft_logits,
                         0, vocab, temp, log_q, lse, gm.row_hash(keys.repeat_interleave(k), pos.reshape(-1),
                                                                 gm.STREAM_RESIDUAL).view(draws, k))

    def residual_tokens(target_probs, full):
        def local(v0, nr):
            part = rs.SampledDrafts(full.mask, full.ignore, full.local_logits[..., v0:v0 + per], v0, nr,
                                    full.temperature, full.log_q, full.lse, full.residual_rows)
            return rs.residual_local_packed(target_probs, part)
        return pick(local).token_ids.view(target_probs.shape[:2])

    monkeypatch.setattr(rs, "_residual_tokens", residual_tokens)
    meta = _meta(draws, temperature, top_k, top_p)
    accept_u = torch.rand(draws, k, generator=g, dtype=torch.float64)
    sample_u = torch.rand(draws, k + 1, generator=g, dtype=torch.float64)
    res = RejectionSampler()(drafts, target_logits.unsqueeze(0).expand(draws, k + 1, vocab), meta,
                             accept_u, sample_u, sampled=d)
    q = torch.softmax(draft_logits[0].double() / temperature, -1).numpy()
    return res, target, drafts, q


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 0, 1.0), (1.0, 0, 1.0), (1.0, 4, 1.0), (0.5, 0, 0.7)])
def test_sampled_drafts_follow_q_and_emitted_tokens_follow_p(monkeypatch: pytest.MonkeyPatch, tp: int,
                                                             temperature: float, top_k: int, top_p: float) -> None:
    seed = 300 + tp + 10 * top_k + int(10 * top_p) + int(10 * temperature)
    res, target, drafts, q = _sampled_run(30000, 3, 7, temperature, top_k, top_p, seed, tp, monkeypatch)
    for j in range(3):  # drafts follow q (the distribution the verifier is told)
        assert chi_square_p_value(np.bincount(drafts[:, j].numpy(), minlength=7), q[j]) > P_VALUE_FLOOR
    assert (res.num_accepted == 3).sum() > 500, torch.bincount(res.num_accepted)
    pvals = _slot_p_values(res.output_token_ids, res.num_accepted, target)
    assert min(pvals) > P_VALUE_FLOOR, pvals


def test_sampled_drafts_tp2_equals_tp1_and_has_power(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _sampled_run(5000, 3, 7, 1.0, 0, 1.0, 9, 1, monkeypatch)[0]
    b = _sampled_run(5000, 3, 7, 1.0, 0, 1.0, 9, 2, monkeypatch)[0]
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    # A residual that ignores q (p with nothing removed) must fail the same check.
    orig = rs.residual_local_packed

    def wrong(target_probs, d):
        d2 = rs.SampledDrafts(d.mask, d.ignore, torch.full_like(d.local_logits, -float("inf")), d.vocab_start,
                              d.num_real, d.temperature, d.log_q, d.lse, d.residual_rows)
        return orig(target_probs, d2)

    monkeypatch.setattr(rs, "residual_local_packed", wrong)
    res, target, _, _ = _sampled_run(30000, 3, 7, 1.0, 0, 1.0, 77, 2, monkeypatch)
    assert min(_slot_p_values(res.output_token_ids, res.num_accepted, target)) < 1e-12


def test_sampled_drafts_ignored_rows_sample_plainly() -> None:
    from mtpspec.sample import gumbel as gm
    b, k, vocab = 40, 2, 6
    logits = torch.randn(b, k + 1, vocab)
    drafts = torch.randint(0, vocab, (b, k))
    meta = _meta(b, 1.0)
    au, su = torch.rand(b, k, dtype=torch.float64), torch.rand(b, k + 1, dtype=torch.float64)
    d = rs.SampledDrafts(torch.ones(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool), torch.zeros(b, k, vocab),
                         0, vocab, torch.ones(b), torch.zeros(b, k), torch.zeros(b, k), torch.zeros(b, k, dtype=torch.long))
    res = RejectionSampler()(drafts, logits, meta, au, su, sampled=d)
    plain = Sampler()(logits[:, 0], meta, su[:, 0])
    assert (res.num_accepted == 0).all() and torch.equal(res.output_token_ids[:, 0], plain)
    del gm


def test_greedy_accept_kernel_equals_torch(kdev) -> None:
    """``ops.accept.greedy_accept`` (one launch) equals its torch form: every prefix length, k 1..6,
    empty batches, strided inputs (torch fallback); int64 only, shapes checked."""
    from mtpspec.ops.accept import greedy_accept, greedy_accept_ref
    g = torch.Generator().manual_seed(0)
    for k in range(1, 7):
        b = 3 * (k + 1)
        target = torch.randint(0, 5, (b, k + 1), generator=g)
        drafts = torch.randint(0, 5, (b, k), generator=g)
        for r in range(b):  # row r agrees on at least its first r % (k + 1) drafts
            drafts[r, :r % (k + 1)] = target[r, :r % (k + 1)]
        out, acc = greedy_accept(drafts.to(kdev), target.to(kdev))
        ref_out, ref_acc = greedy_accept_ref(drafts, target)
        assert torch.equal(out.cpu(), ref_out) and torch.equal(acc.cpu(), ref_acc)
        assert set(acc.tolist()) == set(range(k + 1))
    out, acc = greedy_accept(torch.zeros(0, 3, dtype=torch.int64, device=kdev),
                             torch.zeros(0, 4, dtype=torch.int64, device=kdev))
    assert out.shape == (0, 4) and acc.shape == (0,)
    wide = torch.randint(0, 3, (4, 8), generator=g)
    out, acc = greedy_accept(wide[:, ::2].to(kdev), torch.randint(0, 3, (4, 5), generator=g).to(kdev))
    assert out.shape == (4, 5)
    with pytest.raises(ValueError, match="int64"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))


def test_greedy_accept_kernel_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from mtpspec.ops import triton_utils
    sig = {"d_ptr": "*i64", "t_ptr": "*i64", "out_ptr": "*i64", "acc_ptr": "*i64", "stride_d": "i32",
           "stride_t": "i32", "stride_o": "i32"}
    spec = {"module": "mtpspec.ops.accept", "kernel": "_greedy_accept", "signature": sig,
            "constexprs": dict(K=3, K1_P2=4, PAD=-1), "aligned": ["d_ptr", "t_ptr", "out_ptr", "acc_ptr"],
            "num_warps": 1}
    assert len(triton_utils.compile_reports([spec])) == 1
