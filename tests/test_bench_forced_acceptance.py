"""Forced acceptance (synthetic verifier for kernel A/B runs): structure, rates, and tp 2 == tp 1."""

from __future__ import annotations

import math

import pytest
import torch

from test_server_fixtures import make_served_model

from mtpspec import LLM, SamplingParams
from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, ForcedAcceptanceSampler, enable_forced_acceptance
from mtpspec.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID


def test_parse_and_errors():
    assert ForcedAcceptance.parse("rate:0.7") == ForcedAcceptance("rate", 0.7, 0)
    assert ForcedAcceptance.parse("length:2, seed:5") == ForcedAcceptance("length", 2.0, 5)
    assert ForcedAcceptance.parse("length:2").describe() == "length:2"
    assert ForcedAcceptance("rate", 0.5).expected_acceptance_length(3) == pytest.approx(1.875)
    assert ForcedAcceptance("length", 5).expected_acceptance_length(3) == 4.0
    for bad in ("rate:1.5", "rate:-0.1", "length:1.5", "length:-1", "len:2", "foo", "rate:x", "rate:0.5,length:1"):
        with pytest.raises(ValueError):
            ForcedAcceptance.parse(bad)


def _check_structure(out, drafts, logits):
    toks, a = out.output_token_ids, out.num_accepted
    target = logits.argmax(-1)
    for r in range(drafts.shape[0]):
        n = int(a[r])
        assert toks[r, :n].tolist() == drafts[r, :n].tolist()
        assert int(toks[r, n]) == int(target[r, n])  # the token after the accepted drafts: target argmax
        assert (toks[r, n + 1:] == PLACEHOLDER_TOKEN_ID).all()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_rate_mode_positions_follow_powers(k):
    g = torch.Generator().manual_seed(k)
    b, vocab, p = 6000, 50, 0.6
    drafts = torch.randint(0, vocab, (b, k), generator=g)
    logits = torch.randn(b, k + 1, vocab, generator=g)
    sampler = ForcedAcceptanceSampler(ForcedAcceptance("rate", p, seed=k))
    out = sampler(drafts, logits, None)
    _check_structure(type(out)(out.output_token_ids[:300], out.num_accepted[:300]), drafts[:300], logits[:300])
    a = out.num_accepted
    for j in range(k):  # position j reached with probability p ** (j + 1)
        freq = (a > j).double().mean().item()
        want = p ** (j + 1)
        assert abs(freq - want) < 5 * math.sqrt(want * (1 - want) / b), (j, freq, want)
    # same seed, same draws (this is what keeps tensor-parallel ranks in agreement)
    again = ForcedAcceptanceSampler(ForcedAcceptance("rate", p, seed=k))(drafts, logits, None)
    assert torch.equal(again.num_accepted, a)


def test_length_mode():
    g = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 30, (20, 3), generator=g)
    logits = torch.randn(20, 4, 30, generator=g)
    for length, want in ((0, 0), (2, 2), (7, 3)):
        out = ForcedAcceptanceSampler(ForcedAcceptance("length", length))(drafts, logits, None)
        assert out.num_accepted.tolist() == [want] * 20
        _check_structure(out, drafts, logits)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("forced_model"))
    make_served_model(path, seed=11)
    return path


def test_engine_forced_rate_tp2_equals_tp1(model_dir):
    prompts = ["Question: Tom has 3 apples.", "A farmer sells eggs", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": True}
    setting = ForcedAcceptance("rate", 0.7, seed=3)
    results = {}
    for tp in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=tp, device="cpu", max_model_len=256, speculative_config=spec,
                  num_kv_blocks=64)
        try:
            enable_forced_acceptance(llm, setting)
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[tp] = ([o.outputs[0].token_ids for o in outs], llm.get_metrics())
        finally:
            llm.shutdown()
    toks1, m1 = results[1]
    toks2, m2 = results[2]
    assert toks2 == toks1
    assert m2["num_accepted_tokens_per_pos"] == m1["num_accepted_tokens_per_pos"]
    # forced, not real: random MTP layers never reach this acceptance on their own
    assert m1["acceptance_length"] > 1.8
    with pytest.raises(ValueError, match="speculative"):
        plain = LLM(model_dir, device="cpu", max_model_len=256, num_kv_blocks=64)
        try:
            enable_forced_acceptance(plain, setting)
        finally:
            plain.shutdown()


def test_forced_sampler_takes_every_argument_of_the_rejection_sampler():
    """The runner calls whichever sampler is installed with RejectionSampler's keywords: the forced
    one must accept each of them (a new keyword once broke every forced-acceptance bench run)."""
    import inspect

    from mtpspec.sample.rejection_sampler import RejectionSampler
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptanceSampler
    want = set(inspect.signature(RejectionSampler.forward).parameters)
    have = set(inspect.signature(ForcedAcceptanceSampler.forward).parameters)
    assert want <= have, f"ForcedAcceptanceSampler.forward lacks {sorted(want - have)}"
