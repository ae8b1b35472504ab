"""Adaptive speculation length: each step proposes the ``k`` that maximises expected tokens per second.

A step that proposes ``k`` drafts per sequence costs, in the steady state where the next step
verifies them, ``T(B, k) = verify(B, k) + draft(B, k)``: the target over ``B x (1 + k)`` rows
and the draft passes (the MTP first pass over the same rows and ``k - 1`` single-row steps; for
``k = 0`` only the MTP layers' KV-cache writes, or with deferred MTP entries the hidden-state write,
inside the graphed verify: 0). It emits ``E(k) = 1 + sum_{i=1..k} prod_{j<=i}
alpha_j`` tokens per sequence on average, ``alpha_j`` being the probability that draft ``j`` is
accepted given that drafts ``1 .. j - 1`` were (Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, sec. 3.1, eq. 1 has the i.i.d. case; here the
rate is per position, as vLLM's ``num_accepted_tokens_per_pos`` measures it). The policy picks
``argmax_k E(k) / T(B, k)`` (the smallest ``k`` on ties; ``k = 0``'s rate counted ``1 +``
:data:`SWITCH_MARGIN` times).

* :class:`StepCostTable`: ``T`` per padded batch size and ``k``, measured at start-up
  (:func:`measure_step_costs`: the runner's graph units replayed, or the same calls eagerly
  without CUDA graphs) or loaded from JSON.
* :class:`AdaptiveSpecPolicy`: running per-position rates (decayed counts with a prior, so a
  position unused for a while drifts back to the prior and is tried again), the host time per
  step that the device table misses, fitted online from the engine's own pure-decode steps (wall
  time minus the table's device cost) as ``a + c B + b r`` for a step of ``B`` sequences that
  emits ``B + r`` tokens (a decayed least-squares plane): ``a + c B`` is paid once per step and
  amortises over a draft round, so it favours longer drafts; ``b`` is paid per accepted draft
  emitted (output processing of every token; H200, 2026-12-04: 26-34 us a token in one process at
  64 sequences), a per-token cost that no draft round amortises. Taken whole as a fixed cost,
  as before, that excess kept the policy speculating where plain decoding was faster. Also a
  cost per prefill token (the median of recent steps that also carried ``P`` prompt tokens: what they took beyond
  that, divided by ``P``), one for the steps that propose ``k = 0`` and one for those that draft:
  the target's prompt chunk is paid whatever ``k`` is, but a drafting step also runs the MTP
  layer's first pass over the prompt rows, its draft passes (through the pure-decode graph units
  where one fits the batch, the first pass eagerly) and,
  with deferred MTP entries (:mod:`mtpspec.spec_decode.deferred_mtp`), catches up the decodes'
  lags, which a ``k = 0`` step leaves for later or for never (H200, 2026-12-05, Air 3 layers at
  64 sequences: prompt steps at ``k = 3`` took 2.3x those at ``k = 0``). The choice for a
  pure-decode step: ``argmax_k E(k) / (T(B, k) + H(B, k))`` (with the margin); for a step carrying ``P`` prompt
  tokens, ``argmax_k n E(k) c* - T(B, k) - H(B, k) - P p(k)`` (``n``: its sequences that keep
  their drafts), its tokens valued at ``c*``, the best pure-decode step's ms per token (a drafting
  prompt step is worth its extra time only if its extra tokens come cheaper than decoding them
  later). ``H(B, k)`` is what the steps that proposed ``k`` at
  ``B``'s table batch size measured beyond the table (the median of its last steps, moved along the plane's ``c``
  from the median step's batch size to ``B``), else the plane's
  ``a + c B + b B (E(k) - 1)``: the host time of a ``k`` need not lie on one plane with the
  others' (at ``k = 0`` with async scheduling the engine schedules each step ahead of the one in
  flight, as plain decoding does, so its host time overlaps the device's; H200, 2026-12-04, Air
  3 layers at 64 sequences: 1.7 ms a step beyond the device at ``k = 0``, 3.4-6.2 ms at ``k = 1 ..
  3``). ``k`` values not measured at a batch size, and now and then those measured long ago whose
  rate is near the best, are tried for a few steps (exploration bursts, :data:`EXPLORE_EVERY`),
  where the deferred entries the burst's first drafting step writes cost little
  (:data:`MEASURE_MARGIN`).
  With deferred MTP entries, a drafting step first writes the entries its sequences' ``k = 0``
  steps left (:mod:`mtpspec.spec_decode.deferred_mtp`): their cost per entry is timed at start-up
  with the table, and a step's ``t(k)``, ``k >= 1``, carries each sequence's share of its
  entries' cost, ``rows q min(1, max(E(k) / R, 1 / H))`` (``R``: the tokens it is expected to emit
  still; ``H``: :data:`CATCH_UP_HORIZON` steps), so drafting starts only where the tokens left, and
  soon enough, repay the catch-up (H200, 2026-12-05, Air 3 layers at 256 sequences: 80% of all
  entries were written late, the adaptive arm at 0.82x plain).

Everything here is host arithmetic on counts the engine already has, yet it is paid on the host
(a choice and the step's timing ~70 us on this repo's CPU, against a ~1.9 ms step at 64 sequences
whose host work the device does not hide): after a pure-decode choice of ``k = 0`` outside an
exploration burst (or a prompt step's, where the pure-decode choice would be ``k = 0`` too:
:meth:`AdaptiveSpecPolicy.k0_is_best`), the engine proposes ``k = 0`` again for
:attr:`AdaptiveSpecPolicy.hold_k0_steps` ``- 1`` more steps while the batch stays in the choice's
bucket (:meth:`AdaptiveSpecPolicy.bucket`), prompt-carrying steps among them, without asking the
policy or timing them for it (a ``k = 0`` step proposes nothing and verifies nothing: it teaches
the rates nothing; a held pure-decode step is only counted as a ``k = 0`` step for the steady-run
test, a held prompt step as a transition, :meth:`AdaptiveSpecPolicy.observe_held_step`). With a
hold of 4 steps of one batch size, broken by every prompt step, 45% of the steps of an s64-like
run asked the policy (a CPU count; ~1.5-3% of a 64-sequence step on an H100's host); now 8%. A
prompt step inside a hold skips what an asked one weighs (a re-try of drafting: at 64 sequences
its catch-up, tens of thousands of deferred entries, blocks it anyway). The measured ``k = 0``
host time then comes from the asked steps alone: with async scheduling a step's wall holds the
next step's choice, so it is that of a step followed by a held one (no ``choose``). Exploration
bursts and re-checks count asked choices, so a longer hold also spaces them further apart in steps.
A pure-decode choice of a drafting ``k`` (outside a burst) whose host time is measured at the
batch's bucket (:meth:`AdaptiveSpecPolicy.holds_draft`; one the plane alone prices is asked again
until measured) is held the same way for
:attr:`AdaptiveSpecPolicy.hold_draft_steps` pure-decode steps (a prompt step, or prompts waiting
under a prompt reserve, ask again): the held steps' acceptance is still counted, only the choice
and the step's timing are skipped (H100, 2026-12-07: the demo model's k = 3 decode steps at 8
sequences took 2.056 ms under the policy asked every step, 1.971 in the fixed-k3 engine).

Only steps inside a steady run of their ``k`` feed the host plane, as they alone feed the measured
host times: a transition's excess belongs to its switch (the same run: one ``k = 0`` step verifying
a drafting prompt step's drafts, 0.67 ms over its table with 5 drafts emitted, read as 0.04 ms a
token more, held that run at ``k = 0`` against the k3 arm's 8% lead).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

#: The host plane's slopes are refitted only along a variable whose spread (standard deviation)
#: exceeds this share of its mean (or of the batch size's mean, for the accepted drafts), and only
#: after :data:`MIN_FIT_SAMPLES` pure-decode steps; a slope that cannot be measured drifts to 0.
MIN_SPREAD = 0.05
MIN_FIT_SAMPLES = 20
#: Exploration: a ``k`` whose host time at this batch size is not measured yet (the plane's
#: prediction alone may be far off; :data:`MIN_MEASURED`) whose rate and catch-up allow it
#: (:data:`MEASURE_MARGIN`), or else at most once every
#: :data:`EXPLORE_EVERY` pure-decode choices (steps that asked the policy: a held ``k = 0`` step,
#: :data:`HOLD_K0_STEPS`, is none) the ``k`` proposed longest ago among those not proposed at this
#: batch size for that many choices whose burst rates within :data:`EXPLORE_MARGIN` of the
#: best (any rate after :data:`STALE_EVERY` choices), is proposed for
#: :data:`EXPLORE_STEPS` steps in a row (counted only where the pipeline holds that ``k`` alone:
#: the two steps before it proposed it too, and so does the step chosen after it, whose scheduling
#: and launch a step scheduled ahead is timed with; H200, 2026-12-04: in 4-step bursts the first
#: ``k = 0`` step ahead took 1.35-1.95x the next one, BENCHMARKS.md), so its own host time is
#: measured (what a step of that ``k`` takes beyond the device table, where the shared host plane
#: can be wrong for it: e.g. at ``k = 0`` the engine schedules the next step ahead of the one in
#: flight, as plain decoding does, so its host time overlaps the device's; a plane fitted on
#: speculative steps alone cannot know that).
EXPLORE_EVERY = 500
EXPLORE_STEPS = 6
EXPLORE_MARGIN = 0.15
#: A burst is priced as what it runs: its first drafting step writes every deferred MTP entry of
#: the batch (``C`` ms, :meth:`AdaptiveSpecPolicy.catch_up_ms_per_row` a row). A ``k`` not measured
#: at this batch size yet is tried if its predicted rate is within :data:`MEASURE_MARGIN` of the best
#: (wide: the plane may be off) and, for ``k >= 1``, ``C / EXPLORE_STEPS`` is at most
#: :data:`MEASURE_CATCH_UP` of the best ``k``'s step time; one proposed long ago if its burst rate
#: ``E(k) / (t(k) + C / EXPLORE_STEPS)`` is within :data:`EXPLORE_MARGIN` of the best. H100,
#: 2026-12-06, s64 (Air 3 layers, forced acceptance 0.8): 12-15 burst and catch-up steps a run
#: (k = 1-3 at 64 sequences and again at each smaller batch size while the run drained, each burst
#: first writing 23-33 k deferred entries, 10-14 ms, 1.5-2.3 ms a burst step against a 1.6 ms k = 0
#: step) were most of the 4.4% the adaptive arm lost to plain decoding. The price: where the batch's
#: catch-up is large, an unmeasured ``k`` waits for the :data:`STALE_EVERY` re-try (a review's
#: simulation, 64 sequences, k = 3 truly 20% better than k = 0 but predicted 30% worse, ~15 ms of
#: catch-up: first tried after 8,000 steps with the hold of 4, ~32,000 with :data:`HOLD_K0_STEPS` of
#: 16), for the catch-up to shrink, or for its predicted rate to win outright. A batch size whose
#: bursts were all declined is priced again only after :data:`EXPLORE_RECHECK` pure-decode choices
#: (pricing builds the batch's lag list, an ``O(batch)`` pass).
MEASURE_MARGIN = 0.5
MEASURE_CATCH_UP = 0.25
EXPLORE_RECHECK = 32
#: No burst (of any kind) tries a ``k`` below the best that could not beat the best even with no host
#: time at all: ``E(k) / (DEVICE_FLOOR_SHARE * T(batch, k))`` (``T``: the table's device ms; the share
#: leaves room for steps faster than their start-up timing) below the best's rate. ``E(k)`` of a
#: ``k`` below the best rests on the positions the best's own verifications measure, and ``T`` on no
#: host model, so no error of the host plane can hide a ``k`` that wins. H100, 2026-12-07, the demo
#: model at 8 sequences: k = 1 (E 1.86, table 1.32 ms: at most 1.56 tokens a ms) was burst-tried at a
#: k = 3 best of 1.66, 6 of a round's 172 steps at 60% of k = 3's rate, ~1.4% of the round.
DEVICE_FLOOR_SHARE = 0.9
#: A (batch size, k) counts as measured after this many counted steps (two bursts of 3), or after
#: :data:`MAX_MEASURING_BURSTS` bursts whatever they counted; measured ones not proposed for
#: :data:`STALE_EVERY` steps are tried again whatever their predicted rate.
MIN_MEASURED = 6
MAX_MEASURING_BURSTS = 3
STALE_EVERY = 2000
#: A measured host time is the median of the (batch size, k)'s last :data:`MEASURED_WINDOW` counted
#: steps. (A running mean, weight 0.1, let a few slow steps move it by a millisecond: H100,
#: 2026-12-06, s64, k = 0's measure went 0.24 -> 1.10 ms in one round while its steps' mean wall
#: rose 0.1 ms, and the policy left k = 0 for k = 2, 18% slower, for the rest of the run.)
MEASURED_WINDOW = 16
#: A measured ``k`` that stops being the best at a batch size (displaced by another ``k`` on its own
#: steps' measures: it was the ``k`` proposed last there) is measured again: ``RECHECK_AFTER``
#: pure-decode choices later its window is emptied, so exploration bursts (:data:`MIN_MEASURED`) take
#: it anew; each later re-check of it waits twice as long per re-check done (at most
#: :data:`EXPLORE_EVERY`; one cancelled because its ``k`` became the best again does not count). What
#: slowed its steps is not asked: an acceptance drop is re-checked too (a burst, ~6 steps). A window
#: filled while the host ran slow otherwise kept its ``k`` out until its next :data:`EXPLORE_EVERY`
#: burst: H100, 2026-12-06, s64 (Air 3 layers, forced acceptance 0.8, a host whose probes read 23 ms
#: in that round's first runs, 11-12 after), k = 0's measure read 1.01 ms where it read 0.23-0.27 on
#: a steady host, the policy ran k = 3 in all three rounds (0.81x plain decoding) while k = 0 was
#: tried 4-19 times a round.
RECHECK_AFTER = 64
#: The same for the prompt steps' two kinds (``k = 0``, drafting): the kind a switch of the best kind
#: displaced has its samples dropped this many prompt steps later (twice as many each later time, at
#: most :data:`PROMPT_EXPLORE_EVERY`), so it is sampled anew (:data:`MIN_PROMPT_SAMPLES`). Same run,
#: s256: k = 0 prompt steps' cost read 0.017 ms a prompt token against 0.006 in the other rounds, and
#: 386 of its 398 prompt steps drafted (0.96x plain decoding).
PROMPT_RECHECK_AFTER = 8
#: Steps the engine proposes ``k = 0`` per pure-decode choice of it (the asked step included) while
#: the batch stays in its bucket: :attr:`AdaptiveSpecPolicy.hold_k0_steps`'s default (see the module
#: docstring; 4 before session 36, each prompt step and batch-size change asking again).
HOLD_K0_STEPS = 16
#: Pure-decode steps the engine proposes a drafting ``k`` per choice of it (the asked step included)
#: while the batch stays in its bucket: :attr:`AdaptiveSpecPolicy.hold_draft_steps`'s default. Before
#: session 39 every drafting step asked: ~85 us a step on an H100 host (the demo model, 8 sequences:
#: 2.056 ms a k = 3 decode step against the fixed-k3 engine's 1.971, 2026-12-07).
HOLD_DRAFT_STEPS = 16
#: Records :attr:`AdaptiveSpecPolicy.trace` keeps at most (its oldest dropped first)
TRACE_MAX = 50_000
#: Prompt-carrying steps: each kind's (``k = 0``, drafting) cost per prompt token is the median of
#: its last :data:`PROMPT_SAMPLES` samples (a first-use outlier, e.g. a kernel compiled in the step,
#: cannot fix it); a kind with fewer than :data:`MIN_PROMPT_SAMPLES` (and no more than the other
#: kind has), or not proposed at the last :data:`PROMPT_EXPLORE_EVERY` prompt steps, is proposed at
#: the next one.
PROMPT_SAMPLES = 8
MIN_PROMPT_SAMPLES = 3
PROMPT_EXPLORE_EVERY = 32
#: A re-try of drafting at a prompt step that its catch-up blocked (the batch's deferred entries cost
#: more than a ``k = 0`` step) is looked at again only after this many prompt steps: pricing it
#: builds the batch's catch-up list, an ``O(batch)`` pass (~0.1 ms at 256 sequences on a CPU).
PROMPT_RECHECK = 8
#: Deferred MTP entries (:mod:`mtpspec.spec_decode.deferred_mtp`): :func:`measure_step_costs` times
#: the catch-up pass over this many rows (fewer where the cache holds fewer) for its cost per entry.
CATCH_UP_CALIBRATION_ROWS = 1024
#: What one deferred entry costs a drafting step is then learnt from the catch-ups themselves, timed
#: on the device (:meth:`AdaptiveSpecPolicy.observe_catch_up`; a step's wall cannot tell: a drafting
#: step after a k = 0 step is launched ahead, inside that step's wall): their ms over their rows, summed
#: with weight :data:`CATCH_UP_DECAY` per later catch-up (a ratio of sums: big catch-ups count more),
#: used once :data:`CATCH_UP_MIN_ROWS` rows were timed (the start-up figure before; H100, 2026-12-05:
#: 1.02 us a row timed at start-up over 1,024 rows, 1.40-1.92 us in the s256 run's catch-ups of ~150 k).
CATCH_UP_DECAY = 0.5
CATCH_UP_MIN_ROWS = 256
#: A timed catch-up above ``CATCH_UP_OUTLIER`` x what the current estimate gives its rows +
#: ``CATCH_UP_SLACK_MS`` teaches nothing, unless :data:`CATCH_UP_MAX_REJECTED` in a row did not (then
#: the device, or the host launching the eager pass, is that slow). H100, 2026-12-06, s1: the
#: warm-up's first catch-ups (kernels compiled in them) timed 528 rows at 14.5 us a row against the
#: table's 1.29; with no later catch-up to dilute it, every drafting step was charged that price and
#: the policy stayed at k = 0 for the whole sweep (0.99 of k = 3 where k = 1 had given 1.07).
CATCH_UP_OUTLIER = 4.0
CATCH_UP_SLACK_MS = 0.5
CATCH_UP_MAX_REJECTED = 2
#: A drafting step is charged at least ``1 / CATCH_UP_HORIZON`` of each sequence's catch-up, whatever
#: tokens it has left (:meth:`AdaptiveSpecPolicy.choose`): leaving ``k = 0`` must repay its catch-up
#: within this many drafting steps, not only by the sequences' end. The share by tokens left alone let
#: measurement noise flip the choice: H100, 2026-12-06, s256 on a host whose ``k = 0`` and ``k = 3``
#: rates were within 5%: four switches to ``k = 3`` in two rounds, each first writing 127-152 k
#: deferred entries (58-73 ms), then back to ``k = 0`` within a few hundred steps.
CATCH_UP_HORIZON = 32
#: A drafting ``k`` replaces ``k = 0`` only where its rate (tokens per ms, catch-up charges included)
#: is above ``1 + SWITCH_MARGIN`` times ``k = 0``'s (:attr:`AdaptiveSpecPolicy.switch_margin`).
#: Drafting has costs that no step's rate holds: the step after a drafting one is not scheduled ahead
#: of it, a prompt step verifies the drafts in flight, requests end a few steps apart so prompts come
#: in more, smaller steps. H100, 2026-12-06, s8 (Air 3 layers, forced acceptance 0.8, a normal host):
#: k = 2 predicted 0.2-1.6% above k = 0 and its decode steps matched plain decoding's per token
#: (within 2%), yet the adaptive arm ran 0.93x plain decoding; s1's drafting wins were predicted at
#: 3.7-7.8% (measured: 1.05x).
SWITCH_MARGIN = 0.03
#: Batch sizes :func:`measure_step_costs` times by default (those up to ``max_num_seqs`` that
#: the runner has graphs for, plus ``max_num_seqs``); others use the next larger measured one.
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class StepCostTable:
    """Milliseconds of one step per padded batch size and number of proposed drafts.

    Attributes:
        verify_ms: ``{k: {batch: ms}}``, the target forward over ``batch x (1 + k)`` rows.
        draft_ms: ``{k: {batch: ms}}``, the draft passes proposing ``k`` drafts (``k = 0``: the
            MTP KV-cache writes).
        source: how it was made (``"measured: ..."`` or a file name), for reports.
        catch_up_ms_per_row: ms to write one deferred MTP entry (the catch-up pass's device time
            over :data:`CATCH_UP_CALIBRATION_ROWS` rows, per row); 0 where none is deferred.
    """

    verify_ms: Dict[int, Dict[int, float]]
    draft_ms: Dict[int, Dict[int, float]]
    source: str = ""
    #: what writing one deferred MTP entry costs a drafting step (ms; 0: not measured, or the
    #: runner defers none)
    catch_up_ms_per_row: float = 0.0

    def __post_init__(self) -> None:
        def num(x, kind):  # a bool is an int to Python, not a time or a size to a table
            if isinstance(x, bool):
                raise TypeError(f"got {x!r}, a bool")
            return kind(x)
        try:
            self.verify_ms = {num(k, int): {num(b, int): num(t, float) for b, t in d.items()}
                              for k, d in self.verify_ms.items()}
            self.draft_ms = {num(k, int): {num(b, int): num(t, float) for b, t in d.items()}
                             for k, d in self.draft_ms.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"step cost table: keys must be ints (k, batch size) and times numbers: {exc}") from None
        bad = [(name, k, b, t) for name, table in (("verify_ms", self.verify_ms), ("draft_ms", self.draft_ms))
               for k, d in table.items() for b, t in d.items()
               if not math.isfinite(t) or t < 0 or (name == "verify_ms" and t <= 0) or b < 1 or k < 0]
        if bad:
            name, k, b, t = bad[0]
            raise ValueError(f"step cost table: {name}[{k}][{b}] = {t}: times must be finite, verify > 0 and "
                             "draft >= 0 ms, k >= 0 and batch sizes >= 1")
        try:
            self.catch_up_ms_per_row = num(self.catch_up_ms_per_row, float)
        except (TypeError, ValueError):
            raise ValueError(f"step cost table: catch_up_ms_per_row must be a number, got "
                             f"{self.catch_up_ms_per_row!r}") from None
        if not (math.isfinite(self.catch_up_ms_per_row) and self.catch_up_ms_per_row >= 0):
            raise ValueError(f"step cost table: catch_up_ms_per_row must be finite and >= 0, got "
                             f"{self.catch_up_ms_per_row}")
        if not self.verify_ms or set(self.verify_ms) != set(self.draft_ms):
            raise ValueError(f"step cost table: verify_ms and draft_ms must cover the same k values, got "
                             f"{sorted(self.verify_ms)} and {sorted(self.draft_ms)}")
        for k in self.verify_ms:
            if not self.verify_ms[k] or set(self.verify_ms[k]) != set(self.draft_ms[k]):
                raise ValueError(f"step cost table: k={k} needs the same batch sizes in verify_ms and draft_ms")
        self._sizes = {k: sorted(row) for k, row in self.verify_ms.items()}
        # the table is fixed: what the policy reads on every step, kept (a hot path)
        self._ks = tuple(sorted(self.verify_ms))
        self._step_cache: Dict[Tuple[int, int, int], float] = {}  # (batch, k, verify_k) -> step_ms
        self._size_cache: Dict[Tuple[int, int], int] = {}  # (batch, k) -> size_for

    @property
    def ks(self) -> List[int]:
        return list(self._ks)

    def step_ms(self, batch: int, k: int, verify_k: Optional[int] = None) -> float:
        """``verify(verify_k) + draft(k)`` (``verify_k`` default ``k``: the steady state) at the
        smallest measured batch size ``>= batch`` (the largest one above it).

        Raises:
            KeyError: ``k`` or ``verify_k`` not in the table.
        """
        v = k if verify_k is None else verify_k
        ms = self._step_cache.get((batch, k, v))
        if ms is None:
            for j in (k, v):
                if j not in self.verify_ms:
                    raise KeyError(f"step cost table has no k={j} (has {self.ks})")
            ms = self.verify_ms[v][self.size_for(batch, v)] + self.draft_ms[k][self.size_for(batch, k)]
            self._step_cache[(batch, k, v)] = ms
        return ms

    def size_for(self, batch: int, k: int = 0) -> int:
        """The batch size measured for ``k`` that ``batch`` sequences are costed at: the smallest
        ``>= batch``, else the largest.

        Raises:
            KeyError: ``k`` not in the table.
        """
        size = self._size_cache.get((batch, k))
        if size is None:
            sizes = self._sizes[k]
            i = bisect.bisect_left(sizes, batch)
            size = self._size_cache[(batch, k)] = sizes[i] if i < len(sizes) else sizes[-1]
        return size

    def as_dict(self) -> Dict[str, object]:
        return {"verify_ms": self.verify_ms, "draft_ms": self.draft_ms, "source": self.source,
                "catch_up_ms_per_row": self.catch_up_ms_per_row}

    def save(self, path: str) -> None:
        """Write the table as JSON (what :meth:`load` reads)."""
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "StepCostTable":
        """Read a table written by :meth:`save` (``{"verify_ms": {k: {batch: ms}}, "draft_ms": ...}``).

        Raises:
            ValueError: not such a table (the message names the file and what is missing).
        """
        try:
            with open(path) as f:
                d = json.load(f)
            if not isinstance(d, dict):
                raise ValueError(f"the file holds a JSON {type(d).__name__}, not an object")
            missing = [key for key in ("verify_ms", "draft_ms") if key not in d]
            if missing:
                raise ValueError(f"missing {', '.join(map(repr, missing))}")
            return cls(d["verify_ms"], d["draft_ms"], d.get("source") or path, d.get("catch_up_ms_per_row", 0.0))
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"adaptive_cost_table {path!r} is not a valid step cost table "
                             f"({{'verify_ms': {{k: {{batch: ms}}}}, 'draft_ms': ...}}): {exc}") from exc


def _middle(xs: Sequence) -> list:
    """The middle element of ``xs`` sorted (the two middle ones for an even count; ``xs`` non-empty)."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2:len(s) // 2 + 1]


