"""Parallel sampling: ``n > 1`` and ``best_of`` (one request fanned out into child sequences).

References: separate ``n = 1`` requests seeded ``seed + i`` at k = 0 (vLLM's seed of child ``i``),
which the children must equal token for token at k = 0 and k = 3 (seeded speculative decoding
draws each position's token as plain sampling does, so k does not change them); a float64
``log_softmax`` of ``transformers``' own model over prompt + output for the cumulative
log-probabilities that ``best_of`` ranks by.

Random MTP layers almost never propose a likely token, so at k = 3 the drafts come from a hook:
each child's own k = 0 continuation with 30% of the tokens corrupted (acceptances, rejections
and bonus tokens all occur).
"""

from __future__ import annotations

import asyncio
import hashlib
import math

import pytest
import torch

from test_engine_fixtures import make_model, token_prompts

from mtpspec import LLM, SamplingParams
from mtpspec.engine.parallel_sampling import merge_metrics
from mtpspec.outputs import RequestMetrics
from mtpspec.sample.counter_rng import seed_to_u64

KW = dict(max_model_len=64, block_size=4, num_kv_blocks=256, max_num_seqs=16, seed=0)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [90]]
SEEDS = [11, 2024, 7]
N = 4
MAX_TOKENS = 12


def _sp(seed, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0.8, top_k=50, seed=seed, ignore_eos=True, **kw)


class ChildDrafts:
    """Draft hook: the sequence's own reference continuation (looked up by its seed key) with a
    deterministic 30% of the drafts corrupted."""

    def __init__(self, reference, vocab, corrupt=0.3):
        self.reference, self.vocab, self.corrupt, self.calls = reference, vocab, corrupt, 0

    def __call__(self, seq, proposed):
        self.calls += 1
        ref = self.reference[seq.seed_key]
        out = []
        for j in range(len(proposed)):
            i = len(seq.output_token_ids) + j
            t = ref[i] if i < len(ref) else 3
            h = hashlib.blake2b(repr((seq.seed_key, i, j)).encode(), digest_size=8).digest()
            if int.from_bytes(h, "little") / 2.0 ** 64 < self.corrupt:
                t = 3 + (t + 1) % (self.vocab - 3)
            out.append(t)
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_parallel"))
    hf, cfg = make_model(path, seed=13)
    return path, hf, cfg


def _llm(path, k=0, **kw) -> LLM:
    spec = {"num_speculative_tokens": k} if k else None
    return LLM(path, speculative_config=spec, **{**KW, **kw})


@pytest.fixture(scope="module")
def singles(model):
    """k = 0 references: prompt p, seed SEEDS[p] + i as a plain n = 1 request, for i < 6; with
    logprobs (the sampled token's) to rank best_of candidates."""
    path, _, _ = model
    reqs = [(p, i) for p in range(len(PROMPTS)) for i in range(6)]
    with _llm(path) as llm:
        outs = llm.generate(token_prompts([PROMPTS[p] for p, _ in reqs]),
                            [_sp(SEEDS[p] + i, logprobs=0) for p, i in reqs], use_tqdm=False)
        m = llm.get_metrics()
    assert m["num_preemptions"] == 0
    return {r: o for r, o in zip(reqs, outs)}


def _reference_hook(singles, vocab):
    ref = {seed_to_u64(SEEDS[p] + i): o.outputs[0].token_ids + [3] * 4 for (p, i), o in singles.items()}
    return ChildDrafts(ref, vocab)


def _generate_n(path, k, singles, vocab, params, **kw):
    with _llm(path, k, **kw) as llm:
        if k:
            llm.llm_engine.draft_hook = _reference_hook(singles, vocab)
        outs = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        return outs, llm.get_metrics()


