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
from test_scheduler import EOS, greedy_chain, target_next

from mtpspec import LLM, SamplingParams
from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import SchedulerConfig
from mtpspec.engine.parallel_sampling import ParentRequest, child_request_id, merge_metrics
from mtpspec.engine.scheduler import Scheduler
from mtpspec.engine.sequence import Sequence
from mtpspec.outputs import RequestMetrics
from mtpspec.sample.counter_rng import seed_to_u64

KW = dict(max_model_len=64, block_size=4, num_kv_blocks=256, max_num_seqs=16, seed=0)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [90], list(range(60, 78))]  # the last: 4 blocks + 2 tokens
SEEDS = [11, 2024, 7, 99]
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


def test_child_seeds_wrap_into_the_int64_range() -> None:
    """``seed + i`` of a child past 2**63 - 1 wraps to the same 64-bit key (SamplingParams refuses seeds
    outside int64, as the server does, so the unwrapped sum would fail the request)."""
    from mtpspec.engine.parallel_sampling import ParentRequest
    from mtpspec.sample.counter_rng import seed_to_u64
    parent = ParentRequest("r", SamplingParams(n=3, temperature=1.0, seed=2 ** 63 - 2), 0.0)
    seeds = [parent.child_params(i).seed for i in range(3)]
    assert seeds == [2 ** 63 - 2, 2 ** 63 - 1, -2 ** 63]
    assert [seed_to_u64(s) for s in seeds] == [seed_to_u64(2 ** 63 - 2 + i) for i in range(3)]


# ---------------------------------------------------------------------------- n > 1
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("k", [0, 3])
def test_children_equal_seeded_single_requests(model, singles, k, caching) -> None:
    """Child i of a request seeded s equals the n = 1 request seeded s + i at k = 0, token for
    token; at k = 3 as well (and the counters of speculative decoding add up over the children),
    with prefix caching on or off (the siblings read child 0's prompt blocks either way)."""
    path, _, cfg = model
    params = [_sp(s, n=N) for s in SEEDS]
    outs, m = _generate_n(path, k, singles, cfg.vocab_size, params, enable_prefix_caching=caching)
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
    # vLLM's prompt_tokens: each child's prompt once, at its first token (not again after a recompute)
    assert m["num_request_prompt_tokens"] == N * sum(len(o.prompt_token_ids) for o in outs)
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


def _record_schedules(sched) -> list:
    """Wrap ``sched.schedule``: the returned list gets each step's ``[(request id, start, num
    tokens, is_prefill)]`` and block copies."""
    seen, schedule = [], sched.schedule

    def watched(**kw):
        out = schedule(**kw)
        seen.append(([(s.seq.request_id, s.start_position, len(s.input_token_ids), s.is_prefill)
                      for s in out.scheduled], list(out.block_copies)))
        return out
    sched.schedule = watched
    return seen


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("k,n,best_of", [(0, 4, None), (3, 4, None), (3, 2, 6)])
def test_children_share_the_prompt_blocks(model, singles, k, n, best_of, caching) -> None:
    """The 18-token prompt (block size 4: positions 0..15 in 4 full blocks, 16..17 in a fifth) is
    prefilled by child 0 alone; the next step every sibling forks it: the 4 full blocks are
    shared (reference count = children), the fifth is copied and each sibling computes position
    17 only (its own sample and MTP entry). The request then holds child 0's blocks plus one per
    sibling instead of a prompt's worth per child; caching on or off. The tokens equal the n = 1
    requests seeded seed + i (best_of: the top n of them by cumulative logprob)."""
    path, _, cfg = model
    prompt, num = PROMPTS[3], best_of or n
    # the step-by-step checks below assume each step's tokens are applied in it (k = 0 with async
    # scheduling applies them one step later: tests/test_async_scheduling.py)
    with _llm(path, k, enable_prefix_caching=caching, async_scheduling=False) as llm:
        eng = llm.llm_engine
        if k:
            eng.draft_hook = _reference_hook(singles, cfg.vocab_size)
        sched, bm = eng.scheduler, eng.scheduler.block_manager
        total, seen = bm.num_free_blocks, _record_schedules(sched)
        eng.add_request({"prompt_token_ids": prompt}, _sp(SEEDS[3], n=n, best_of=best_of), request_id="par")
        kids = eng.get_parent("par").children
        assert [s.request_id for s in sched.waiting] == [f"{i}_par" for i in range(num)]  # vLLM's child ids
        assert eng.step() == []
        # child 0 alone: 18 positions + k - 1 draft slots -> 5 blocks; the siblings wait
        assert seen[0] == ([("0_par", 0, 18, True)], []) and sched.running == kids[:1]
        assert list(sched.waiting) == kids[1:] and total - bm.num_free_blocks == 5
        eng.step()
        sibs = [(f"{i}_par", 17, 1, True) for i in range(1, num)]
        assert seen[1][0] == [("0_par", 18, 1 + k, False)] + sibs
        assert seen[1][1] == [(kids[0].block_table[4], c.block_table[4]) for c in kids[1:]]
        assert sched.running == kids and all(len(c.output_token_ids) >= 1 for c in kids)
        shared = kids[0].block_table[:4]
        assert all(c.block_table[:4] == shared for c in kids) and len({c.block_table[4] for c in kids}) == num
        assert [bm.pool.ref_cnt[b] for b in shared] == [num] * 4
        # child 0's decode: 19 + 2k slots (5 blocks; k = 3: 7); each sibling: 1 block (20 < 25 slots)
        assert total - bm.num_free_blocks == (7 if k else 5) + (num - 1)  # unshared: >= 5 * num
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        assert bm.num_free_blocks == total
    (o,) = outs
    cands = [singles[(3, i)].outputs[0] for i in range(num)]
    order = sorted(range(num), key=lambda i: -cands[i].cumulative_logprob)[:n] if best_of else range(n)
    assert [c.token_ids for c in o.outputs] == [cands[i].token_ids for i in order]
    assert o.num_cached_tokens == 0 and all(c.metrics.num_cached_tokens == 0 for c in kids)


