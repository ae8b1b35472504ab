"""Seeded sampling gives the same tokens whether or not a request was preempted (k = 0, 1, 3).

Preemption by recompute drops a sequence's pending drafts; its next token is then drawn by a
prefill instead of a verification. With one-hot (greedy) drafts the verifier draws each
position's token with that position's seeded uniform exactly as plain sampling does and accepts
a draft iff it equals that token (:func:`~mtpspec.sample.rejection_sampler.random_verify`),
so the tokens depend neither on the drafts nor on preemption (nor on k).

Random MTP layers almost never propose a likely token, so drafts come from a hook: the plain
(k = 0) seeded continuation with 30% corrupted, which makes acceptances, rejections and bonus
draws all common.
"""

from __future__ import annotations

import pytest

from test_engine_fixtures import OracleDrafts, make_model, token_prompts

from mtpspec import LLM, SamplingParams

KW = dict(max_model_len=32, block_size=4, max_num_seqs=6, seed=0)
BASE = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21]]
SEED_SETS = [(1, 2, 3, 4, 5, 6), (101, 7, 4242, 9, 13, 77), (55, 56, 57, 58, 59, 60)]
TEMPERATURES = (0.9, 0.6)
# one group of six prompts per (temperature, seed set); a leading marker token keeps them apart
CASES = [(t, seeds) for t in TEMPERATURES for seeds in SEED_SETS]
PROMPTS = [[30 + g] + p for g in range(len(CASES)) for p in BASE]
PARAMS = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True) for t, seeds in CASES for s in seeds]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_seeded"))
    make_model(p, seed=21)
    return p


def _run(path, k, num_kv_blocks, reference=None):
    spec = {"num_speculative_tokens": k} if k else None
    with LLM(path, speculative_config=spec, num_kv_blocks=num_kv_blocks, **KW) as llm:
        if reference is not None and k:
            llm.llm_engine.draft_hook = OracleDrafts(reference, 200, corrupt=0.3)
        outs = llm.generate(token_prompts(PROMPTS), PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), [o.metrics.num_preemptions for o in outs]


@pytest.fixture(scope="module")
def runs(path):
    """k -> (unpreempted tokens, preempted-run tokens, preemptions per request)."""
    plain = _run(path, 0, 256)[0]
    reference = {tuple(p): toks for p, toks in zip(PROMPTS, plain)}
    out = {}
    for k in (0, 1, 3):
        roomy, m_roomy, _ = _run(path, k, 256, reference)
        tight, m_tight, pre = _run(path, k, 14, reference)  # 14 blocks of 4: one sequence fits, six do not
        assert m_roomy["num_preemptions"] == 0 and m_tight["num_preemptions"] > 0
        if k:
            assert 0 < m_roomy["num_accepted_tokens"] < m_roomy["num_draft_tokens"]
        out[k] = (roomy, tight, pre)
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_seeded_tokens_survive_preemption(runs, k) -> None:
    roomy, tight, pre = runs[k]
    assert sum(n > 0 for n in pre) >= len(PROMPTS) // 2
    assert len({tuple(t) for t in roomy}) == len(roomy) and len(set(roomy[0])) > 5  # really sampling
    diff = [i for i in range(len(PROMPTS)) if roomy[i] != tight[i]]
    assert not diff, f"k={k}: {len(diff)} of {len(PROMPTS)} requests changed after preemption: {diff}"


def test_seeded_tokens_do_not_depend_on_k(runs) -> None:
    """The same coupling makes a seeded request's tokens independent of its drafts, hence of k."""
    assert runs[1][0] == runs[0][0] and runs[3][0] == runs[0][0]


def test_one_hot_verification_emits_plain_sampling_tokens() -> None:
    """Unit level: with one-hot drafts each emitted token is the plain sampler's draw from the
    same row with the same uniform, and a draft is accepted iff it equals that draw."""
    import torch

    from mtpspec.sample.sampler import Sampler, SamplingMetadata
    from mtpspec.sample.rejection_sampler import RejectionSampler

    g = torch.Generator().manual_seed(5)
    b, k, vocab = 400, 3, 9
    logits = torch.randn(b, k + 1, vocab, generator=g) * 2
    su = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    meta = SamplingMetadata.build([0.8] * b, [0] * b, [1.0] * b, torch.device("cpu"))
    plain = Sampler()(logits.reshape(-1, vocab), meta.repeat_interleave(k + 1), su.reshape(-1)).view(b, k + 1)
    drafts = torch.randint(0, vocab, (b, k), generator=g)
    take = torch.rand(b, k, generator=g) < 0.6
    drafts = torch.where(take, plain[:, :k], drafts)  # many drafts equal the plain draw
    res = RejectionSampler()(drafts, logits, meta, torch.rand(b, k, generator=g, dtype=torch.float64), su)
    for r in range(b):
        a = int(res.num_accepted[r])
        same = (drafts[r] == plain[r, :k]).tolist()
        assert a == (same + [False]).index(False)
        assert res.output_token_ids[r, :a + 1].tolist() == plain[r, :a + 1].tolist()
    assert set(res.num_accepted.tolist()) == set(range(k + 1))
