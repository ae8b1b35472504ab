"""Continuous batching: which sequences run in the next step, and bookkeeping after it.

Each step first gives every running sequence a decode slot (``1 + k`` target tokens: its last
token and its ``k`` drafts), growing its block table to the lookahead it needs; when blocks
run out the most recently admitted running sequence is preempted (its blocks freed, to be
recomputed from scratch later: "preemption by recompute"). Then waiting sequences are admitted
first-come first-served as whole prefills while the token budget, the sequence budget and the
free blocks allow (no admissions in a step that preempted). Prefill and decode sequences share
one flattened batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Deque, List, Optional, Sequence as Seq

from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import SchedulerConfig
from mtpspec.engine.sequence import Sequence, SequenceStatus
from mtpspec.engine.stop_checker import append_tokens


@dataclass
class ScheduledSeq:
    """One sequence in a step: its target query tokens and whether it is a prefill.

    ``num_accepted_tokens`` is set by :meth:`Scheduler.update_from_output` for a decode: the
    accepted drafts that were emitted (accepted drafts dropped after a stop do not count).
    """

    seq: Sequence
    is_prefill: bool
    input_token_ids: List[int]
    start_position: int
    num_accepted_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The step's sequences (prefills and decodes, in batch order) and who got preempted."""

    scheduled: List[ScheduledSeq] = field(default_factory=list)
    preempted: List[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.input_token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Collection[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Remove a request wherever it is; returns it (finished with reason ``"abort"``) or ``None``."""
        for q in (self.waiting, self.running):
            for s in list(q):
                if s.request_id == request_id:
                    q.remove(s)
                    self.block_manager.free(s)
                    s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
                    return s
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch (see the module docstring)."""
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        queue = list(self.running)
        kept: List[Sequence] = []
        while queue:
            seq = queue.pop(0)
            q_len = cfg.decode_query_len
            if q_len > budget or len(out.scheduled) >= cfg.max_num_seqs:
                kept.append(seq)  # stays running, skips this step
                continue
            slots = cfg.decode_slots(seq.num_tokens)
            while not bm.can_grow(seq, slots) and queue:
                victim = queue.pop()
                self._preempt(victim)
                out.preempted.append(victim)
            if not bm.can_grow(seq, slots):
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            bm.grow(seq, slots)
            kept.append(seq)
            drafts = seq.draft_token_ids
            if seq.num_computed_tokens != seq.num_tokens - 1:
                raise RuntimeError(f"{seq!r}: a decode needs num_computed_tokens == num_tokens - 1")
            if len(drafts) != cfg.num_speculative_tokens:
                raise RuntimeError(f"{seq!r} has {len(drafts)} drafts, expected {cfg.num_speculative_tokens}")
            out.scheduled.append(ScheduledSeq(seq, False, [seq.last_token_id] + drafts, seq.num_tokens - 1))
            budget -= q_len
        self.running = kept
        # Preempted sequences go back to the front of the queue, earliest admitted first.
        for seq in sorted(out.preempted, key=lambda s: s.metrics.arrival_time, reverse=True):
            self.waiting.appendleft(seq)
        while self.waiting and not out.preempted:
            seq = self.waiting[0]
            n = seq.num_tokens
            if n > budget or len(out.scheduled) >= cfg.max_num_seqs:
                break
            slots = cfg.prefill_slots(n)
            if not bm.can_allocate(seq, slots):
                break
            bm.grow(seq, slots)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, True, seq.all_token_ids, 0))
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput, new_tokens: Seq[Seq[int]],
                           drafts: Optional[Seq[Seq[int]]], now: Optional[float] = None) -> List[Sequence]:
        """Apply a step's results.

        Args:
            out: the step's :class:`SchedulerOutput`.
            new_tokens: per scheduled sequence, the tokens the step emitted: 1 for a prefill,
                ``1 + num_accepted`` for a decode (accepted drafts then the recovered/bonus one).
            drafts: per scheduled sequence, the ``k`` drafts for the next step (``None`` when
                ``k == 0``).

        Speculative counters (the request's :class:`~mtpspec.outputs.RequestMetrics` and each
        decode's ``ScheduledSeq.num_accepted_tokens``): a decode is one draft of ``k`` draft
        tokens; its accepted tokens are the accepted drafts that were *emitted*, i.e.
        ``min(num_accepted, kept)`` where ``kept`` tokens survived the stop checks. Drafts that
        the verifier accepted but that fall after a stop (EOS, stop id / string, ``max_tokens``,
        ``max_model_len``) count as drafted, not accepted.
            now: host timestamp of the step's end (default: now).

        Returns:
            The sequences that finished in this step (their blocks are freed).
        """
        now = time.perf_counter() if now is None else now
        k = self.config.num_speculative_tokens
        finished = []
        for i, sch in enumerate(out.scheduled):
            seq, toks = sch.seq, list(new_tokens[i])
            m = seq.metrics
            if sch.is_prefill:
                if len(toks) != 1:
                    raise RuntimeError(f"prefill of {seq.request_id!r} returned {len(toks)} tokens, expected 1")
                seq.num_computed_tokens = len(sch.input_token_ids)
            else:
                a = len(toks) - 1
                if not 0 <= a <= k:
                    raise RuntimeError(f"decode of {seq.request_id!r} returned {len(toks)} tokens, expected 1..{k + 1}")
                seq.num_computed_tokens += 1 + a
            kept = append_tokens(seq, toks, self.eos_token_ids, self.config.max_model_len)
            if not sch.is_prefill and k:
                # Only emitted drafts count as accepted: a stop inside the accepted block drops
                # the drafts after it (and the bonus / recovered token).
                a = sch.num_accepted_tokens = min(len(toks) - 1, kept)
                if not m.num_accepted_tokens_per_pos:
                    m.num_accepted_tokens_per_pos = [0] * k
                    m.accepted_length_histogram = [0] * (k + 1)
                m.num_drafts += 1
                m.num_draft_tokens += k
                m.num_accepted_tokens += a
                for j in range(a):
                    m.num_accepted_tokens_per_pos[j] += 1
                m.accepted_length_histogram[a] += 1
            m.num_output_tokens = len(seq.output_token_ids)
            if m.first_token_time is None:
                m.first_token_time = now
            elif kept:
                m.itl.append(now - m.last_token_time)
            m.last_token_time = now
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                m.finished_time = now
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
            else:
                seq.draft_token_ids = list(drafts[i]) if (k and drafts is not None) else []
        return finished
