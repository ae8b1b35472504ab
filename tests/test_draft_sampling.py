"""Sampled MTP drafts (``speculative_config["draft_sampling"] = "auto"``) end to end on a tiny
random checkpoint: config validation, greedy rows unchanged, seeded requests reproducible across
runs and batch positions, more acceptance than greedy drafts at a high temperature (the random MTP layer's distribution
is far from the target's at temperature 1, so sampled drafts only overlap it when both are
flattened; the trained demo model's figure is in docs/serving.md), emitted tokens in
the law of plain sampling (chi-square homogeneity against k = 0; a wiring check with little
power at the flat temperature it needs, tests/test_rejection_sampler.py carries the power), and
tp 2 == tp 1 (gloo)."""

from __future__ import annotations

import numpy as np
import pytest

from test_engine_fixtures import make_model, mixed_prompts, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.config import SpeculativeConfig
from mtpspec.engine.arg_utils import parse_speculative_config

LLM_KW = dict(max_model_len=64, block_size=4, num_kv_blocks=400, max_num_seqs=8, seed=0)
AUTO = {"num_speculative_tokens": 3, "use_local_argmax_reduction": True, "draft_sampling": "auto"}
GREEDY = dict(AUTO, draft_sampling="greedy")


def test_config_validation() -> None:
    assert SpeculativeConfig().draft_sampling == "greedy"
    assert SpeculativeConfig(draft_sampling="auto").draft_sampling == "auto"
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        SpeculativeConfig(draft_sampling="sampled")
    assert parse_speculative_config('{"draft_sampling": "auto"}') == {"draft_sampling": "auto"}
    with pytest.raises(ValueError, match="draft_sampling"):
        parse_speculative_config('{"draft_sampling": true}')


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_ds"))
    _, cfg = make_model(path, seed=5, tokenizer=False)
    return path, cfg, mixed_prompts(6, cfg.vocab_size, seed=2)


def _gen(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]


def _seeded(n, temperature=8.0, max_tokens=10, **kw):
    return [SamplingParams(temperature=temperature, seed=100 + i, max_tokens=max_tokens, ignore_eos=True, **kw)
            for i in range(n)]


def test_greedy_unchanged_seeded_reproducible_and_more_acceptance(model) -> None:
    path, cfg, prompts = model
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(path, speculative_config=GREEDY, **LLM_KW) as llm:
        ref_greedy = _gen(llm, prompts, greedy)
        llm.reset_metrics()
        _gen(llm, prompts, _seeded(len(prompts)))
        acc_greedy = llm.get_metrics()["acceptance_length"]
    with LLM(path, speculative_config=AUTO, **LLM_KW) as llm:
        mixed = [greedy if i % 2 else p for i, p in enumerate(_seeded(len(prompts)))]
        out_mixed = _gen(llm, prompts, mixed)
        assert [o for i, o in enumerate(out_mixed) if i % 2] == [o for i, o in enumerate(ref_greedy) if i % 2]
        llm.reset_metrics()
        a = _gen(llm, prompts, _seeded(len(prompts)))
        acc_auto = llm.get_metrics()["acceptance_length"]
        b = _gen(llm, prompts, _seeded(len(prompts)))
        assert a == b  # across runs
        order = [3, 0, 5, 1, 4, 2]  # other batch positions and neighbours
        c = _gen(llm, [prompts[i] for i in order], [_seeded(len(prompts))[i] for i in order])
        assert c == [a[i] for i in order]
        assert _gen(llm, prompts[2:3], _seeded(3)[2:3]) == a[2:3]  # alone
        # rows with top-k / top-p keep greedy drafts (documented fall-back): still exact and seeded
        kp = _gen(llm, prompts, _seeded(len(prompts), top_k=20, top_p=0.9))
        assert kp == _gen(llm, prompts, _seeded(len(prompts), top_k=20, top_p=0.9))
    assert acc_auto > acc_greedy + 0.2, (acc_auto, acc_greedy)