def test_chunked_prompt_children_equal_singles_and_do_not_block_others(model, singles) -> None:
    """Chunked prefill of 4 tokens a step, k = 3: child 0 prefills the 18-token prompt over 5
    steps while its siblings keep their place in the queue and requests behind them are
    admitted; the tokens still equal the seeded n = 1 requests."""
    path, _, cfg = model
    with _llm(path, 3, long_prefill_token_threshold=4) as llm:
        eng = llm.llm_engine
        eng.draft_hook = _reference_hook(singles, cfg.vocab_size)
        seen = _record_schedules(eng.scheduler)
        eng.add_request({"prompt_token_ids": PROMPTS[3]}, _sp(SEEDS[3], n=N), request_id="a")
        eng.add_request({"prompt_token_ids": PROMPTS[0]}, _sp(SEEDS[0]), request_id="b")
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
    assert [r for r, *_ in seen[0][0]] == ["0_a", "b"]  # b passes the waiting siblings
    starts = [[(st, ln) for r, st, ln, pre in step if r == "0_a" and pre] for step, _ in seen[:5]]
    assert starts == [[(0, 4)], [(4, 4)], [(8, 4)], [(12, 4)], [(16, 2)]]
    assert all("1_a" not in [r for r, *_ in step] for step, _ in seen[:5])
    assert sorted(r for r, *_ in seen[5][0]) == ["0_a", "1_a", "2_a", "3_a", "b"]  # the siblings fork
    by_id = {o.request_id: o for o in outs}
    assert [c.token_ids for c in by_id["a"].outputs] == [singles[(3, i)].outputs[0].token_ids for i in range(N)]
    assert by_id["b"].outputs[0].token_ids == singles[(0, 0)].outputs[0].token_ids


def test_abort_mid_prefill_aborts_running_and_waiting_children(model) -> None:
    path, _, _ = model
    with _llm(path, 3, long_prefill_token_threshold=4) as llm:
        eng = llm.llm_engine
        bm = eng.scheduler.block_manager
        free = bm.num_free_blocks
        eng.add_request({"prompt_token_ids": PROMPTS[3]}, _sp(3, n=N, max_tokens=40), request_id="a")
        eng.add_request({"prompt_token_ids": PROMPTS[2]}, _sp(4, max_tokens=40), request_id="other")
        for _ in range(2):
            assert eng.step() == []
        kids = eng.get_parent("a").children
        assert kids[0].is_prefill and kids[0].num_computed_tokens == 8 and list(eng.scheduler.waiting) == kids[1:]
        out = eng.abort_request("a")
        assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * N
        assert [s.request_id for s in eng.scheduler.running] == ["other"] and not eng.scheduler.waiting
        while eng.has_unfinished_requests():
            eng.step()
        assert bm.num_free_blocks == free


@pytest.mark.parametrize("k", [0, 3])
def test_an_abort_that_leaves_the_engine_idle_frees_every_block(model, k) -> None:
    """An ``n > 1`` request aborted with nothing else to run, at every step of its start (the fork
    step copies child 0's partial last prompt block): every block is free once the engine is idle.
    The copy's source stayed pinned until the next schedule, which an idle engine never runs, so
    ``/metrics`` showed one block in use with no request left (a new-user pass, 2026-12-07)."""
    path, _, _ = model
    with _llm(path, k) as llm:
        eng = llm.llm_engine
        bm = eng.scheduler.block_manager
        free = bm.num_free_blocks
        for steps in range(5):
            rid = f"a{steps}"
            eng.add_request({"prompt_token_ids": PROMPTS[1]}, _sp(3, n=3, max_tokens=40), request_id=rid)
            for _ in range(steps):
                eng.step()
            assert eng.abort_request(rid).finished
            while eng.has_unfinished_requests():
                eng.step()
            assert bm.num_free_blocks == free and not bm._pinned, steps


