"""Scheduler: budgets, preemption by recompute, stop handling, block accounting.

A simulated greedy model drives the scheduler: the "target" continuation of a token list is a
hash of it, the "drafts" agree with the target on a pseudo-random number of leading tokens. A
correct scheduler emits exactly the target's greedy chain for every request whatever the
batch composition, the block budget (preemptions) or k.
"""

from __future__ import annotations

import random
from typing import List, Optional

import pytest

from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import SchedulerConfig
from mtpspec.engine.scheduler import Scheduler
from mtpspec.engine.sequence import Sequence, SequenceStatus
from mtpspec.engine.stop_checker import append_tokens
from mtpspec.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def target_next(tokens: List[int]) -> int:
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ t) * 1099511628211) % (1 << 64)
    return 1 + h % (VOCAB - 1)  # never EOS


def draft(tokens: List[int], k: int, rng: random.Random) -> List[int]:
    """k drafts; each is right with probability 0.7 given the previous ones."""
    out, ctx = [], list(tokens)
    for _ in range(k):
        t = target_next(ctx)
        if rng.random() > 0.7:
            t = 1 + (t % (VOCAB - 1))
        out.append(t)
        ctx.append(t)
    return out


def greedy_chain(prompt: List[int], n: int) -> List[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(target_next(toks))
    return toks[len(prompt):]


def run_engine(prompts: List[List[int]], params: List[SamplingParams], k: int, num_blocks: int,
               block_size: int = 4, max_num_seqs: int = 4, max_model_len: int = 64, seed: int = 0,
               chunked: bool = True, budget: Optional[int] = None, threshold: int = 0, steps_out: Optional[list] = None):
    """Drive the scheduler with the simulated model until every request finishes.

    ``steps_out`` (a list) receives, per step, ``[(request_id, is_prefill, start, num_tokens,
    partial, tokens emitted)]`` in batch order.
    """
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_speculative_tokens=k,
                          max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=threshold)
    bm = BlockManager(num_blocks, block_size, watermark=0.0)
    sched = Scheduler(cfg, bm, [EOS])
    seqs = [Sequence(str(i), None, p, sp, 0, float(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    for s in seqs:
        sched.add(s)
    rng = random.Random(seed)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled"
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned)) and len(owned) + bm.num_free_blocks == num_blocks
        kinds = [sch.is_prefill for sch in out.scheduled]
        assert kinds == sorted(kinds), "decodes must come before prefill chunks"
        new_tokens, drafts = [], []
        for sch in out.scheduled:
            s = sch.seq
            # Block table covers every slot the step writes.
            need = cfg.prefill_slots(s.num_tokens) if sch.is_prefill else cfg.decode_slots(s.num_tokens)
            assert len(s.block_table) * block_size >= need
            ctx = s.all_token_ids
            if sch.is_prefill:
                start, end = sch.start_position, sch.start_position + len(sch.input_token_ids)
                assert start == s.num_computed_tokens and sch.input_token_ids == ctx[start:end]
                if not chunked:
                    assert start == 0 and end == len(ctx)
                if threshold:
                    assert end - start <= threshold
                if end < len(ctx):  # partial chunk: the next prompt token is handed over, nothing emitted
                    assert sch.is_partial_prefill and sch.next_token_id == ctx[end]
                    emitted = []
                else:
                    assert not sch.is_partial_prefill
                    emitted = [target_next(ctx)]
            else:
                assert sch.input_token_ids == [ctx[-1]] + s.draft_token_ids
                assert sch.start_position == len(ctx) - 1
                emitted, c = [], list(ctx)
                for d in s.draft_token_ids:
                    t = target_next(c)
                    emitted.append(t)
                    if t != d:
                        break
                    c.append(t)
                else:
                    emitted.append(target_next(c))
            new_tokens.append(emitted)
            drafts.append(draft(ctx + emitted, k, rng))  # a partial chunk's drafts must be ignored
        if steps_out is not None:
            steps_out.append([(sch.seq.request_id, sch.is_prefill, sch.start_position, len(sch.input_token_ids),
                               sch.is_partial_prefill, len(t)) for sch, t in zip(out.scheduled, new_tokens)])
        sched.update_from_output(out, new_tokens, drafts if k else None)
        steps += 1
        assert steps < 10000
    assert bm.num_free_blocks == num_blocks
    return seqs, sched


# (enable_chunked_prefill, max_num_batched_tokens offset above max_num_seqs * (1 + k), threshold)
CHUNKINGS = [(False, None, 0), (True, None, 0), (True, 1, 0), (True, 7, 0), (True, None, 1), (True, None, 7)]


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=["off", "on", "budget+1", "budget+7", "thr1", "thr7"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_tokens_independent_of_batching_and_preemption(k: int, chunking) -> None:
    chunked, extra, threshold = chunking
    budget = None if extra is None else 4 * (1 + k) + extra
    kw = dict(chunked=chunked, budget=budget, threshold=threshold)
    rng = random.Random(k)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30)) for _ in prompts]
    steps: list = []
    roomy, _ = run_engine(prompts, params, k, num_blocks=200, steps_out=steps, **kw)
    tight, sched = run_engine(prompts, params, k, num_blocks=14 + k, **kw)  # forces preemptions
    assert sched.num_preemptions > 0
    for p, sp, a, b in zip(prompts, params, roomy, tight):
        ref = greedy_chain(p, sp.max_tokens)
        assert a.output_token_ids == ref and b.output_token_ids == ref
        assert a.finish_reason == b.finish_reason == "length"
    assert sum(s.metrics.num_preemptions for s in tight) == sched.num_preemptions
    partial = sum(e[4] for st in steps for e in st)
    assert (partial > 0) == (budget is not None or threshold > 0), partial  # the chunked runs really chunk