def _median(xs: Sequence[float]) -> float:
    mid = _middle(xs)
    return sum(mid) / len(mid)


@dataclass
class AdaptiveSpecPolicy:
    """Chooses each step's number of drafts (see the module docstring).

    Args:
        max_k: ``num_speculative_tokens``; choices are ``0 .. max_k`` within ``costs.ks``.
        costs: the step cost table.
        prior_rate: each position's acceptance rate before any observation.
        prior_weight: how many observations the prior is worth.
        decay: every step multiplies the observed counts by this (recent steps weigh more).
        prompt_reserve: share of the token budget kept for waiting prompts (``choose``; 0: off).
        hold_k0_steps: steps the engine proposes ``k = 0`` for per pure-decode choice of it while
            the batch stays in its bucket, without asking or reporting them (see the module
            docstring; 1: every step asked).
        hold_draft_steps: the same for a pure-decode choice of a drafting ``k`` (outside a burst)
            whose host time is measured at the batch's bucket (:meth:`holds_draft`): the engine
            proposes it for this many pure-decode steps while the batch stays in its bucket, a
            prompt step asking again; the held steps' acceptance is still observed.
        switch_margin: a drafting ``k`` is chosen over ``k = 0`` only where its rate is above
            ``1 + switch_margin`` times ``k = 0``'s (:data:`SWITCH_MARGIN`; 0: plain argmax).

    Raises:
        ValueError: the table lacks ``k = 0`` or ``max_k``, or parameters out of range.
    """

    max_k: int
    costs: StepCostTable
    prior_rate: float = 0.8
    prior_weight: float = 4.0
    decay: float = 0.995
    overhead_weight: float = 0.05
    prompt_reserve: float = 0.0
    #: steps at ``k = 0`` per pure-decode choice of it (1: the policy asked every step; the module docstring)
    hold_k0_steps: int = HOLD_K0_STEPS
    #: pure-decode steps at a drafting ``k`` per choice of it (:data:`HOLD_DRAFT_STEPS`)
    hold_draft_steps: int = HOLD_DRAFT_STEPS
    #: drafting must beat k = 0's rate by this share (:data:`SWITCH_MARGIN`)
    switch_margin: float = SWITCH_MARGIN
    reached: List[float] = field(default_factory=list)
    accepted: List[float] = field(default_factory=list)
    #: The host time per pure-decode step that the table misses, ``a + c B + b r`` for ``B``
    #: sequences emitting ``B + r`` tokens (ms; each >= 0): fitted by decayed least squares
    #: (weight :attr:`overhead_weight`), the per-step part ``a``,
    overhead_ms: float = 0.0
    #: the per-sequence part ``c`` (ms per sequence in the step)
    overhead_ms_per_seq: float = 0.0
    #: and the per-token part ``b`` (ms per accepted draft emitted).
    overhead_ms_per_token: float = 0.0
    # per prompt token, what the last PROMPT_SAMPLES prompt-carrying steps of k = 0 / of drafting took
    # beyond their table cost and the host plane (ms; prompt_ms_per_token); prompt-carrying choose()
    # calls; the count of those at which each kind was last proposed
    _prefill_samples: List[List[float]] = field(default_factory=lambda: [[], []], init=False, repr=False)
    _prompt_steps: int = field(default=0, init=False, repr=False)
    _prompt_last: List[int] = field(default_factory=lambda: [0, 0], init=False, repr=False)
    # the prompt-step count before which a re-try of drafting blocked by its catch-up is not looked at again
    _prompt_retry_blocked_until: int = field(default=0, init=False, repr=False)
    #: Per (table batch size, proposed ``k``): the median of what its last :data:`MEASURED_WINDOW`
    #: pure-decode steps took beyond the device table (ms), of the steps that proposed the same ``k``
    #: as the two steps before them and the step chosen after them: a steady run of that ``k``, not a
    #: transition (see :meth:`observe_step_time`). Where measured it replaces the host plane's
    #: prediction for that ``k``; the plane predicts the others.
    excess_ms: Dict[Tuple[int, int], float] = field(default_factory=dict)
    #: The batch size of the median step(s): a step of another batch size in the same table
    #: bucket is charged ``excess + c (batch - that size)``, ``c`` the plane's :attr:`overhead_ms_per_seq`
    #: (the device cost is the bucket's padded graph whatever the batch, the host's grows with it: H100,
    #: 2026-12-05, s256, a k = 0 excess measured at ~256 sequences, 4.4 ms, charged at 219).
    excess_batch: Dict[Tuple[int, int], float] = field(default_factory=dict)
    #: Pure-decode steps outside a steady run of their k (a switch of k, the first step ahead, ...)
    #: whose k was measured at their bucket, and their mean excess over that measurement (ms): what
    #: switching costs; reported (``bench arms``' ``adaptive_host_model``), not charged yet.
    transition_steps: int = 0
    transition_extra_ms: float = 0.0
    #: Pure-decode steps counted in :attr:`excess_ms` (steady runs of their k), in all.
    steady_steps: int = field(default=0, init=False)
    _decode_samples: int = field(default=0, init=False, repr=False)  # pure-decode steps observed
    _fit_samples: int = field(default=0, init=False, repr=False)  # ... of them in the plane (steady runs)
    # counted steps per (bucket, k) since its measure was last reset, and the last MEASURED_WINDOW
    # of them as (excess ms, batch)
    _excess_n: Dict[Tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    _excess_window: Dict[Tuple[int, int], List[Tuple[float, float]]] = field(default_factory=dict, init=False,
                                                                             repr=False)
    _last_k: Optional[int] = field(default=None, init=False, repr=False)  # k the last observed step proposed
    _last_k2: Optional[int] = field(default=None, init=False, repr=False)  # ... and the one before it
    _chosen_k: Optional[int] = field(default=None, init=False, repr=False)  # what choose() returned last
    _decode_choices: int = field(default=0, init=False, repr=False)  # pure-decode choose() calls
    # table batch size -> k -> the _decode_choices count when it was last proposed
    _last_chosen: Dict[int, Dict[int, int]] = field(default_factory=dict, init=False, repr=False)
    _last_burst: int = field(default=0, init=False, repr=False)  # _decode_choices at the last burst's start
    _bursts: Dict[Tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)  # per (bucket, k)
    # bucket -> the pure-decode choice count before which its unmeasured ks are not priced again
    _declined: Dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _explore: List[int] = field(default_factory=list, init=False, repr=False)  # ks still to propose in a burst
    # re-checks of displaced ks (RECHECK_AFTER): table batch size -> its last best k; (bucket, k) -> the
    # choice count at which its window is emptied; (bucket, k) -> re-checks done so far
    _best_at: Dict[int, int] = field(default_factory=dict, init=False, repr=False)
    # (batch, whether k = 0 was the best pure-decode k) of the last prompt step's choice (k0_is_best)
    _prompt_k0_best: Optional[Tuple[int, bool]] = field(default=None, init=False, repr=False)
    _recheck_due: Dict[Tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    _rechecks: Dict[Tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    # the same for prompt kinds (PROMPT_RECHECK_AFTER): the last best kind, (kind, prompt step count) of
    # the scheduled re-check, re-checks done per kind
    _prompt_best: Optional[int] = field(default=None, init=False, repr=False)
    _prompt_recheck: Optional[Tuple[int, int]] = field(default=None, init=False, repr=False)
    _prompt_rechecks: List[int] = field(default_factory=lambda: [0, 0], init=False, repr=False)
    _burst_choice: bool = field(default=False, init=False, repr=False)  # the last pure-decode choice was a burst's
    _prompt_explored: bool = field(default=False, init=False, repr=False)  # ... the last prompt step's, the other kind
    _last_prompt: bool = field(default=False, init=False, repr=False)  # the last choice was a prompt step's
    # decayed moments over pure-decode steps of (B, r, y): E[B], E[r], E[y], E[BB], E[Br], E[rr], E[By], E[ry]
    _moments: List[float] = field(default_factory=lambda: [0.0] * 8, init=False, repr=False)
    # decayed sums over timed catch-ups of (ms, rows), and the rows timed in all
    _catch_up_sums: List[float] = field(default_factory=lambda: [0.0, 0.0], init=False, repr=False)
    _catch_up_rows_timed: int = field(default=0, init=False, repr=False)
    _catch_up_rejected: int = field(default=0, init=False, repr=False)  # outliers in a row (observe_catch_up)
    #: ``None`` (the default: nothing kept), or a list the policy appends one dict to per step-time
    #: sample (:meth:`observe_step_time`: ``"sample"`` with the step's batch, ``k``, verified ``v``, wall,
    #: table and excess ms, extra tokens ``r``, whether it was in a steady run of its ``k`` and the host
    #: plane after it) and per pure-decode choice (:meth:`choose`: ``"choice"`` with the batch, the ``k``
    #: chosen, each ``k``'s ``(E(k), t(k))`` before catch-up shares, whether a burst chose it): what
    #: the choices rested on, step by step (``MTPSPEC_ADAPTIVE_TRACE=1`` turns it on in
    #: :class:`~mtpspec.engine.llm.LLM`; ``bench arms --in-process`` writes it per run). At most
    #: :data:`TRACE_MAX` records.
    trace: Optional[List[Dict[str, object]]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not {0, self.max_k} <= set(self.costs.ks):
            raise ValueError(f"adaptive speculation length needs step costs for k = 0 and k = {self.max_k}, "
                             f"the table has {self.costs.ks}")
        if not (0.0 <= self.prior_rate <= 1.0 and self.prior_weight > 0 and 0.0 < self.decay <= 1.0
                and 0.0 <= self.prompt_reserve < 1.0
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                        for n in (self.hold_k0_steps, self.hold_draft_steps))
                and 0.0 <= self.switch_margin < 1.0):
            raise ValueError("prior_rate must be in [0, 1], prior_weight > 0, decay in (0, 1], prompt_reserve in "
                             "[0, 1), hold_k0_steps and hold_draft_steps ints >= 1, switch_margin in [0, 1)")
        self.reached = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification of ``num_draft_tokens`` drafts with ``num_accepted`` accepted: positions
        ``1 .. min(num_accepted + 1, num_draft_tokens)`` were reached, ``1 .. num_accepted`` accepted."""
        for j in range(min(num_accepted + 1, num_draft_tokens)):
            self.reached[j] += 1.0
            if j < num_accepted:
                self.accepted[j] += 1.0

    def observe_step_time(self, batch: int, k: int, wall_ms: float, verify_k: Optional[int] = None,
                          num_prefill_tokens: int = 0, num_emitted: Optional[int] = None,
                          num_catch_up_rows: int = 0) -> None:
        """A step of ``batch`` sequences that verified ``verify_k`` (default ``k``) drafts, proposed
        ``k``, carried ``num_prefill_tokens`` prompt tokens and emitted ``num_emitted`` tokens
        (default ``batch``) took ``wall_ms`` from the previous step's end (host included). Without
        prompt tokens it updates the host plane (:attr:`overhead_ms`, :attr:`overhead_ms_per_seq`,
        :attr:`overhead_ms_per_token`), with them the samples of :meth:`prompt_ms_per_token`. Samples more than 4x the predicted cost + 5 ms (an idle
        engine between steps), and pure-decode ones under a quarter of it (no step's own time: one
        applied right after another as the batch drains, 0.04 ms against 5.4 predicted in a CPU
        trace) are ignored (prompt samples only once their kind has
        :data:`MIN_PROMPT_SAMPLES`), and prompt samples before any pure-decode sample (the
        overhead is not known yet).

        :attr:`excess_ms` counts a step only inside a steady run of its ``k``: the two steps
        observed before it proposed ``k`` too, and so did the last :meth:`choose` (with async
        scheduling a step's wall is the engine call that applies it, which also schedules and
        launches the next step, before applying it for a ``k = 0`` step scheduled ahead, after it
        otherwise: the last step of a run holds a different ``k``'s launch, and the step after a
        switch a different wait).

        ``num_catch_up_rows``: deferred MTP entries the step wrote before its first pass: a prompt
        step's sample leaves out what they cost (:meth:`catch_up_ms_per_row`); a pure-decode step
        that wrote some is a transition, no sample (its wall holds the catch-up)."""
        v = k if verify_k is None else verify_k
        if k not in self.costs.verify_ms or v not in self.costs.verify_ms:
            self._last_k = self._last_k2 = None
            return
        predicted = self.costs.step_ms(batch, k, v)
        r = max(0.0, float(num_emitted) - batch) if num_emitted is not None else 0.0
        if num_prefill_tokens > 0:
            # the next pure-decode step verifies this one's drafts and (k = 0, async scheduling) was
            # not scheduled ahead: a transition, whatever k it proposes
            self._last_k = self._last_k2 = None
            if not self._decode_samples:
                return
            host = self.host_ms(batch, r)
            cost = self.prompt_ms_per_token(k > 0)
            expected = predicted + host + num_prefill_tokens * cost
            # the idle-gap filter only once the kind's cost rests on MIN_PROMPT_SAMPLES samples (one
            # low first sample must not reject every later one: the median handles outliers)
            trusted = len(self._prefill_samples[int(k > 0)]) >= MIN_PROMPT_SAMPLES
            catch_up = num_catch_up_rows * self.catch_up_ms_per_row()
            if 0.0 < wall_ms and (not trusted or wall_ms <= 4.0 * (expected + catch_up) + 5.0):
                per_token = max(0.0, wall_ms - predicted - host - catch_up) / num_prefill_tokens
                # each kind's cost is 0 until its first sample (the kind not yet measured looks
                # cheap and is proposed), then the median of its last PROMPT_SAMPLES samples
                samples = self._prefill_samples[int(k > 0)]
                samples.append(per_token)
                del samples[:-PROMPT_SAMPLES]
            return
        if num_catch_up_rows and k:  # a transition: the step's rows were deferred by k = 0 steps
            self._last_k = self._last_k2 = None
            return
        if 0.25 * predicted <= wall_ms <= 4.0 * predicted + 5.0 and wall_ms > 0.0:
            excess = max(0.0, wall_ms - predicted)
            steady = k == self._last_k == self._last_k2 and self._chosen_k in (None, k)
            if steady:  # a steady run of k
                key = (self.bucket(batch), k)
                self._excess_n[key] = self._excess_n.get(key, 0) + 1
                self.steady_steps += 1
                window = self._excess_window.setdefault(key, [])
                window.append((excess, float(batch)))
                del window[:-MEASURED_WINDOW]
                # the median sample (the two middle ones' mean) and its own batch size, which the excess
                # is moved from (_measured_host_ms)
                mid = _middle(window)
                self.excess_ms[key] = sum(e for e, _ in mid) / len(mid)
                self.excess_batch[key] = sum(b for _, b in mid) / len(mid)
            else:  # a transition: what it took beyond a steady step of its k (a diagnostic, not charged)
                measured = self._measured_host_ms(self.bucket(batch), k, batch)
                if measured is not None:
                    self.transition_steps += 1
                    self.transition_extra_ms += (excess - measured - self.transition_extra_ms) / self.transition_steps
            if steady:  # the plane too (a transition's excess is its switch's: H100, 2026-12-07, one k = 0 step
                # verifying a prompt step's drafts, 0.67 ms over its table with r = 5, took b from 0.073 to 0.110
                # ms a token and held the demo model's s8 at k = 0 against k3's 8% lead)
                self._fit_host(float(batch), r, excess)
            self._decode_samples += 1
            if self.trace is not None:
                self._record({"kind": "sample", "batch": batch, "k": k, "v": v, "wall_ms": wall_ms,
                              "table_ms": predicted, "excess_ms": excess, "r": r,
                              "steady": steady,
                              "plane": (self.overhead_ms, self.overhead_ms_per_seq, self.overhead_ms_per_token)})
        self._last_k, self._last_k2 = k, self._last_k

    def prompt_ms_per_token(self, drafting: bool) -> float:
        """What a step carrying prompt tokens took beyond its table cost and the host plane, per
        prompt token (ms, >= 0): the median over the last :data:`PROMPT_SAMPLES` such steps that
        proposed ``k >= 1`` (``drafting``: they also run the MTP layer's first pass over the prompt
        rows and, with deferred MTP entries, catch up the decodes' lags) or ``k = 0``. A kind not
        sampled yet costs 0 (optimistic): the next prompt-carrying step whose choice it could
        change proposes it and measures it. (Taking the other kind's value instead gave every
        ``k`` the same prompt cost, so a prompt step always favoured the longest draft and the
        ``k = 0`` cost was never measured: H200, 2026-12-05.)"""
        samples = self._prefill_samples[int(drafting)]
        return _median(samples) if samples else 0.0

    def observe_catch_up(self, num_rows: int, ms: float) -> None:
        """A catch-up pass wrote ``num_rows`` deferred MTP entries in ``ms`` of device time (CUDA
        events around it; host time on a CPU): into :meth:`catch_up_ms_per_row`. Nothing for no rows
        or a time that is negative or not finite, nor for one above :data:`CATCH_UP_OUTLIER` x the
        current estimate + :data:`CATCH_UP_SLACK_MS` (up to :data:`CATCH_UP_MAX_REJECTED` in a row)."""
        if num_rows <= 0 or not (0.0 <= ms < float("inf")):
            return
        expected = num_rows * self.catch_up_ms_per_row()
        if expected > 0 and ms > CATCH_UP_OUTLIER * expected + CATCH_UP_SLACK_MS \
                and self._catch_up_rejected < CATCH_UP_MAX_REJECTED:
            self._catch_up_rejected += 1  # a first-use outlier (kernels compiled in it), or launch-bound
            return
        self._catch_up_rejected = 0
        sums = self._catch_up_sums
        sums[0] = CATCH_UP_DECAY * sums[0] + ms
        sums[1] = CATCH_UP_DECAY * sums[1] + num_rows
        self._catch_up_rows_timed += num_rows

    @property
    def catch_up_rows_timed(self) -> int:
        """Deferred entries whose catch-up was timed (:meth:`observe_catch_up`), in all."""
        return self._catch_up_rows_timed

    def catch_up_ms_per_row(self) -> float:
        """What writing one deferred MTP entry costs a drafting step (ms, >= 0): the timed catch-ups'
        (:meth:`observe_catch_up`, :data:`CATCH_UP_DECAY`) once :data:`CATCH_UP_MIN_ROWS` rows were
        timed, before that the table's :attr:`StepCostTable.catch_up_ms_per_row`, timed at start-up
        (0: not measured)."""
        if self._catch_up_rows_timed < CATCH_UP_MIN_ROWS:
            return self.costs.catch_up_ms_per_row
        return self._catch_up_sums[0] / self._catch_up_sums[1]

    @property
    def prefill_ms_per_token(self) -> float:
        """:meth:`prompt_ms_per_token` of ``k = 0`` steps (ms)."""
        return self.prompt_ms_per_token(False)

    @property
    def draft_prefill_ms_per_token(self) -> float:
        """:meth:`prompt_ms_per_token` of drafting steps (ms)."""
        return self.prompt_ms_per_token(True)

    def host_ms(self, batch: float, extra_tokens: float) -> float:
        """The host plane: ``a + c batch + b extra_tokens`` ms."""
        return self.overhead_ms + self.overhead_ms_per_seq * batch + self.overhead_ms_per_token * extra_tokens

    def _fit_host(self, nb: float, r: float, y: float) -> None:
        """One pure-decode sample of ``y = a + c nb + b r`` (decayed moments, weight
        :attr:`overhead_weight`, the first sample taken whole). Both slopes where both variables
        spread and are not collinear; one where only that one spreads (the other drifts to 0 by
        :attr:`decay` a sample, so a slope learnt from a few odd steps cannot pin the choice);
        none before :data:`MIN_FIT_SAMPLES` samples. Then ``a`` = the mean excess less the slopes'
        share, all clipped at 0."""
        m, w = self._moments, (self.overhead_weight if self._fit_samples else 1.0)
        # the eight moments of (B, r, y), unrolled (one step's bookkeeping: a hot path)
        mb = m[0] = m[0] + w * (nb - m[0])
        mr = m[1] = m[1] + w * (r - m[1])
        my = m[2] = m[2] + w * (y - m[2])
        m[3] += w * (nb * nb - m[3])
        m[4] += w * (nb * r - m[4])
        m[5] += w * (r * r - m[5])
        m[6] += w * (nb * y - m[6])
        m[7] += w * (r * y - m[7])
        sbb, sbr, srr = m[3] - mb * mb, m[4] - mb * mr, m[5] - mr * mr
        sby, sry = m[6] - mb * my, m[7] - mr * my
        tol = (MIN_SPREAD * mb) ** 2
        self._fit_samples += 1
        b_ok = sbb > tol and self._fit_samples >= MIN_FIT_SAMPLES
        r_ok = srr > tol and self._fit_samples >= MIN_FIT_SAMPLES
        det = sbb * srr - sbr * sbr
        if b_ok and r_ok and det > MIN_SPREAD * sbb * srr:
            c, b = (srr * sby - sbr * sry) / det, (sbb * sry - sbr * sby) / det
        elif r_ok:
            c, b = self.overhead_ms_per_seq * self.decay, sry / srr
        elif b_ok:
            c, b = sby / sbb, self.overhead_ms_per_token * self.decay
        else:
            c, b = self.overhead_ms_per_seq * self.decay, self.overhead_ms_per_token * self.decay
        self.overhead_ms_per_seq, self.overhead_ms_per_token = max(0.0, c), max(0.0, b)
        self.overhead_ms = max(0.0, my - self.overhead_ms_per_seq * mb - self.overhead_ms_per_token * mr)

    def end_step(self) -> None:
        """Decay the counts (once per engine step)."""
        if self.decay < 1.0:
            self.reached = [x * self.decay for x in self.reached]
            self.accepted = [x * self.decay for x in self.accepted]

    def rates(self) -> List[float]:
        """``alpha_j`` for ``j = 1 .. max_k``: (accepted + prior) / (reached + prior weight)."""
        w, r = self.prior_weight, self.prior_rate
        return [(a + w * r) / (n + w) for a, n in zip(self.accepted, self.reached)]

    def expected_tokens(self, k: int, rates: Optional[Sequence[float]] = None) -> float:
        """``E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j`` tokens per sequence per step."""
        return _expected_tokens((self.rates() if rates is None else rates)[:k])[k]

    def choose(self, batch: int, num_prefill_tokens: int = 0, prompts_waiting: bool = False,
               token_budget: Optional[int] = None, num_partial_prefills: int = 0,
               catch_up: Union[Sequence[Tuple[int, Optional[float]]],
                               Callable[[], Sequence[Tuple[int, Optional[float]]]]] = ()) -> int:
        """The ``k`` in ``0 .. max_k`` (among the table's) for ``batch`` sequences in a step that
        also carries ``num_prefill_tokens`` prompt tokens (smallest ``k`` on ties).

        A pure-decode step takes the ``k`` maximising ``E(k) / t(k)`` (``k = 0``'s counted ``1 +``
        :attr:`switch_margin` times), ``t(k) = T(batch, k) + H(k)``
        (``H``: the host time measured for ``k`` at this batch size, else the plane ``a + c batch +
        b batch (E(k) - 1)`` of :meth:`observe_step_time`). A prompt-carrying step pays its prompt
        chunk whatever ``k`` is, so tokens per ms is the wrong measure there; it takes the ``k``
        maximising ``n E(k) c* - t(k) - num_prefill_tokens * prompt_ms_per_token(k >= 1)``, ``n =
        batch - num_partial_prefills`` (a chunk that does not end its prompt keeps no drafts):
        the tokens it emits valued at ``c* = min_j t(j) / (batch E(j))``, the ms a token costs in
        the best pure-decode step, minus what the step costs (a drafting prompt step is worth its
        extra time only if its extra tokens come cheaper than decoding them later would). A kind
        (``k = 0`` or drafting) measured at too few prompt steps or not proposed at the last
        :data:`PROMPT_EXPLORE_EVERY` is proposed instead (once pure-decode steps were observed:
        before, no prompt sample can be taken; while both kinds lack samples, the one with fewer).
        With :attr:`prompt_reserve` ``r > 0``, ``prompts_waiting`` (prompt tokens left to schedule) and ``token_budget``
        (``max_num_batched_tokens``), only ``k = 0`` and the ``k`` with ``batch * (1 + k) <= (1 -
        r) * token_budget`` are considered.

        Deferred MTP entries: ``catch_up`` lists ``(rows, R)`` per sequence with entries that its
        ``k = 0`` steps deferred: a drafting step first writes them, ``rows q`` ms (``q`` =
        :meth:`catch_up_ms_per_row`) paid once for the rest of that sequence's drafting, ``R`` the
        tokens it is expected to emit still (``None``: unknown). So ``t(k)``, ``k >= 1``, carries
        each sequence's share of its entries' cost that one step's tokens take of what is left,
        ``sum rows q min(1, max(E(k) / R, 1 / H))`` (all of it where ``R`` is unknown; ``H`` =
        :data:`CATCH_UP_HORIZON`: leaving ``k = 0`` must repay its catch-up within ``H`` steps); a
        prompt step where the best pure-decode ``k`` is 0 before any charge is charged all of ``C =
        sum rows q`` for drafting (its sequences go back to ``k = 0`` after it), and is not made to
        re-try drafting while ``C`` exceeds a ``k = 0`` step's cost; an exploration burst is priced
        with all of ``C`` (:data:`MEASURE_MARGIN`).
        ``catch_up`` may be a function returning that list: it is called only where the choice can
        depend on it (charges only lower a drafting ``k``'s rate or value against ``k = 0``'s: a
        pure-decode step whose best ``k`` is 0 before any charge calls it only to price a burst that
        may start, at most once per :data:`EXPLORE_RECHECK` choices where declined; a prompt step
        only where drafting wins before charges or a re-try of drafting is due, at most once per
        :data:`PROMPT_RECHECK` where blocked), so the engine builds the list, ``O(batch)`` host
        work, only then."""
        rates = self.rates()
        q = self.catch_up_ms_per_row()
        n_prompt = max(0, num_prefill_tokens)
        fixed = self.host_ms(batch, 0.0)
        costs = self.costs
        bucket = self.bucket(batch)
        per_token = self.overhead_ms_per_token * batch  # b B per accepted draft per sequence
        cap = None
        if self.prompt_reserve > 0 and prompts_waiting and token_budget:
            cap = (1.0 - self.prompt_reserve) * token_budget
        expected = _expected_tokens(rates)  # E(k) for k = 0 .. max_k in one pass
        cost_of: Dict[int, Tuple[float, float]] = {}  # k -> (E(k), t(k)) before any catch-up share
        for k in costs._ks:
            if k > self.max_k or (k and cap is not None and batch * (1 + k) > cap):
                continue
            e = expected[k]
            host = self._measured_host_ms(bucket, k, batch)  # measured for this k and bucket, else the plane
            host = fixed + per_token * (e - 1.0) if host is None else host
            cost_of[k] = (e, costs.step_ms(batch, k) + host)
        base = cost_of  # (never changed in place: charged() makes a new dict)
        # the batch's lag arrays and the ms of writing all their entries, made once if at all
        lags: List[Tuple[np.ndarray, np.ndarray, float]] = []

        def lag_arrays() -> Tuple[np.ndarray, np.ndarray, float]:
            if not lags:
                rows, inv_left = _lag_arrays(catch_up() if callable(catch_up) else catch_up)
                lags.append((rows, inv_left, q * float(rows.sum())))
            return lags[0]

        def catch_up_all() -> float:  # ms to write every deferred entry of the batch
            return lag_arrays()[2] if q > 0 else 0.0

        def charged() -> Dict[int, Tuple[float, float]]:  # cost_of with each drafting k's catch-up shares
            rows, inv_left, _ = lag_arrays()
            out = dict(base)
            if rows.size:
                for k, (e, t) in base.items():
                    if k:  # each sequence's share of its entries that one step's tokens take of those left
                        # (inv_left = inf where unknown: all of it), at least 1 / CATCH_UP_HORIZON
                        share = np.minimum(1.0, np.maximum(e * inv_left, 1.0 / CATCH_UP_HORIZON))
                        out[k] = (e, t + q * float(rows @ share))
            return out

        self._last_prompt = bool(n_prompt)
        if n_prompt:
            # (k0_is_best: the pure-decode choice at these rates, before charges, which only lower drafting)
            self._prompt_k0_best = (batch, self._argmax_rate(base) == 0)
            self._chosen_k = k = self._choose_prompt_step(batch, max(0, batch - num_partial_prefills), n_prompt,
                                                          base, charged if q > 0 else None, catch_up_all)
            if self.trace is not None:
                self._record({"kind": "prompt choice", "batch": batch, "prompt_tokens": n_prompt, "k": k,
                              "explored": self._prompt_explored, "cost_of": dict(base)})
            return k
        if q > 0 and self._argmax_rate(cost_of) != 0:  # (else k = 0 is best and its rate uncharged)
            cost_of = charged()
        best = self._argmax_rate(cost_of)
        e, t = cost_of[best]
        self._chosen_k = k = self._explored(bucket, best, e / t, base, catch_up_all)
        if self.trace is not None:
            self._record({"kind": "choice", "batch": batch, "k": k, "best": best, "burst": self._burst_choice,
                          "cost_of": dict(base), "charged": cost_of is not base})
        return k

    def _record(self, rec: Dict[str, object]) -> None:
        """Append ``rec`` to :attr:`trace` (the oldest records go past :data:`TRACE_MAX`)."""
        self.trace.append(rec)
        if len(self.trace) > TRACE_MAX:
            del self.trace[:len(self.trace) - TRACE_MAX]

    @property
    def exploring(self) -> bool:
        """The last pure-decode choice was an exploration burst's, or a burst's next steps are set:
        a ``k = 0`` chosen so is not the policy's best and is not held (:attr:`hold_k0_steps`)."""
        return self._burst_choice or bool(self._explore)

    @property
    def rechecks_done(self) -> Dict[str, int]:
        """The re-checks that emptied a measure so far: ``{"batch B k K": n}`` for pure-decode ``k``
        at table batch size ``B`` (:data:`RECHECK_AFTER`), ``"prompt k0"`` / ``"prompt drafting"``
        for the prompt steps' kinds (:data:`PROMPT_RECHECK_AFTER`); only those done at least once."""
        out = {f"batch {b} k {k}": n for (b, k), n in sorted(self._rechecks.items())}  # (counted when done)
        out.update({f"prompt {kind}": n for kind, n in zip(("k0", "drafting"), self._prompt_rechecks) if n})
        return out

    @property
    def last_choice_explored(self) -> bool:
        """The last :meth:`choose` proposed a ``k`` other than its best by design: an exploration
        burst's (pure decode) or a re-try of the other kind (``k = 0`` vs drafting) at a prompt step."""
        return self._prompt_explored if self._last_prompt else self._burst_choice

    def observe_held_step(self, num_prefill_tokens: int = 0, k: int = 0) -> None:
        """A step that the engine proposed ``k`` for without asking (a held choice,
        :attr:`hold_k0_steps`, :attr:`hold_draft_steps`; not timed): a pure-decode one still counts
        as a step of ``k`` before the next observed one, so that one is in a steady run of ``k``;
        one carrying ``num_prefill_tokens`` prompt tokens makes the next one a transition, as an
        observed prompt step does (:meth:`observe_step_time`)."""
        if num_prefill_tokens > 0:
            self._last_k = self._last_k2 = None
        else:
            self._last_k, self._last_k2 = k, self._last_k

    def holds_draft(self, batch: int, k: int) -> bool:
        """Whether a pure-decode choice of drafting ``k`` at ``batch`` sequences may be held
        (:attr:`hold_draft_steps`): only once that ``k``'s host time is measured at ``batch``'s
        bucket (:attr:`excess_ms`). A ``k`` priced by the host plane alone is asked again every step
        until its own steady steps measure it: held, a wrong guess ran for two holds (the asked
        step's sample comes in after the next choice; a review's simulation of s64 on a host-bound
        engine: each of k = 2, 3, 1 ran 32 steps before k = 0 won, 2% of the run)."""
        return (self.bucket(batch), k) in self.excess_ms

    def k0_is_best(self, batch: int) -> bool:
        """The last prompt step's :meth:`choose` (at ``batch`` sequences) found ``k = 0`` the best
        pure-decode ``k`` at the current rates and costs, before any catch-up charge (charges only
        lower a drafting ``k``'s rate): its ``k = 0`` may start a hold (:attr:`hold_k0_steps`), as
        a pure-decode choice of ``k = 0`` would. (The bucket's last pure-decode best instead could
        be long stale: a review's case held k = 0 at a bucket last visited when acceptance was 0.)"""
        last = self._prompt_k0_best
        return last is not None and last[0] == batch and last[1]

    def bucket(self, batch: int) -> int:
        """The table batch size ``batch`` sequences are costed at: measured host times, exploration
        and re-checks are kept per bucket, and a held ``k = 0`` choice (:attr:`hold_k0_steps`) is
        kept while the batch stays in it."""
        return self.costs.size_for(batch)

    def _measured_host_ms(self, bucket: int, k: int, batch: int) -> Optional[float]:
        """:attr:`excess_ms` of ``(bucket, k)`` moved to ``batch`` sequences along the plane's per-sequence
        slope (:attr:`excess_batch`), at least 0; ``None`` where not measured."""
        host = self.excess_ms.get((bucket, k))
        if host is None:
            return None
        b = self.excess_batch.get((bucket, k))
        return host if b is None else max(0.0, host + self.overhead_ms_per_seq * (batch - b))

    def _argmax_rate(self, cost_of: Dict[int, Tuple[float, float]]) -> int:
        """The ``k`` of the highest ``E(k) / t(k)`` (the smallest ``k`` on ties), ``k = 0``'s rate
        counted ``1 +`` :attr:`switch_margin` times (where ``k = 0`` is allowed)."""
        best, best_rate = 0, -1.0
        for k, (e, t) in cost_of.items():
            rate = e / t * (1.0 + self.switch_margin) if k == 0 else e / t
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def _choose_prompt_step(self, batch: int, n_drafting: int, n_prompt: int, base: Dict[int, Tuple[float, float]],
                            charged: Optional[Callable[[], Dict[int, Tuple[float, float]]]],
                            catch_up_all: Callable[[], float]) -> int:
        """:meth:`choose` for a step of ``batch`` sequences (``n_drafting`` of them keep their drafts)
        carrying ``n_prompt`` prompt tokens, ``base``: ``k -> (E(k), t(k))`` before any catch-up
        charge; ``charged()``: the same with each drafting ``k``'s catch-up shares (``None``: no
        catch-up is priced); ``catch_up_all()``: the ms of writing every deferred entry of the
        batch. Where even without charges the best pure-decode ``k`` is 0, the steps after this one
        go back to ``k = 0`` (and defer again), so a drafting ``k`` is charged all of the catch-up
        here, not the share its tokens take (that share assumes the sequences keep drafting; H100,
        2026-12-06, s256: prompt steps at k = 2-3 first wrote 65-143 k deferred entries, 29-46 ms,
        for one step's drafts). Charges only lower a drafting ``k``'s value against ``k = 0``'s, so
        the batch's catch-up list is built only where drafting wins without them or a re-try of
        drafting is due (an ``O(batch)`` pass every prompt step otherwise)."""
        self._prompt_explored = False
        per_token = (self.prompt_ms_per_token(False), self.prompt_ms_per_token(True))

        def values(cost_of):
            c_star = min(t / (batch * e) for e, t in cost_of.values())
            value_of = {k: n_drafting * e * c_star - t - n_prompt * per_token[k > 0] for k, (e, t) in cost_of.items()}
            tol = 1e-9 * max(abs(v) for v in value_of.values())
            top = max(value_of.values())
            best = next(k for k, v in value_of.items() if v >= top - tol)  # smallest k on ties
            drafting_values = [v for k, v in value_of.items() if k]
            best_drafting = next((k for k, v in value_of.items() if k and v >= max(drafting_values) - tol), None)
            return best, best_drafting

        cost_of, catch_up_ms = base, 0.0
        best, best_drafting = values(base)
        n = self._prompt_steps + 1
        retry_due = self._decode_samples > 0 and n >= self._prompt_retry_blocked_until and self._kind_due(1, n)
        priced = charged is not None and (best > 0 or (best_drafting is not None and retry_due))
        if priced:
            catch_up_ms = catch_up_all()
            if catch_up_ms > 0 and self._argmax_rate(base) == 0:
                cost_of = {k: (e, t + (catch_up_ms if k else 0.0)) for k, (e, t) in base.items()}
            else:
                cost_of = charged()
            best, best_drafting = values(cost_of)
        if not self._decode_samples:  # no prompt sample can be taken yet (observe_step_time)
            return best
        self._prompt_steps = n
        drafting = int(best > 0)
        self._recheck_prompt_kind(drafting, n)
        other = 0 if drafting else best_drafting  # the kind not chosen, if any is allowed
        if other and charged is not None and not priced:
            other = None  # a re-try of drafting not due (or blocked lately): its catch-up was not priced
        elif other and 0 in cost_of and catch_up_ms > cost_of[0][1]:
            other = None  # re-trying drafting would first write more deferred entries than a k = 0 step costs
            self._prompt_retry_blocked_until = n + PROMPT_RECHECK  # (and the list is not built again before)
        self._prompt_explored = other is not None and self._kind_due(1 - drafting, n)
        if self._prompt_explored:
            best, drafting = other, 1 - drafting
        self._prompt_last[drafting] = n
        return best

    def _recheck_prompt_kind(self, best_kind: int, n: int) -> None:
        """Prompt step ``n``'s best kind is ``best_kind``: where it displaced the other kind, sampled
        :data:`MIN_PROMPT_SAMPLES` times and proposed last (its own samples displaced it), schedule
        that kind's re-check (:data:`PROMPT_RECHECK_AFTER`); a re-check due drops its kind's samples
        (it is proposed and sampled anew: :meth:`_kind_due`)."""
        prev, self._prompt_best = self._prompt_best, best_kind
        if prev is not None and prev != best_kind and self._prompt_recheck is None \
                and self._prompt_last[prev] >= self._prompt_last[1 - prev] \
                and len(self._prefill_samples[prev]) >= MIN_PROMPT_SAMPLES:
            level = self._prompt_rechecks[prev]
            self._prompt_recheck = (prev, n + min(PROMPT_EXPLORE_EVERY, PROMPT_RECHECK_AFTER << level))
        due = self._prompt_recheck
        if due is not None and (due[0] == best_kind or n >= due[1]):
            self._prompt_recheck = None
            if due[0] != best_kind:  # (best again meanwhile: its own steps re-measure it, no re-check counted)
                self._prefill_samples[due[0]].clear()
                self._prompt_rechecks[due[0]] += 1

    def _recheck(self, bucket: int, best: int, n: int, seen: Dict[int, int]) -> None:
        """Pure-decode choice ``n`` at table batch size ``bucket`` found ``best`` the best ``k``:
        where it displaced a measured ``k`` that was proposed last here (``seen``: ``k`` -> the choice
        count it was last proposed at; its own steps displaced it), schedule that one's re-check
        (:data:`RECHECK_AFTER`); a re-check due empties its ``k``'s window and burst count
        (exploration measures it anew)."""
        prev = self._best_at.get(bucket)
        if prev != best:
            self._best_at[bucket] = best
            self._recheck_due.pop((bucket, best), None)  # (best again: its own steps re-measure it)
            key = (bucket, prev)
            if prev is not None and key not in self._recheck_due and self._excess_n.get(key, 0) >= MIN_MEASURED \
                    and seen.get(prev, -1) >= max(seen.values(), default=-1):
                self._recheck_due[key] = n + min(EXPLORE_EVERY, RECHECK_AFTER << self._rechecks.get(key, 0))
        if self._recheck_due:
            for key in [key for key, due in self._recheck_due.items() if key[0] == bucket and n >= due]:
                del self._recheck_due[key]
                self._rechecks[key] = self._rechecks.get(key, 0) + 1  # (a cancelled one is not counted)
                self._forget_measure(key)
                self._bursts.pop(key, None)

    def _forget_measure(self, key: Tuple[int, int]) -> None:
        """Empty the window of ``(bucket, k)``: its next counted steps measure it anew (its
        :attr:`excess_ms` stands until the first of them)."""
        self._excess_n[key] = 0
        self._excess_window.pop(key, None)

    def _kind_due(self, kind: int, n: int) -> bool:
        """Whether prompt step ``n`` is due to propose ``kind`` (0: ``k = 0``, 1: drafting): its prompt
        cost rests on fewer than :data:`MIN_PROMPT_SAMPLES` samples (and no more than the other kind's),
        or it was not proposed at the last :data:`PROMPT_EXPLORE_EVERY` prompt steps."""
        lack, have = len(self._prefill_samples[kind]), len(self._prefill_samples[1 - kind])
        return (lack < MIN_PROMPT_SAMPLES and lack <= have) or n - self._prompt_last[kind] > PROMPT_EXPLORE_EVERY

    def _explored(self, bucket: int, best: int, best_rate: float, base: Dict[int, Tuple[float, float]],
                  catch_up_all: Callable[[], float]) -> int:
        """``best`` (its rate ``best_rate``), or for a pure-decode step at table batch size ``bucket``
        the ``k`` of an exploration burst (:data:`EXPLORE_EVERY`), priced with its catch-up
        (:data:`MEASURE_MARGIN`; ``base``: ``k -> (E(k), t(k))`` of the ``k`` allowed, before
        catch-up shares; ``catch_up_all()``: the ms of writing every deferred entry of the batch)."""
        self._decode_choices = n = self._decode_choices + 1
        seen = self._last_chosen.setdefault(bucket, {})
        self._recheck(bucket, best, n, seen)
        since = n - self._last_burst
        if not self._explore and since > MIN_FIT_SAMPLES:
            # a k measured by too few steps at this batch size (unless bursts keep failing to measure it:
            # their samples rejected) within MEASURE_MARGIN and a cheap catch-up, else one not proposed
            # here for long: within EXPLORE_MARGIN of the best after EXPLORE_EVERY steps, whatever its
            # rate after STALE_EVERY (one bad burst must not shut a k out for good); never a k below the best
            # that could not win even with no host time (_could_win)
            recheck = n >= self._declined.get(bucket, 0)  # (priced and declined lately: not priced again yet)
            declined = False
            # the ks a burst may try at all, before any pricing (which may build the batch's lag list)
            winnable = [k for k in base if k != best and self._could_win(bucket, k, best, best_rate, base)]
            stale = [k for k in winnable if self._excess_n.get((bucket, k), 0) < MIN_MEASURED
                     and self._bursts.get((bucket, k), 0) < MAX_MEASURING_BURSTS] if recheck else []
            if stale:  # within MEASURE_MARGIN before any catch-up, and a drafting k's catch-up cheap
                stale = [k for k in stale if base[k][0] / base[k][1] >= (1.0 - MEASURE_MARGIN) * best_rate]
                if any(stale):
                    cheap = catch_up_all() / EXPLORE_STEPS <= MEASURE_CATCH_UP * base[best][1]
                    stale = [k for k in stale if k == 0 or cheap]
                declined = not stale
            if not stale and since > EXPLORE_EVERY:
                due = [k for k in winnable if n - seen.get(k, 0) > EXPLORE_EVERY]
                stale = [k for k in due if n - seen.get(k, 0) > STALE_EVERY]  # whatever its rate: not priced
                if not stale and due and recheck and not declined:  # its burst's rate, catch-up spread over it
                    c = catch_up_all() / EXPLORE_STEPS if any(due) else 0.0
                    stale = [k for k in due if base[k][0] / (base[k][1] + (c if k else 0.0))
                             >= (1.0 - EXPLORE_MARGIN) * best_rate]
                    declined = not stale
            if declined:
                self._declined[bucket] = n + EXPLORE_RECHECK
            if stale:  # the one proposed longest ago
                k = min(stale, key=lambda k: (seen.get(k, 0), k))
                self._explore = [k] * EXPLORE_STEPS
                key = (bucket, k)
                self._bursts[key] = self._bursts.get(key, 0) + 1
                if self._excess_n.get(key, 0) >= MIN_MEASURED:  # measured long ago: the burst's steps replace it
                    self._forget_measure(key)
                self._last_burst = n
        k, self._burst_choice = best, False
        if self._explore:
            k, self._burst_choice = self._explore.pop(), True
            if k not in base:  # not allowed this step (the prompt reserve): the burst ends
                k, self._explore, self._burst_choice = best, [], False
        seen[k] = n
        return k

    def _could_win(self, bucket: int, k: int, best: int, best_rate: float,
                   base: Dict[int, Tuple[float, float]]) -> bool:
        """Whether ``k`` could beat ``best`` (rate ``best_rate``) at table batch size ``bucket`` whatever
        its host time: a ``k`` above the best always may (its further positions' rates are not measured
        by the best's verifications); one below only if ``E(k)`` over :data:`DEVICE_FLOOR_SHARE` of its
        table device time (``k = 0``'s rate counted ``1 +`` :attr:`switch_margin` times, as in
        :meth:`_argmax_rate`) reaches ``best_rate``."""
        if k >= best:
            return True
        bound = base[k][0] / (DEVICE_FLOOR_SHARE * self.costs.step_ms(bucket, k))
        return bound * (1.0 + self.switch_margin if k == 0 else 1.0) >= best_rate


def _expected_tokens(rates: Sequence[float]) -> List[float]:
    """``[E(0), .., E(len(rates))]``, ``E(k) = 1 + sum_{i<=k} prod_{j<=i} rates[j - 1]`` (the running
    products summed once for every ``k``)."""
    out, e, run = [1.0], 1.0, 1.0
    for a in rates:
        run *= a
        e += run
        out.append(e)
    return out


def _lag_arrays(catch_up: Sequence[Tuple[int, Optional[float]]]) -> Tuple[np.ndarray, np.ndarray]:
    """``(rows, 1 / left)`` float64 arrays of the pairs with ``rows > 0`` (``1 / left`` is inf where
    ``left`` is unknown or not positive: a step's share ``min(1, E(k) / left)`` is then all of them)."""
    rows, inv = [], []  # one pass in Python: for a step's few hundred pairs quicker than numpy's conversions
    inf = math.inf
    for r, left in catch_up:  # any iterable
        if r is not None and r > 0:  # None / nan: no rows
            rows.append(r)
            inv.append(1.0 / left if left is not None and left > 0 else inf)  # nan > 0 is False
    return np.array(rows, dtype=np.float64), np.array(inv, dtype=np.float64)


def _hidden_write_ms(runner, bp: int, repeats: int) -> float:
    """Median ms of a deferring ``k = 0`` step's MTP work: ``bp`` rows into the hidden-state cache
    (:mod:`mtpspec.spec_decode.deferred_mtp`), at the first ``bp`` slots (the calibration runs
    before any request, so these zero rows overwrite nothing that is read)."""
    import torch

    from mtpspec.timing import median_call_ms
    cache = runner.hidden_cache
    rows = torch.zeros(bp, cache.hidden_size, dtype=cache.dtype, device=runner.device)
    slots = torch.arange(bp, device=runner.device) % (cache.kv_cache.shape[0] * cache.kv_cache.shape[1])  # distinct
    return median_call_ms(lambda: cache.write(rows, slots), repeats, cuda=runner.device.type == "cuda")


def _catch_up_ms_per_row(runner, repeats: int) -> float:
    """Median ms per row of the catch-up pass (:func:`~mtpspec.spec_decode.deferred_mtp.catch_up`:
    the hidden-state read and the proposer's KV-only pass) over one sequence of
    ``min(CATCH_UP_CALIBRATION_ROWS, max_num_batched_tokens, cache slots)`` rows at positions 0 ..,
    in blocks 0 .. (the calibration runs before any request: the entries it writes are never read)."""
    import torch

    from mtpspec.layers.attention import AttentionMetadata
    from mtpspec.timing import median_call_ms
    cache, dev, bs = runner.hidden_cache, runner.device, runner.cache_config.block_size
    n = min(CATCH_UP_CALIBRATION_ROWS, runner.scheduler_config.max_num_batched_tokens,
            cache.kv_cache.shape[0] * cache.kv_cache.shape[1])
    nb = -(-n // bs)
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], **i32), seq_lens=torch.tensor([n], **i32),
                             slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
                             block_tables=torch.arange(nb, **i32)[None], num_seqs=1, max_query_len=n, max_seq_len=n,
                             query_lens=[n], seq_lens_list=[n])
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    write = runner.proposer.write_kv_rows
    return median_call_ms(lambda: write(ids, positions, cache.read(meta), meta), repeats,
                          cuda=dev.type == "cuda") / n


def measure_step_costs(runner, sizes: Optional[Sequence[int]] = None, repeats: int = 5) -> StepCostTable:
    """Time one step's units per batch size and ``k`` on this rank (``collective_rpc`` runs it on
    every rank alike: the units hold collectives).

    CUDA graphs captured: each unit replayed ``repeats`` times after a warm-up, CUDA events,
    median. Otherwise the same calls through the static buffers (``graph_mode="static"``), timed
    on the host. Inputs are the capture's dummy layout (``bp`` sequences of ``1 + k`` tokens in
    block 0); cost is what a pure-decode step of that size pays.

    Args:
        runner: a :class:`~mtpspec.engine.model_runner.ModelRunner` with its KV cache attached.
        sizes: padded batch sizes (default :data:`CALIBRATION_SIZES` up to the largest graph size,
            and that size).
        repeats: timed calls per unit.

    Returns:
        the :class:`StepCostTable` (milliseconds) for ``k = 0 .. runner.k`` at each padded size
        and, where the runner defers MTP entries, the catch-up pass's cost per entry
        (``k = 0``'s draft cost: the MTP KV-only units, or the hidden-state write where the runner
        defers those entries, 0 where its verify units write them; their catch-up, paid by the next drafting step, is timed too:
        :attr:`StepCostTable.catch_up_ms_per_row`).
    """
    import torch

    from mtpspec.engine.forward import GraphedForward

    fwd = runner.fwd
    if not isinstance(fwd, GraphedForward):  # eager runner: a static-buffer twin times the same calls
        sc = runner.scheduler_config
        width = -(-sc.decode_slots(sc.max_model_len) // runner.cache_config.block_size)
        fwd = GraphedForward(runner.target, runner.mtp, runner.k, sc.max_num_seqs, width,
                             runner.target.config.hidden_size, runner.kv_dtype, runner.device, "static",
                             sc.decode_slots(sc.max_model_len), ks=range(runner.k + 1))
    graphed = fwd.mode == "cuda" and fwd.capture_failed is None and bool(fwd.graphs)
    top = fwd.sizes[-1]
    sizes = sorted({s for s in (sizes or CALIBRATION_SIZES) if s <= top} | {top})
    sizes = sorted({fwd.padded(s) for s in sizes})  # the graph sizes they run at
    units = runner.proposer.graph_units()

    def timed(key):
        return fwd.time_unit(key, repeats, units.draft_fn)

    verify: Dict[int, Dict[int, float]] = {}
    draft: Dict[int, Dict[int, float]] = {}
    with torch.inference_mode():
        for bp in sizes:
            fwd.dummy_layout(bp, runner.k)
            steps = {(i, wt): timed(("step", bp, i, wt)) for i, wt in units.step_units}
            for k in range(runner.k + 1):
                fwd.dummy_layout(bp, k)
                verify.setdefault(k, {})[bp] = timed(("verify", bp, k))
                if k == 0 and runner.hidden_cache is not None:  # deferred MTP entries: only the hidden-state write,
                    # inside the verify unit where the runner's graphs write it (GraphedForward.hidden_sink)
                    d = 0.0 if fwd.hidden_sink is not None else _hidden_write_ms(runner, bp, repeats)
                elif k == 0:
                    d = sum(timed(("kvonly", bp, i, k)) for i in units.first_pass_layers)
                else:
                    # the first pass at the width this k's steps are verified with, then k - 1 draft steps
                    d = sum(timed(key) for key in fwd.first_pass_keys(bp, k, units))  # with the first draft
                    d += sum(t for (i, wt), t in steps.items() if wt and 1 <= i < k)
                    fills = [t for (i, wt), t in steps.items() if not wt]  # several MTP layers: cache fills
                    if fills and k > 2:  # steps 1 .. k - 2 write their row to every other used layer
                        d += (k - 2) * (len(fills) - 1) * sum(fills) / len(fills)
                draft.setdefault(k, {})[bp] = d
        catch_up = _catch_up_ms_per_row(runner, repeats) if runner.hidden_cache is not None else 0.0
    events = " (CUDA events)" if runner.device.type == "cuda" else ""
    how = "CUDA-graph replays" if graphed else "static buffers, eager" + events
    return StepCostTable(verify, draft, f"measured at start-up ({how}, median of {repeats})", catch_up)
