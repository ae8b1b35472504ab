"""Continuous batching: which sequences run in the next step, and bookkeeping after it.

Each step spends a token budget (``max_num_batched_tokens``) in this order:

1. Every running sequence that is decoding gets a decode slot (``1 + k`` target tokens: its
   last token and its ``k`` drafts), growing its block table to the lookahead it needs; when
   blocks run out the most recently admitted running sequence is preempted (its blocks freed,
   to be recomputed from scratch later: "preemption by recompute"); partially prefilled
   sequences count as the most recent, so they go first.
2. Running sequences that are partway through their prompt (chunked prefill) get their next
   chunk: as many of their remaining prompt tokens as the budget left (and
   ``long_prefill_token_threshold``) allows.
3. Waiting sequences are admitted first-come first-served while the budget, the sequence limit
   and the free blocks allow (no admissions in a step that preempted); with chunked prefill the
   last one admitted may get only a first chunk. Without chunked prefill a prompt that does not
   fit the budget whole waits.

A prefill (whole or chunked) gets the blocks of its whole prompt at admission, so its later
chunks never wait for blocks (they can still be preempted by decodes growing). Only the step
holding a prompt's last chunk samples its next token and proposes drafts; an earlier chunk
fills the target's and the MTP layers' KV caches (vLLM V1's scheme: every step is one flattened
batch of decode rows and prefill-chunk rows).

With prefix caching an admission first looks the sequence up
(:meth:`~mtpspec.engine.block_manager.BlockManager.find_cache_hit`): the cached prefix's blocks
are shared, the prefill starts after it, and a block copy the hit needs is listed in the
step's ``block_copies`` (run on every rank before the forward). After each step the blocks
whose entries became final are added to the cache
(:meth:`~mtpspec.engine.block_manager.BlockManager.cache_full_blocks`).

Children of a request with ``n > 1`` / ``best_of`` (:mod:`mtpspec.engine.parallel_sampling`)
share the prompt's KV blocks, with prefix caching on or off: a child is admitted by forking a
sibling that is running past the prompt
(:meth:`~mtpspec.engine.block_manager.BlockManager.fork_hit`: positions ``< len(prompt) - 1``
shared, the partial block copied, one position computed; a longer prefix-cache hit wins).
While child 0 is prefilling the prompt (over several steps with chunked prefill) and no sibling
can be forked, its siblings are skipped: they keep their place at the head of the waiting queue
and the requests behind them are admitted (as vLLM V1 skips requests that wait for remote KV or
a grammar). Otherwise (child 0 aborted alone, finished by its first token, or preempted: then
it is ahead of them in the queue) a child is admitted as any request (prefix-cache lookup, else
the whole prompt). A child asking for prompt log-probabilities never forks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Deque, List, Optional, Sequence as Seq, Tuple

from mtpspec.engine.block_manager import BlockManager, CacheHit
from mtpspec.engine.config import SchedulerConfig
from mtpspec.engine.sequence import Sequence, SequenceStatus
from mtpspec.engine.stop_checker import append_tokens

#: Draft id of a sequence whose drafts are still being computed (async scheduling); never sent to a rank.
DRAFT_PENDING = -1
#: Input id of a decode whose newest token the step before is still sampling (plain decoding with
#: async scheduling: :meth:`Scheduler.schedule` ``pending``); each rank fills it on the device.
TOKEN_PENDING = -2


@dataclass
class ScheduledSeq:
    """One sequence in a step: its target query tokens and whether it is a prefill.

    Attributes:
        seq: the sequence.
        is_prefill: a prefill chunk (the whole prompt when it fits) or a decode.
        input_token_ids: the target's tokens this step: the chunk, or ``[last] + k drafts``.
        start_position: position of ``input_token_ids[0]`` (= the sequence's computed tokens).
        next_token_id: for a chunk that does not end the prompt (a *partial* prefill): the
            prompt token after it (the MTP first pass's input at the chunk's last row); such a
            chunk samples nothing. ``None`` otherwise.
        num_accepted_tokens: set by :meth:`Scheduler.update_from_output` for a decode: the
            accepted drafts that were emitted (accepted drafts dropped after a stop do not count).
    """

    seq: Sequence
    is_prefill: bool
    input_token_ids: List[int]
    start_position: int
    next_token_id: Optional[int] = None
    num_accepted_tokens: int = 0

    @property
    def is_partial_prefill(self) -> bool:
        """A prefill chunk that does not end the prompt (samples no token)."""
        return self.next_token_id is not None


@dataclass
class SchedulerOutput:
    """The step's sequences (decodes first, then prefill chunks, in batch order) and who got preempted.

    Attributes:
        scheduled, preempted: see above.
        block_copies: ``(src, dst)`` KV blocks to copy (every cache of every layer) before the
            step's forward (prefix-cache hits whose last MTP entry is recomputed).
        prefix_cache_queries / prefix_cache_hits: tokens of the sequences first admitted in
            this step that looked up the prefix cache / that it served (vLLM's counters;
            recomputes after a preemption are not counted).
        num_spec_tokens: drafts each decode verifies this step: the fewest any scheduled decode
            holds (all of them hold ``num_speculative_tokens`` at a fixed ``k``; under adaptive
            speculation length a decode's drafts are what the step that last ran it proposed,
            and longer ones are cut to this, which is lossless).
        num_proposed_tokens: drafts the step proposes per sequence (for the next step);
            ``num_speculative_tokens`` unless the engine's adaptive policy sets it.
        defers_mtp: the step writes no MTP KV entries (adaptive speculation at ``k = 0``,
            :mod:`mtpspec.spec_decode.deferred_mtp`): its sequences' ``mtp_len`` stays behind.
        needs_sync: see below.
    """

    scheduled: List[ScheduledSeq] = field(default_factory=list)
    preempted: List[Sequence] = field(default_factory=list)
    block_copies: List[Tuple[int, int]] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_spec_tokens: int = 0
    num_proposed_tokens: int = 0
    defers_mtp: bool = False
    #: a decode could not grow while scheduled ahead (no preemption then): the next step is
    #: scheduled after this one's tokens are applied, where preemption can free blocks
    needs_sync: bool = False
    #: deferred MTP entries the step writes before its first pass (set by the engine when it builds
    #: the step's input: ``SeqInput.mtp_lag`` summed; a metric)
    num_catch_up_rows: int = 0
    #: the engine proposed ``num_proposed_tokens`` without asking its adaptive policy (a held
    #: choice: :attr:`~mtpspec.spec_decode.adaptive.AdaptiveSpecPolicy.hold_k0_steps`, ``hold_draft_steps``);
    #: the step is not timed for the policy either (its acceptance is counted)
    policy_held: bool = False
    # (len(scheduled) when counted, prefill rows, decode rows): the counts below read on every step
    # by the engine (3-5 times; O(batch) each), made in one pass and kept while no row is added
    _counts: Tuple[int, int, int] = field(default=(-1, 0, 0), init=False, repr=False, compare=False)

    def rows_changed(self) -> None:
        """Rows were cut or rewritten in place (:meth:`Scheduler._cut_drafts`, the engine putting a
        step's drafts into them): the row counts are made again when next read."""
        self._counts = (-1, 0, 0)

    def _rows(self) -> Tuple[int, int]:
        n, prefill, decode = self._counts
        if n != len(self.scheduled):  # a row added, or rows_changed()
            prefill = decode = 0
            for s in self.scheduled:
                if s.is_prefill:
                    prefill += len(s.input_token_ids)
                else:
                    decode += len(s.input_token_ids)
            self._counts = (len(self.scheduled), prefill, decode)
        return prefill, decode

    @property
    def num_batched_tokens(self) -> int:
        return sum(self._rows())

    @property
    def num_decode_tokens(self) -> int:
        """Target rows of the step's decodes (``1 + k`` each)."""
        return self._rows()[1]

    @property
    def num_prefill_tokens(self) -> int:
        """Target rows of the step's prefill chunks."""
        return self._rows()[0]

    @property
    def num_partial_prefills(self) -> int:
        """Prefill chunks that do not end their prompt."""
        return sum(1 for s in self.scheduled if s.is_partial_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager (see the module docstring)."""

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
        seq.num_computed_tokens = seq.mtp_len = 0
        seq.is_prefill = True
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def _chunk_len(self, seq: Sequence, budget: int, computed: Optional[int] = None) -> int:
        """Tokens of ``seq``'s remaining prefill that fit this step (0: none), after ``computed``
        positions (default ``seq.num_computed_tokens``).

        Chunked: ``min(remaining, budget, long_prefill_token_threshold or inf)``; not chunked:
        the whole remainder if it fits the budget, else 0.
        """
        remaining = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(n, 0)

    def _prefill_chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        """The :class:`ScheduledSeq` of ``seq``'s next ``n`` prefill tokens."""
        start = seq.num_computed_tokens
        tokens = seq.all_token_ids
        end = start + n
        if not 0 < n <= len(tokens) - start:
            raise RuntimeError(f"{seq!r}: a chunk of {n} tokens at {start} is outside its {len(tokens)} tokens")
        return ScheduledSeq(seq, True, tokens[start:end], start, tokens[end] if end < len(tokens) else None)

    def _fork_hit(self, seq: Sequence) -> Optional[CacheHit]:
        """A sibling's prompt blocks for ``seq`` (module docstring), or ``None``."""
        if seq.parent is None or seq.params.prompt_logprobs is not None:
            return None
        for c in seq.parent.children:
            if c is not seq and c.status == SequenceStatus.RUNNING and not c.is_prefill:
                return self.block_manager.fork_hit(c, len(seq.prompt_token_ids))
        return None

    def _waits_for_prompt(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits for child 0 of its request, which is prefilling the prompt."""
        first = seq.parent.children[0] if seq.parent is not None else seq
        return (first is not seq and seq.params.prompt_logprobs is None
                and first.status == SequenceStatus.RUNNING and first.is_prefill)

    def schedule(self, pending: Optional[Collection[int]] = None) -> SchedulerOutput:
        """Pick the next step's batch (see the module docstring).

        ``pending`` (async scheduling, a step in flight that verifies and proposes no drafts: plain
        decoding, or an adaptive step at ``k = 0``): ``id()`` of the decodes whose newest
        token the step in flight is sampling. Each such decode is scheduled one position ahead, its
        input :data:`TOKEN_PENDING` (filled on the ranks from that step's tokens), unless that token
        may be its last by length (``max_tokens``, ``max_model_len``: it then sits this step out);
        nobody is preempted (a decode that cannot grow sits out; its state must stay as the step
        in flight left it)."""
        cfg, bm = self.config, self.block_manager
        pending = set(pending) if pending is not None else None
        bm.release_pinned()  # the previous step's block copies ran
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        # Decoding sequences first, then partially prefilled ones (each in admission order);
        # preemption victims are taken from the end of this queue.
        queue = [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]
        kept: List[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if seq.is_prefill:  # partway through its prompt; its blocks cover the whole prompt
                n = self._chunk_len(seq, budget) if len(out.scheduled) < cfg.max_num_seqs else 0
                kept.append(seq)  # stays running; skips this step when n == 0
                if n:
                    out.scheduled.append(self._prefill_chunk(seq, n))
                    budget -= n
                continue
            ahead = pending is not None and id(seq) in pending  # its newest token is still being sampled
            # ahead of a step in flight, which proposes no drafts (the engine steps ahead only then):
            # the drafts it holds are the ones that step verifies
            drafts = [] if ahead else seq.draft_token_ids
            if len(drafts) > cfg.num_speculative_tokens:
                raise RuntimeError(f"{seq!r} has {len(drafts)} drafts, expected at most {cfg.num_speculative_tokens}")
            # the target rows it takes: 1 + the drafts it holds (fewer than k after an adaptive step
            # that proposed fewer: the budget they leave goes to prompt chunks)
            q_len = 1 + len(drafts)
            if q_len > budget or len(out.scheduled) >= cfg.max_num_seqs:
                kept.append(seq)  # stays running, skips this step
                continue
            n_tok = seq.num_tokens + ahead
            slots = cfg.decode_slots(n_tok)
            if pending is not None:  # scheduled ahead of a step in flight: never preempting
                p = seq.params
                if (p.max_tokens is not None and len(seq.output_token_ids) + ahead >= p.max_tokens) \
                        or n_tok >= cfg.max_model_len:
                    kept.append(seq)  # the pending token may end it by length: nothing to run
                    continue
                if not bm.can_grow(seq, slots):
                    out.needs_sync = True
                    kept.append(seq)
                    continue
            else:
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
            if seq.num_computed_tokens != seq.num_tokens - 1:
                raise RuntimeError(f"{seq!r}: a decode needs num_computed_tokens == num_tokens - 1")
            first = TOKEN_PENDING if ahead else seq.last_token_id
            out.scheduled.append(ScheduledSeq(seq, False, [first] + drafts, n_tok - 1))
            budget -= q_len
        self.running = kept
        # Preempted sequences go back to the front of the queue, earliest admitted first.
        for seq in sorted(out.preempted, key=lambda s: s.metrics.arrival_time, reverse=True):
            self.waiting.appendleft(seq)
        held: List[Sequence] = []  # siblings waiting for child 0's prompt (module docstring)
        while self.waiting and not out.preempted and len(out.scheduled) < cfg.max_num_seqs and pending is None:
            seq = self.waiting[0]
            fork = self._fork_hit(seq)
            if fork is None and self._waits_for_prompt(seq):
                held.append(self.waiting.popleft())
                continue
            hit = bm.find_cache_hit(seq)  # longer than a fork for a preempted child whose own blocks are cached
            forked = fork is not None and fork.num_tokens >= hit.num_tokens
            hit = fork if forked else hit
            n = self._chunk_len(seq, budget, hit.num_tokens)
            if n == 0:
                break
            slots = cfg.prefill_slots(seq.num_tokens)
            if not bm.can_allocate(seq, slots, hit):
                break
            copy = bm.allocate(seq, slots, hit)  # sets num_computed_tokens to the cached prefix
            if copy is not None:
                out.block_copies.append(copy)
            if seq.metrics.num_cached_tokens is None:
                seq.metrics.num_cached_tokens = 0 if forked else hit.num_tokens  # a fork is no cache hit
            if bm.lookup_enabled(seq) and seq.metrics.num_preemptions == 0 and not forked:
                out.prefix_cache_queries += seq.num_tokens
                out.prefix_cache_hits += hit.num_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(self._prefill_chunk(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        self._cut_drafts(out)
        return out

    def _cut_drafts(self, out: SchedulerOutput) -> None:
        """Every decode verifies the same number of drafts (one verify layout per step):
        :attr:`SchedulerOutput.num_spec_tokens`, the fewest any decode holds; longer draft lists
        are cut (lossless: fewer drafts verified). Sets ``num_proposed_tokens`` to ``k``."""
        k = self.config.num_speculative_tokens
        decodes = [sch for sch in out.scheduled if not sch.is_prefill]
        v = min((len(sch.input_token_ids) - 1 for sch in decodes), default=k)
        for sch in decodes:
            del sch.input_token_ids[1 + v:]
        out.rows_changed()
        out.num_spec_tokens, out.num_proposed_tokens = v, k

    def update_from_output(self, out: SchedulerOutput, new_tokens: Seq[Seq[int]],
                           drafts: Optional[Seq[Seq[int]]], now: Optional[float] = None,
                           drafts_pending: bool = False) -> List[Sequence]:
        """Apply a step's results.

        Args:
            out: the step's :class:`SchedulerOutput`.
            new_tokens: per scheduled sequence, the tokens the step emitted: 1 for a prefill
                that ends its prompt, none for a partial prefill chunk, ``1 + num_accepted``
                for a decode (accepted drafts then the recovered/bonus one).
            drafts: per scheduled sequence, the ``out.num_proposed_tokens`` drafts for the next
                step (``None`` when ``k == 0``; ignored for a partial prefill chunk).

        Speculative counters (the request's :class:`~mtpspec.outputs.RequestMetrics` and each
        decode's ``ScheduledSeq.num_accepted_tokens``): a decode is one draft of ``k`` draft
        tokens; its accepted tokens are the accepted drafts that were *emitted*, i.e.
        ``min(num_accepted, kept)`` where ``kept`` tokens survived the stop checks. Drafts that
        the verifier accepted but that fall after a stop (EOS, stop id / string, ``max_tokens``,
        ``max_model_len``) count as drafted, not accepted.
            now: host timestamp of the step's end (default: now).
            drafts_pending: the drafts are not known yet (async scheduling): each continuing
                sequence gets ``out.num_proposed_tokens`` :data:`DRAFT_PENDING` ids, which the engine replaces
                (:meth:`~mtpspec.engine.llm_engine.LLMEngine.step`) before any step reads them.

        Returns:
            The sequences that finished in this step (their blocks are freed).
        """
        now = time.perf_counter() if now is None else now
        k = self.config.num_speculative_tokens
        v, p = out.num_spec_tokens, out.num_proposed_tokens  # drafts verified / proposed per sequence
        finished = []
        for i, sch in enumerate(out.scheduled):
            seq, toks = sch.seq, list(new_tokens[i])
            if seq.is_finished:  # finished (or aborted) while this step was in flight: its row is dropped
                continue
            m = seq.metrics
            if sch.is_prefill:
                end = sch.start_position + len(sch.input_token_ids)
                if sch.is_partial_prefill:  # KV written, nothing sampled: no output, no timing
                    if toks:
                        raise RuntimeError(f"partial prefill chunk of {seq.request_id!r} returned {len(toks)} "
                                           "tokens, expected none")
                    seq.num_computed_tokens = end
                    if not out.defers_mtp:
                        seq.mtp_len = end
                    self.block_manager.cache_full_blocks(seq)
                    continue
                if len(toks) != 1:
                    raise RuntimeError(f"prefill of {seq.request_id!r} returned {len(toks)} tokens, expected 1")
                seq.num_computed_tokens = end
                seq.is_prefill = False
            else:
                a = len(toks) - 1
                if not 0 <= a <= v:
                    raise RuntimeError(f"decode of {seq.request_id!r} returned {len(toks)} tokens, expected 1..{v + 1}")
                seq.num_computed_tokens += 1 + a
            if not out.defers_mtp:  # the step's MTP pass wrote every entry below num_computed_tokens
                seq.mtp_len = seq.num_computed_tokens
            kept = append_tokens(seq, toks, self.eos_token_ids, self.config.max_model_len)
            self.block_manager.cache_full_blocks(seq)  # before a finished sequence's blocks are freed
            if not sch.is_prefill and v:
                # Only emitted drafts count as accepted: a stop inside the accepted block drops
                # the drafts after it (and the bonus / recovered token).
                a = sch.num_accepted_tokens = min(len(toks) - 1, kept)
                if not m.num_accepted_tokens_per_pos:
                    m.num_accepted_tokens_per_pos = [0] * k
                    m.accepted_length_histogram = [0] * (k + 1)
                m.num_drafts += 1
                m.num_draft_tokens += v
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
                if p and drafts_pending:
                    seq.draft_token_ids = [DRAFT_PENDING] * p
                else:
                    seq.draft_token_ids = list(drafts[i])[:p] if (p and drafts is not None) else []
        return finished