def test_preempted_sequence_is_recomputed_as_prefill() -> None:
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=32, num_speculative_tokens=0)
    bm = BlockManager(4, 2, watermark=0.0)
    sched = Scheduler(cfg, bm, [EOS])
    a = Sequence("a", None, [1, 2, 3], SamplingParams(max_tokens=20), 0, 0.0)
    b = Sequence("b", None, [4, 5, 6], SamplingParams(max_tokens=20), 0, 1.0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    sched.update_from_output(out, [[7], [8]], None)  # each now 4 tokens, 3 computed: 2 blocks each
    out = sched.schedule()  # both fit (4 slots = 2 blocks each)
    sched.update_from_output(out, [[9], [10]], None)  # 5 tokens: each needs a 3rd block, none free
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"] and out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b]
    sched.update_from_output(out, [[11]], None)
    sched.abort("a")
    out = sched.schedule()
    assert out.scheduled[0].is_prefill and out.scheduled[0].input_token_ids == [4, 5, 6, 8, 10]


def test_budget_limits_admissions() -> None:
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=16, max_num_batched_tokens=16, num_speculative_tokens=1)
    sched = Scheduler(cfg, BlockManager(100, 4, watermark=0.0), [EOS])
    for i, n in enumerate([10, 5, 3]):
        sched.add(Sequence(str(i), None, list(range(1, n + 1)), SamplingParams(max_tokens=5), 0, float(i)))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["0", "1"]  # 15 tokens; "2" would exceed seqs
    sched.update_from_output(out, [[1], [1]], [[2], [2]])
    out = sched.schedule()
    assert [(s.seq.request_id, s.is_prefill) for s in out.scheduled] == [("0", False), ("1", False)]