# ---------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n=0), ValueError, "n must be at least 1, got 0."),
    (dict(n=-2), ValueError, "n must be at least 1, got -2."),
    (dict(n=2.0), TypeError, "n must be an int, but is of type float"),
    (dict(n=True), TypeError, "n must be an int, but is of type bool"),
    (dict(n=16385), ValueError, "n must be at most 16384, got 16385."),
    (dict(n=3, best_of=2), ValueError, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    (dict(best_of=0), ValueError, "best_of must be at least 1, got 0."),
    (dict(best_of="2"), TypeError, "best_of must be an int"),
    (dict(n=2, temperature=0.0), ValueError, "n must be 1 when using greedy sampling, got 2."),
    (dict(best_of=3, temperature=0.0), ValueError, "best_of must be 1 when using greedy sampling, got 3."),
])
def test_bad_n_and_best_of(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_n_and_best_of_defaults() -> None:
    sp = SamplingParams()
    assert sp.n == 1 and sp.best_of is None and sp.num_sequences == 1
    assert SamplingParams(n=3).num_sequences == 3 and SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(temperature=0.0, n=1, best_of=1).num_sequences == 1


# ---------------------------------------------------------------------------- n > 1
@pytest.mark.parametrize("k", [0, 3])
def test_children_equal_seeded_single_requests(model, singles, k) -> None:
    """Child i of a request seeded s equals the n = 1 request seeded s + i at k = 0, token for
    token; at k = 3 as well (and the counters of speculative decoding add up over the children)."""
    path, _, cfg = model
    params = [_sp(s, n=N) for s in SEEDS]
    outs, m = _generate_n(path, k, singles, cfg.vocab_size, params)
    for p, o in enumerate(outs):
        assert o.finished and [c.index for c in o.outputs] == list(range(N))
        assert o.prompt_token_ids == PROMPTS[p]
        for c in o.outputs:
            ref = singles[(p, c.index)].outputs[0]
            assert c.token_ids == ref.token_ids, (p, c.index)
            assert c.finish_reason == "length" and c.logprobs is None and c.cumulative_logprob is None
        assert o.metrics.num_output_tokens == N * MAX_TOKENS
        assert len({tuple(c.token_ids) for c in o.outputs}) == N  # seeded children differ
    if k:
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
        assert sum(o.metrics.num_drafts for o in outs) == m["num_drafts"]
        assert sum(o.metrics.num_accepted_tokens for o in outs) == m["num_accepted_tokens"]
        for o in outs:
            assert sum(o.metrics.accepted_length_histogram) == o.metrics.num_drafts > 0
            assert sum(o.metrics.num_accepted_tokens_per_pos) == o.metrics.num_accepted_tokens


def test_children_survive_preemption(model, singles) -> None:
    """Too few KV blocks for every child at once: children are preempted and recomputed, and still
    draw the same tokens (each keeps its own seed stream)."""
    path, _, cfg = model
    outs, m = _generate_n(path, 3, singles, cfg.vocab_size, [_sp(s, n=N) for s in SEEDS], num_kv_blocks=24)
    assert m["num_preemptions"] > 0 and sum(o.metrics.num_preemptions for o in outs) == m["num_preemptions"]
    for p, o in enumerate(outs):
        assert [c.token_ids for c in o.outputs] == [singles[(p, i)].outputs[0].token_ids for i in range(N)]


def test_n1_is_one_plain_sequence(model, singles) -> None:
    """n = 1 takes the old path: no parent, the caller's request id, the request's own seed."""
    path, _, _ = model
    with _llm(path) as llm:
        eng = llm.llm_engine
        rid = eng.add_request({"prompt_token_ids": PROMPTS[0]}, _sp(SEEDS[0], n=1, best_of=1), request_id="plain")
        assert eng.get_parent(rid) is None and not eng._parents
        (seq,) = eng.scheduler.waiting
        assert seq.request_id == "plain" and seq.parent is None and seq.seed_key == seed_to_u64(SEEDS[0])
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
    (o,) = outs
    assert o.request_id == "plain" and len(o.outputs) == 1 and o.outputs[0].index == 0
    assert o.outputs[0].token_ids == singles[(0, 0)].outputs[0].token_ids


def test_unseeded_children_are_independent(model) -> None:
    """Without a seed every child draws its own engine seed: the children's first tokens are
    independent draws from softmax(logits / T) (brute force from transformers' logits; a shared
    stream would give one token for all), and longer continuations all differ."""
    path, hf, _ = model
    n, temp = 1000, 1.3
    with _llm(path, max_num_seqs=64) as llm:
        eng = llm.llm_engine
        eng.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=temp, n=n, max_tokens=1),
                        request_id="u")
        assert len({s.seed_key for s in eng.get_parent("u").children}) == n
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        (o,) = outs
        (o6,) = llm.generate(token_prompts(PROMPTS[:1]), SamplingParams(temperature=temp, n=6, max_tokens=16,
                                                                       ignore_eos=True), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in o6.outputs}) == 6
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([PROMPTS[0]])).logits[0, -1].double() / temp, dim=-1)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in o.outputs]), minlength=p.numel()).double()
    tv = 0.5 * (counts / n - p).abs().sum().item()
    # the same statistic for 400 exact multinomial draws of n samples: tv must look like one of them
    g = torch.Generator().manual_seed(0)
    sims = torch.stack([torch.bincount(torch.multinomial(p, n, replacement=True, generator=g), minlength=p.numel())
                        for _ in range(400)]).double()
    sim_tv = 0.5 * (sims / n - p).abs().sum(dim=1)
    assert tv <= sim_tv.quantile(0.999).item(), (tv, sim_tv.median().item())
    assert (counts > 0).sum() >= 5