# ---------------------------------------------------------------------------- scheduler only (simulated greedy model)
def _family(num_blocks: int, max_tokens: int = 4, caching: bool = False, other: bool = False):
    """A scheduler (block size 4, chunks of 4 tokens, k = 0) holding [a 7-token request "o"
    (``other``)], then a request "p" of 3 children on the 18-token prompt."""
    cfg = SchedulerConfig(max_num_seqs=8, max_model_len=64, long_prefill_token_threshold=4)
    sched = Scheduler(cfg, BlockManager(num_blocks, 4, watermark=0.0, enable_caching=caching, key_next_token=False),
                      [EOS])
    if other:
        sched.add(Sequence("o", None, PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True), 0, 0.0))
    parent = ParentRequest("p", SamplingParams(temperature=1.0, n=3, max_tokens=max_tokens, ignore_eos=True), 1.0)
    for i in range(3):
        s = Sequence(child_request_id("p", i), None, PROMPTS[3], parent.child_params(i), 0, 1.0)
        s.parent = parent
        parent.children.append(s)
        sched.add(s)
    return sched, parent.children


def _step(sched: Scheduler) -> list:
    """One step of the simulated greedy model; returns ``[(request id, start, num tokens)]`` and
    the preempted ids."""
    out = sched.schedule()
    assert not out.is_empty, "scheduler stalled"
    sched.update_from_output(out, [[] if s.is_partial_prefill else [target_next(s.seq.all_token_ids)]
                                   for s in out.scheduled], None)
    return [(s.seq.request_id, s.start_position, len(s.input_token_ids)) for s in out.scheduled], \
        [s.request_id for s in out.preempted]


def _finish(sched: Scheduler, kids, steps: list) -> None:
    while sched.has_unfinished():
        steps.append(_step(sched))
        assert len(steps) < 200
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert all(c.output_token_ids == greedy_chain(PROMPTS[3], c.params.max_tokens) for c in kids)


def test_child0_preempted_mid_prompt_then_siblings_fork() -> None:
    """7 blocks: "o" (7 tokens, 2 blocks) and child 0's prompt (5 blocks) fill them; o's decode
    at 9 tokens needs a third block and preempts child 0 mid-prompt (12 of 18 computed). Child 0
    goes back to the head of the queue (its siblings behind it), is prefilled again once o
    finished, and the siblings then fork it."""
    sched, kids = _family(7, other=True)
    steps = [_step(sched) for _ in range(4)]
    assert [sch for sch, _ in steps[:3]] == [[("o", 0, 4), ("0_p", 0, 4)], [("o", 4, 3), ("0_p", 4, 4)],
                                            [("o", 7, 1), ("0_p", 8, 4)]]
    assert steps[3] == ([("o", 8, 1)], ["0_p"])
    assert list(sched.waiting) == kids and kids[0].num_computed_tokens == 0
    _finish(sched, kids, steps)
    firsts = [next(i for i, (sch, _) in enumerate(steps) if any(r == c.request_id for r, *_ in sch)) for c in kids]
    restart = firsts[0] + next(i for i, (sch, _) in enumerate(steps[firsts[0]:]) if ("0_p", 0, 4) in sch and i)
    assert firsts[1] > restart and ("1_p", 17, 1) in steps[firsts[1]][0] and ("2_p", 17, 1) in steps[firsts[2]][0]


@pytest.mark.parametrize("caching", [True, False])
def test_child0_finished_by_its_first_token_or_aborted(caching) -> None:
    """With nothing to fork (child 0 finished by its first token, or aborted alone mid-prompt)
    the siblings are admitted as any request: the prefix cache serves the 4 full blocks when on,
    else they compute the whole prompt."""
    sched, kids = _family(40, max_tokens=1, caching=caching)
    steps = [_step(sched) for _ in range(5)]
    assert [sch for sch, _ in steps] == [[("0_p", 0, 4)], [("0_p", 4, 4)], [("0_p", 8, 4)], [("0_p", 12, 4)],
                                         [("0_p", 16, 2)]]
    assert kids[0].is_finished and not kids[0].block_table
    start = 16 if caching else 0
    assert _step(sched)[0] == [("1_p", start, 4 if not caching else 2), ("2_p", start, 4 if not caching else 2)]
    _finish(sched, kids, steps)
    sched, kids = _family(40, caching=caching)
    _step(sched)  # child 0's first chunk: block 0 is cached
    sched.abort("0_p")
    start = 4 if caching else 0
    assert _step(sched)[0] == [("1_p", start, 4), ("2_p", start, 4)]
    steps = []
    _finish(sched, kids[1:], steps)


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