def test_stop_conditions_and_truncation() -> None:
    def mk(**kw):
        return Sequence("x", None, [1, 2], SamplingParams(**kw), 0, 0.0)

    s = mk(max_tokens=10)
    assert append_tokens(s, [5, EOS, 6], [EOS], 100) == 2 and s.output_token_ids == [5, EOS]
    assert s.finish_reason == "stop" and s.stop_reason is None
    s = mk(max_tokens=10, ignore_eos=True)
    assert append_tokens(s, [5, EOS, 6], [EOS], 100) == 3 and s.finish_reason is None
    s = mk(max_tokens=10, stop_token_ids=[6])
    assert append_tokens(s, [5, 6, 7], [EOS], 100) == 2 and (s.finish_reason, s.stop_reason) == ("stop", 6)
    s = mk(max_tokens=2)
    assert append_tokens(s, [5, 6, 7, 8], [EOS], 100) == 2 and s.finish_reason == "length"
    s = mk(max_tokens=1)
    assert append_tokens(s, [5, 6], [EOS], 100) == 1 and s.output_token_ids == [5]
    s = mk(max_tokens=None)
    assert append_tokens(s, [5, 6, 7], [EOS], 4) == 2 and s.finish_reason == "length" and s.num_tokens == 4


def test_finished_sequences_free_blocks_and_record_metrics() -> None:
    prompts = [[3, 4], [5, 6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=4)]
    seqs, sched = run_engine(prompts, params, 3, num_blocks=50)
    for s in seqs:
        m = s.metrics
        assert m.num_output_tokens == len(s.output_token_ids)
        assert m.num_draft_tokens == 3 * m.num_drafts
        assert sum(m.accepted_length_histogram) == m.num_drafts
        assert sum(a * c for a, c in enumerate(m.accepted_length_histogram)) == m.num_accepted_tokens
        assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens
        assert all(x >= y for x, y in zip(m.num_accepted_tokens_per_pos, m.num_accepted_tokens_per_pos[1:]))
        assert m.acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts
        assert len(m.itl) == m.num_drafts  # one gap per decode step after the prefill


def test_config_rejects_unschedulable_limits() -> None:
    # Without chunked prefill a step must hold a whole prompt (today's rule) ...
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=32 .*chunked prefill off.*>= max_model_len \(64\)"):
        SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, num_speculative_tokens=3,
                        enable_chunked_prefill=False)
    # ... with it only a decode of every sequence, max_num_seqs * (1 + k).
    assert SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
                           num_speculative_tokens=3).max_num_batched_tokens == 32
    for chunked in (True, False):
        with pytest.raises(ValueError, match=r"max_num_batched_tokens=31 .*max_num_seqs \* \(1 \+ k\) = 8 \* 4 = 32"):
            SchedulerConfig(max_num_seqs=8, max_model_len=16, max_num_batched_tokens=31, num_speculative_tokens=3,
                            enable_chunked_prefill=chunked)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=5 .*needs enable_chunked_prefill=True"):
        SchedulerConfig(long_prefill_token_threshold=5, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0 .*got -1"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False, got 'no'"):
        SchedulerConfig(enable_chunked_prefill="no")
    # Defaults: chunked max(min(max_model_len, 2048), max_num_seqs * (1 + k)); off max(max_model_len, ...).
    assert SchedulerConfig(max_num_seqs=8, max_model_len=16, num_speculative_tokens=3).max_num_batched_tokens == 32
    assert SchedulerConfig(max_num_seqs=4, max_model_len=8192, num_speculative_tokens=3).max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_seqs=4, max_model_len=100).max_num_batched_tokens == 100
    assert SchedulerConfig(max_num_seqs=1024, max_model_len=8192, num_speculative_tokens=3).max_num_batched_tokens == 4096
    assert SchedulerConfig(max_num_seqs=4, max_model_len=8192, num_speculative_tokens=3,
                           enable_chunked_prefill=False).max_num_batched_tokens == 8192


def _seq(rid: str, prompt: List[int], max_tokens: int = 20) -> Sequence:
    return Sequence(rid, None, prompt, SamplingParams(max_tokens=max_tokens), 0, float(ord(rid[0])))