def _homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square two-sample homogeneity p-value of two count vectors (bins with < 10 pooled merged)."""
    import torch
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    if a[-1] + b[-1] == 0:
        a, b = a[:-1], b[:-1]
    na, nb, tot = a.sum(), b.sum(), a + b
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float((((a - ea) ** 2) / ea).sum() + (((b - eb) ** 2) / eb).sum())
    df = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_emitted_tokens_follow_plain_sampling_law(model) -> None:
    """Tokens 2..4 (verified against sampled drafts) have the marginal law of plain sampling."""
    path, cfg, prompts = model
    n, prompt = 480, prompts[3]
    params = [SamplingParams(temperature=5.0, seed=10_000 + i, max_tokens=4, ignore_eos=True) for i in range(n)]
    with LLM(path, speculative_config=AUTO, **dict(LLM_KW, max_num_seqs=32)) as llm:
        spec = np.array(_gen(llm, [prompt] * n, params))
        m = llm.get_metrics()
        assert m["num_accepted_tokens"] > 0.1 * m["num_draft_tokens"], m
    plain_params = [SamplingParams(temperature=5.0, seed=20_000 + i, max_tokens=4, ignore_eos=True) for i in range(n)]
    with LLM(path, **dict(LLM_KW, max_num_seqs=32)) as llm:
        plain = np.array(_gen(llm, [prompt] * n, plain_params))
    for j in range(1, 4):
        p = _homogeneity_p(np.bincount(spec[:, j], minlength=cfg.vocab_size),
                           np.bincount(plain[:, j], minlength=cfg.vocab_size))
        assert p > 1e-4, (j, p)


def test_tp2_and_static_graphs_equal_tp1_and_count_draft_bytes(model) -> None:
    path, cfg, prompts = model
    with LLM(path, speculative_config=AUTO, **LLM_KW) as llm:
        ref = _gen(llm, prompts, _seeded(len(prompts)))
    with LLM(path, tensor_parallel_size=2, speculative_config=AUTO, **LLM_KW) as llm:
        got = _gen(llm, prompts, _seeded(len(prompts)))
        m = llm.get_metrics()
    assert got == ref
    with LLM(path, speculative_config=AUTO, **dict(LLM_KW, graph_mode="static")) as llm:  # padded graph buffers
        assert _gen(llm, prompts, _seeded(len(prompts))) == ref
    per_step = m["comm_bytes_per_step"]
    assert per_step.get("all_gather_draft_sample", 0) > 0, per_step
    assert per_step.get("all_gather_residual_sample", 0) > 0, per_step


def test_preemption_chunked_prefill_and_n_gt_1(model) -> None:
    """Chunked prefill with a small token budget (partial chunks keep no drafts) gives the roomy
    run's seeded tokens; n > 1 children (one q each) are reproducible and distinct; tight KV
    blocks (preemption by recompute drops the pending drafts and their q) run to completion. A
    preemption changes the realisation (the recomputed position is sampled plainly, where the
    roomy run verified sampled drafts there): same law, not the same tokens (docs/serving.md)."""
    path, cfg, prompts = model
    params = _seeded(len(prompts), max_tokens=24)
    kid_params = SamplingParams(temperature=8.0, seed=3, n=3, max_tokens=12, ignore_eos=True)
    with LLM(path, speculative_config=AUTO, **LLM_KW) as llm:
        ref = _gen(llm, prompts, params)
        kids = llm.generate(token_prompts(prompts[:2]), kid_params, use_tqdm=False)
    with LLM(path, speculative_config=AUTO, **dict(LLM_KW, max_num_batched_tokens=8 * 4 + 3)) as llm:
        assert _gen(llm, prompts, params) == ref
        kids2 = llm.generate(token_prompts(prompts[:2]), kid_params, use_tqdm=False)
    with LLM(path, speculative_config=AUTO, **dict(LLM_KW, num_kv_blocks=40)) as llm:
        tight = _gen(llm, prompts, params)
        assert llm.get_metrics()["num_preemptions"] > 0
    assert [len(t) for t in tight] == [24] * len(prompts)
    assert [[c.token_ids for c in o.outputs] for o in kids] == [[c.token_ids for c in o.outputs] for o in kids2]
    assert all(len({tuple(c.token_ids) for c in o.outputs}) == 3 for o in kids)


def _forget_every_other_step(runner) -> bool:
    """Runs on the rank: drop the sampled drafts' row map before every other step (as if each
    decode had sat the previous step out)."""
    inner = runner.execute_model
    count = [0]

    def wrapped(step):
        count[0] += 1
        if count[0] % 2 == 0:
            runner._draft_rows = {}
        return inner(step)

    runner.execute_model = wrapped
    return True


def test_drafts_without_their_q_are_not_verified(model) -> None:
    """A decode whose drafts' q is gone verifies nothing: exactly one token (plain sampling's)
    that step; outputs complete and seeded-reproducible."""
    path, cfg, prompts = model
    params = _seeded(len(prompts), max_tokens=16)
    outs = []
    for _ in range(2):
        with LLM(path, speculative_config=AUTO, **LLM_KW) as llm:
            assert llm.collective_rpc(_forget_every_other_step) == [True]
            outs.append(_gen(llm, prompts, params))
            m = llm.get_metrics()
    assert outs[0] == outs[1] and [len(o) for o in outs[0]] == [16] * len(prompts)
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_proposer_rejects_models_without_sampling() -> None:
    import torch
    from mtpspec.spec_decode.mtp_proposer import MTPProposer
    with pytest.raises(TypeError, match="get_sampled_tokens"):
        MTPProposer(torch.nn.Linear(2, 2), 2, False, 4, 64, draft_sampling="auto")
    with pytest.raises(ValueError, match="draft_sampling"):
        MTPProposer(torch.nn.Linear(2, 2), 2, False, 4, 64, draft_sampling="nope")