def test_greedy_n_is_refused_before_anything_is_queued(model) -> None:
    """vLLM refuses greedy n > 1 (the copies would be identical)."""
    path, _, _ = model
    with _llm(path) as llm:
        with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 3"):
            llm.generate(token_prompts(PROMPTS[:1]), SamplingParams(temperature=0.0, n=3))
        assert not llm.llm_engine.has_unfinished_requests()


def test_children_share_one_step_and_child_ids(model) -> None:
    """The children are queued together, so one step admits all of them (vLLM's ids ``i_parent``)."""
    path, _, _ = model
    with _llm(path) as llm:
        eng = llm.llm_engine
        eng.add_request({"prompt_token_ids": PROMPTS[1]}, _sp(1, n=5), request_id="par")
        assert [s.request_id for s in eng.scheduler.waiting] == [f"{i}_par" for i in range(5)]
        assert eng.step() == []
        parent = eng.get_parent("par")
        assert len(eng.scheduler.running) == 5 and all(len(c.output_token_ids) == 1 for c in parent.children)
        assert all(c.metrics.first_scheduled_time is not None for c in parent.children)


def test_abort_aborts_every_child(model) -> None:
    path, _, _ = model
    with _llm(path, 3) as llm:
        eng = llm.llm_engine
        bm = eng.scheduler.block_manager
        free = bm.num_free_blocks
        eng.add_request({"prompt_token_ids": PROMPTS[0]}, _sp(3, n=3, max_tokens=40), request_id="a")
        eng.add_request({"prompt_token_ids": PROMPTS[2]}, _sp(4, max_tokens=40), request_id="other")
        for _ in range(3):
            assert eng.step() == []
        out = eng.abort_request("a")
        assert out.request_id == "a" and out.finished and len(out.outputs) == 3
        assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and all(c.token_ids for c in out.outputs)
        assert [s.request_id for s in eng.scheduler.running] == ["other"]
        assert eng.get_parent("a") is None and eng.abort_request("a") is None
        while eng.has_unfinished_requests():
            eng.step()
        assert bm.num_free_blocks == free


def test_prompt_logprobs_scored_once(model) -> None:
    path, _, _ = model
    with _llm(path) as llm:
        eng = llm.llm_engine
        eng.add_request({"prompt_token_ids": PROMPTS[1]}, _sp(5, n=3, prompt_logprobs=2, max_tokens=3),
                        request_id="pl")
        kids = eng.get_parent("pl").children
        assert [c.params.prompt_logprobs for c in kids] == [2, None, None]
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
    (o,) = outs
    assert len(o.prompt_logprobs) == len(PROMPTS[1]) and o.prompt_logprobs[0] is None
    assert all(d is not None for d in o.prompt_logprobs[1:])


def test_merge_metrics() -> None:
    a = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, last_token_time=4.0,
                       finished_time=4.0, itl=[1.0, 1.0], num_output_tokens=3, num_drafts=2, num_draft_tokens=6,
                       num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0],
                       accepted_length_histogram=[0, 1, 1, 0], num_preemptions=1)
    b = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=2.5, last_token_time=5.0,
                       finished_time=5.0, itl=[2.5], num_output_tokens=2, num_drafts=1, num_draft_tokens=3,
                       num_accepted_tokens=1, num_accepted_tokens_per_pos=[1, 0, 0],
                       accepted_length_histogram=[0, 1, 0, 0])
    m = merge_metrics(1.0, [a, b])
    assert (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time) == (1.25, 2.0, 5.0, 5.0)
    assert m.itl == [1.0, 1.0, 2.5] and m.num_output_tokens == 5 and m.num_preemptions == 1
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 9, 4)
    assert m.num_accepted_tokens_per_pos == [3, 1, 0] and m.accepted_length_histogram == [0, 2, 1, 0]
    assert m.acceptance_length == 1 + 4 / 3 and m.ttft == 1.0
    b.finished_time = None
    assert merge_metrics(1.0, [a, b]).finished_time is None