def test_long_prompt_is_chunked_while_decodes_keep_running() -> None:
    """Three decoding sequences keep getting their decode rows (and emitting tokens) in every step
    while a 40-token prompt is prefilled in chunks of the budget they leave."""
    k = 3
    prompts = [[5, 6], [7, 8, 9], [10], list(range(3, 43))]
    params = [SamplingParams(max_tokens=30)] * 3 + [SamplingParams(max_tokens=3)]
    steps: list = []
    seqs, _ = run_engine(prompts, params, k, num_blocks=200, max_num_seqs=4, budget=4 * (1 + k) + 6, steps_out=steps)
    chunk_steps = [st for st in steps if any(e[0] == "3" and e[1] for e in st)]
    starts = [e[2] for st in chunk_steps for e in st if e[0] == "3"]
    assert len(chunk_steps) >= 4 and starts == sorted(starts) and starts[0] == 0  # several chunks, in order
    assert [e[:2] for e in chunk_steps[0]] == [("0", True), ("1", True), ("2", True), ("3", True)]
    for st in chunk_steps[1:-1]:  # after the first step (every prompt admitted at once)
        assert [e[4] for e in st if e[0] == "3"] == [True]  # partial: nothing emitted
        decodes = [e for e in st if not e[1]]
        assert {e[0] for e in decodes} == {"0", "1", "2"} and all(e[5] >= 1 for e in decodes)
        assert sum(e[3] for e in st) <= 4 * (1 + k) + 6
    assert [e[5] for e in chunk_steps[-1] if e[0] == "3"] == [1]  # the last chunk samples
    assert seqs[3].output_token_ids == greedy_chain(prompts[3], 3)


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it() -> None:
    """--no-enable-chunked-prefill: today's rule; a prompt larger than the budget the decodes
    leave waits (never split). With chunking the same prompt gets that budget as its first chunk."""
    for chunked, expect in ((False, []), (True, [("b", 0, 14, True)])):
        cfg = SchedulerConfig(max_num_seqs=2, max_model_len=16, max_num_batched_tokens=16, num_speculative_tokens=1,
                              enable_chunked_prefill=chunked)
        sched = Scheduler(cfg, BlockManager(100, 4, watermark=0.0), [EOS])
        sched.add(_seq("a", [1, 2, 3]))
        out = sched.schedule()
        sched.update_from_output(out, [[4]], [[5]])
        sched.add(_seq("b", list(range(1, 16))))
        out = sched.schedule()  # a's decode takes 2 of the 16 tokens
        got = [(s.seq.request_id, s.start_position, len(s.input_token_ids), s.is_partial_prefill)
               for s in out.scheduled if s.is_prefill]
        assert got == expect, (chunked, got)
        assert out.num_decode_tokens == 2 and out.num_prefill_tokens == sum(g[2] for g in got)


def test_a_decode_takes_the_budget_of_the_drafts_it_holds() -> None:
    """A decode takes ``1 +`` (drafts it holds) of the token budget, not ``1 + k``: after a step that
    proposed fewer drafts (an adaptive step at k = 0), the rows they leave go to a prompt chunk
    (H200, 2026-12-05: reserving ``1 + k`` made prompt phases under adaptive speculation as slow as
    at k = 3)."""
    for drafts, chunk in (([5], 14), ([], 15)):
        cfg = SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, num_speculative_tokens=1)
        sched = Scheduler(cfg, BlockManager(100, 4, watermark=0.0), [EOS])
        sched.add(_seq("a", [1, 2, 3]))
        out = sched.schedule()
        sched.update_from_output(out, [[4]], [drafts])  # the step proposed len(drafts) drafts
        sched.add(_seq("b", list(range(1, 31))))
        out = sched.schedule()
        got = [(s.seq.request_id, len(s.input_token_ids)) for s in out.scheduled]
        assert got == [("a", 1 + len(drafts)), ("b", chunk)], (drafts, got)
        assert out.num_decode_tokens + out.num_prefill_tokens == 16


