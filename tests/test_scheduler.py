"""Scheduler: budgets, preemption by recompute, stop handling, block accounting.

A simulated greedy model drives the scheduler: the "target" continuation of a token list is a
hash of it, the "drafts" agree with the target on a pseudo-random number of leading tokens. A
correct scheduler emits exactly the target's greedy chain for every request whatever the
batch composition, the block budget (preemptions) or k.
"""

from __future__ import annotations

import random
from typing import List

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
               block_size: int = 4, max_num_seqs: int = 4, max_model_len: int = 64, seed: int = 0):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_speculative_tokens=k)
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
        new_tokens, drafts = [], []
        for sch in out.scheduled:
            s = sch.seq
            # Block table covers every slot the step writes.
            need = cfg.prefill_slots(s.num_tokens) if sch.is_prefill else cfg.decode_slots(s.num_tokens)
            assert len(s.block_table) * block_size >= need
            ctx = s.all_token_ids
            if sch.is_prefill:
                assert sch.input_token_ids == ctx and sch.start_position == 0
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
            drafts.append(draft(ctx + emitted, k, rng))
        sched.update_from_output(out, new_tokens, drafts if k else None)
        steps += 1
        assert steps < 10000
    assert bm.num_free_blocks == num_blocks
    return seqs, sched


@pytest.mark.parametrize("k", [0, 1, 3])
def test_tokens_independent_of_batching_and_preemption(k: int) -> None:
    rng = random.Random(k)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30)) for _ in prompts]
    roomy, _ = run_engine(prompts, params, k, num_blocks=200)
    tight, sched = run_engine(prompts, params, k, num_blocks=14 + k)  # forces preemptions
    assert sched.num_preemptions > 0
    for p, sp, a, b in zip(prompts, params, roomy, tight):
        ref = greedy_chain(p, sp.max_tokens)
        assert a.output_token_ids == ref and b.output_token_ids == ref
        assert a.finish_reason == b.finish_reason == "length"
    assert sum(s.metrics.num_preemptions for s in tight) == sched.num_preemptions


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
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    assert SchedulerConfig(max_num_seqs=8, max_model_len=16, num_speculative_tokens=3).max_num_batched_tokens == 32