# ---------------------------------------------------------------------------- best_of
def _brute_force_cumulative(hf, prompt, tokens) -> float:
    ids = list(prompt) + list(tokens)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    return sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens))


@pytest.mark.parametrize("k", [0, 3])
def test_best_of_returns_the_top_n_by_cumulative_logprob(model, singles, k) -> None:
    """best_of = 6, n = 2: the two candidates (the n = 1 requests seeded s + i) whose float64
    brute-force cumulative logprob is highest, best first; their per-token logprobs are not
    returned (not asked for), the cumulative one is."""
    path, hf, cfg = model
    best_of, n = 6, 2
    outs, _ = _generate_n(path, k, singles, cfg.vocab_size, [_sp(s, n=n, best_of=best_of) for s in SEEDS])
    not_first = 0
    for p, o in enumerate(outs):
        cands = [singles[(p, i)].outputs[0] for i in range(best_of)]
        brute = [_brute_force_cumulative(hf, PROMPTS[p], c.token_ids) for c in cands]
        for c, b in zip(cands, brute):  # the engine's own k = 0 values agree with the brute force
            assert math.isclose(c.cumulative_logprob, b, abs_tol=1e-4)
        order = sorted(range(best_of), key=lambda i: -brute[i])
        assert brute[order[n - 1]] - brute[order[n]] > 1e-3  # the pick is unambiguous
        not_first += order[:n] != list(range(n))
        assert o.finished and [c.index for c in o.outputs] == list(range(n))
        assert [c.token_ids for c in o.outputs] == [cands[i].token_ids for i in order[:n]]
        for c, i in zip(o.outputs, order[:n]):
            assert c.logprobs is None and math.isclose(c.cumulative_logprob, brute[i], abs_tol=1e-4)
        assert o.metrics.num_output_tokens == best_of * MAX_TOKENS
    assert not_first >= 2  # a "first n" or ascending pick would fail


def test_best_of_with_logprobs_keeps_them(model, singles) -> None:
    path, _, cfg = model
    outs, _ = _generate_n(path, 0, singles, cfg.vocab_size, [_sp(s, n=1, best_of=3, logprobs=2) for s in SEEDS])
    for p, o in enumerate(outs):
        (c,) = o.outputs
        best = max(range(3), key=lambda i: singles[(p, i)].outputs[0].cumulative_logprob)
        assert c.index == 0 and c.token_ids == singles[(p, best)].outputs[0].token_ids
        assert len(c.logprobs) == MAX_TOKENS and all(len(d) in (2, 3) for d in c.logprobs)
        assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)),
                            abs_tol=1e-9)


# ---------------------------------------------------------------------------- AsyncLLM
def test_async_llm_streams_all_children(model, singles) -> None:
    """n > 1 through AsyncLLM: every snapshot carries the n completions so far (cumulative); the
    last equals the offline children. best_of > n publishes only its final output."""
    from mtpspec.engine.async_llm import AsyncLLM
    path, _, _ = model
    eng = AsyncLLM(_llm(path, 3))
    try:
        async def collect(params):
            seen = []
            async for out in eng.generate({"prompt_token_ids": PROMPTS[1]}, params):
                seen.append(out)
            return seen

        async def main():
            return await asyncio.gather(collect(_sp(SEEDS[1], n=N)), collect(_sp(SEEDS[1], n=2, best_of=6)))

        seen, best = asyncio.run(main())
        assert len(seen) > 2 and seen[-1].finished and not any(o.finished for o in seen[:-1])
        for a, b in zip(seen, seen[1:]):
            assert len(a.outputs) == len(b.outputs) == N
            assert all(y.token_ids[:len(x.token_ids)] == x.token_ids for x, y in zip(a.outputs, b.outputs))
        assert [c.token_ids for c in seen[-1].outputs] == [singles[(1, i)].outputs[0].token_ids for i in range(N)]
        assert len(best) == 1 and best[0].finished and len(best[0].outputs) == 2
        s = eng.stats()
        assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks and s.num_pending == 0
    finally:
        eng.shutdown()