def test_partially_prefilled_sequence_preempted_restarts_from_scratch() -> None:
    """A decode that needs blocks preempts the partially prefilled sequence (the newest); it goes
    back to the waiting queue with nothing computed and is prefilled again from position 0."""
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=6, num_speculative_tokens=0,
                          long_prefill_token_threshold=4)
    bm = BlockManager(10, 2, watermark=0.0)
    sched = Scheduler(cfg, bm, [EOS])
    a = _seq("a", [1, 2, 3])
    b = _seq("b", list(range(1, 14)))  # 13 tokens = 7 blocks, all allocated at admission
    sched.add(a)
    out = sched.schedule()
    sched.update_from_output(out, [[7]], None)  # a: 4 tokens, 3 computed, 2 blocks
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.is_prefill, s.start_position, len(s.input_token_ids)) for s in out.scheduled] == \
        [("a", False, 3, 1), ("b", True, 0, 4)]
    sched.update_from_output(out, [[8], []], None)
    assert b.num_computed_tokens == 4 and b.is_prefill and len(b.block_table) == 7 and bm.num_free_blocks == 1
    for tok in (9, 10):  # a grows into the last free block; b: 8, then 12 computed
        sched.update_from_output(sched.schedule(), [[tok], []], None)
    assert b.num_computed_tokens == 12 and bm.num_free_blocks == 0 and a.num_tokens == 7
    out = sched.schedule()  # a (7 tokens -> 4 blocks) needs a block: b, the newest, is preempted mid-prompt
    assert out.preempted == [b] and [s.seq.request_id for s in out.scheduled] == ["a"]
    assert (b.status, b.num_computed_tokens, b.is_prefill, b.block_table) == (SequenceStatus.WAITING, 0, True, [])
    assert list(sched.waiting) == [b] and b.metrics.num_preemptions == 1
    sched.update_from_output(out, [[11]], None)
    sched.abort("a")
    out = sched.schedule()
    assert [(s.seq.request_id, s.start_position, s.input_token_ids) for s in out.scheduled] == \
        [("b", 0, [1, 2, 3, 4])]


def test_partial_chunk_update_checks_and_records_nothing() -> None:
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=32, num_speculative_tokens=2, long_prefill_token_threshold=3)
    sched = Scheduler(cfg, BlockManager(100, 4, watermark=0.0), [EOS])
    s = _seq("x", [4, 5, 6, 7, 8])
    sched.add(s)
    out = sched.schedule()
    assert out.scheduled[0].next_token_id == 7 and out.num_partial_prefills == 1
    with pytest.raises(RuntimeError, match="partial prefill chunk of 'x' returned 1 tokens, expected none"):
        sched.update_from_output(out, [[9]], [[1, 2]])
    s.num_computed_tokens = 0
    sched.update_from_output(out, [[]], [[1, 2]])
    assert s.output_token_ids == [] and s.draft_token_ids == [] and s.metrics.first_token_time is None
    out = sched.schedule()
    assert out.scheduled[0].input_token_ids == [7, 8] and out.scheduled[0].next_token_id is None
    sched.update_from_output(out, [[9]], [[1, 2]])
    assert s.output_token_ids == [9] and s.draft_token_ids == [1, 2] and not s.is_prefill
    assert sched.schedule().scheduled[0].input_token_ids == [9, 1, 2]


def test_a_decode_scheduled_ahead_verifies_no_drafts() -> None:
    """``schedule(pending=...)`` (async scheduling ahead of a step that proposes no drafts: plain
    decoding, or an adaptive step at k = 0): the decode's input is the pending token alone, one
    position ahead; the drafts it still holds are the ones the step in flight verifies, and are
    not verified again."""
    from mtpspec.engine.scheduler import TOKEN_PENDING
    k = 3
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=64, num_speculative_tokens=k)
    sched = Scheduler(cfg, BlockManager(64, 4, watermark=0.0), [EOS])
    seq = _seq("a", [5, 6, 7])
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, [[9]], [[11, 12, 13]])
    out = sched.schedule()  # the step in flight: verifies the three drafts
    assert out.scheduled[0].input_token_ids == [9, 11, 12, 13] and out.num_spec_tokens == 3
    ahead = sched.schedule(pending=[id(seq)])
    sch = ahead.scheduled[0]
    assert sch.input_token_ids == [TOKEN_PENDING] and sch.start_position == seq.num_tokens
    assert ahead.num_spec_tokens == 0
