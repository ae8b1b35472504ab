"""Engine-wide speculative-decoding and throughput counters (host-side arithmetic only).

Everything here is computed from the token lists a step already brought to the host, from
``time.perf_counter`` and from the collectives' host byte counters, so gathering it adds no
device synchronisation to a step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class SpecDecodingStats:
    """Draft acceptance counters (vLLM's names).

    Only emitted tokens count: when a stop (EOS, stop id or string, ``max_tokens``,
    ``max_model_len``) lands inside an accepted block, the accepted drafts after it are dropped
    and counted as drafted but not accepted (see
    :meth:`~mtpspec.engine.scheduler.Scheduler.update_from_output`).

    Attributes:
        k: the most draft tokens per verification (``num_speculative_tokens``).
        num_drafts: verifications (one per decode of one sequence with at least one draft).
        num_draft_tokens: drafts verified (``k * num_drafts`` at a fixed ``k``).
        num_accepted_tokens: accepted draft tokens that were emitted.
        num_accepted_tokens_per_pos: ``[k]``, acceptances at draft position ``j``.
        num_draft_tokens_per_pos: ``[k]``, verifications that had a draft at position ``j``
            (all of them at a fixed ``k``; fewer under adaptive speculation length).
        accepted_length_histogram: ``[k + 1]``, verifications with ``a`` accepted drafts.
        num_speculative_tokens_histogram: ``[k + 1]``, engine steps that proposed ``j`` drafts
            per sequence (adaptive speculation length chooses ``j`` per step; else all ``k``).
        num_mtp_catch_up_tokens: MTP KV entries that ``k = 0`` steps deferred and a later drafting
            step wrote (:mod:`mtpspec.spec_decode.deferred_mtp`); deferred entries of requests
            that finish at ``k = 0`` are never written.
    """

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: List[int] = field(default_factory=list)
    accepted_length_histogram: List[int] = field(default_factory=list)
    num_draft_tokens_per_pos: List[int] = field(default_factory=list)
    num_speculative_tokens_histogram: List[int] = field(default_factory=list)
    num_mtp_catch_up_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.k
        if not self.accepted_length_histogram:
            self.accepted_length_histogram = [0] * (self.k + 1)
        if not self.num_draft_tokens_per_pos:
            self.num_draft_tokens_per_pos = [0] * self.k
        if not self.num_speculative_tokens_histogram:
            self.num_speculative_tokens_histogram = [0] * (self.k + 1)

    def observe(self, num_accepted: int, num_draft_tokens: Optional[int] = None) -> None:
        """Record one verification of ``num_draft_tokens`` drafts (default ``k``) whose first
        ``num_accepted`` were accepted and emitted.

        Raises:
            ValueError: ``num_draft_tokens`` outside ``[1, k]`` or ``num_accepted`` outside
            ``[0, num_draft_tokens]``.
        """
        n = self.k if num_draft_tokens is None else num_draft_tokens
        if not 1 <= n <= self.k:
            raise ValueError(f"num_draft_tokens must be in [1, {self.k}], got {n}")
        if not 0 <= num_accepted <= n:
            raise ValueError(f"num_accepted must be in [0, {n}], got {num_accepted}")
        self.num_drafts += 1
        self.num_draft_tokens += n
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1
        for j in range(n):
            self.num_draft_tokens_per_pos[j] += 1
        self.accepted_length_histogram[num_accepted] += 1

    def observe_step(self, num_proposed: int) -> None:
        """Record one engine step that proposed ``num_proposed`` (``0 .. k``) drafts per sequence."""
        self.num_speculative_tokens_histogram[num_proposed] += 1

    @property
    def acceptance_length(self) -> Optional[float]:
        """Mean tokens per verification: ``1 + num_accepted_tokens / num_drafts``."""
        return None if not self.num_drafts else 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> Optional[float]:
        """``num_accepted_tokens / num_draft_tokens``."""
        return None if not self.num_draft_tokens else self.num_accepted_tokens / self.num_draft_tokens

    def as_dict(self) -> Dict[str, object]:
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens,
                    num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
                    accepted_length_histogram=list(self.accepted_length_histogram),
                    num_draft_tokens_per_pos=list(self.num_draft_tokens_per_pos),
                    num_speculative_tokens_histogram=list(self.num_speculative_tokens_histogram),
                    num_mtp_catch_up_tokens=self.num_mtp_catch_up_tokens, acceptance_length=self.acceptance_length, acceptance_rate=self.acceptance_rate)


def _summary(xs: List[float]) -> Dict[str, Optional[float]]:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


@dataclass
class EngineMetrics:
    """Totals since the engine started (or ``LLMEngine.reset_metrics``, which makes a new one).

    Attributes:
        spec: acceptance counters (``None`` for plain decoding).
        num_steps, num_prompt_tokens (prefilled, recomputes included), num_output_tokens.
        num_request_prompt_tokens: the whole prompt of each sequence, counted when it emits its
            first token (prefix-cache hits included, recomputes not: vLLM's ``prompt_tokens``).
        busy_time_s: host wall time spent inside steps.
        ttft_s, itl_s, tpot_s: per-request samples (seconds) of finished requests.
        num_eager_fallbacks: steps that could not use a CUDA graph.
        num_preemptions: recompute preemptions.
        comm_bytes: bytes sent by rank 0's collectives, per op, over all steps.
        prefix_cache_queries / prefix_cache_hits: prompt tokens of newly admitted requests that
            looked up the prefix cache / that it served (vLLM's counters; recomputes after a
            preemption not counted).
        step_wall_s: per kind of step (``"prompt k<k>"``: it carried prompt tokens, ``"decode
            k<k>"``: it did not; ``k`` the drafts it proposed; ``" +catch-up"`` appended when it
            first wrote deferred MTP entries, :mod:`mtpspec.spec_decode.deferred_mtp`), ``[steps,
            seconds, sequences, prompt tokens, verified drafts, catch-up rows]`` summed over its
            steps (verified drafts: each step's drafts per decode; catch-up rows: deferred MTP
            entries written). The seconds are host wall time from the previous step's tokens
            applied to this step's (the first step after ``LLMEngine.reset_metrics``: from the
            start of the call that launched it), so they count the caller's time between steps and
            any idle time (a diagnostic for saturated benchmarks: where a run's wall time went).
    """

    spec: Optional[SpecDecodingStats] = None
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_request_prompt_tokens: int = 0
    num_output_tokens: int = 0
    busy_time_s: float = 0.0
    ttft_s: List[float] = field(default_factory=list)
    itl_s: List[float] = field(default_factory=list)
    tpot_s: List[float] = field(default_factory=list)
    num_eager_fallbacks: int = 0
    num_preemptions: int = 0
    comm_bytes: Dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_wall_s: Dict[str, List[float]] = field(default_factory=dict)
    last_step_applied: Optional[float] = field(default=None, repr=False)  # perf_counter() s

    def add_step_wall(self, has_prompt: bool, k: int, start: float, now: float, num_seqs: int = 0,
                      num_prompt_tokens: int = 0, verify_k: int = 0, catch_up_rows: int = 0) -> None:
        """Count a step whose tokens were applied at ``now`` (``start``: its own start, used when no
        step was applied since ``LLMEngine.reset_metrics``; both ``time.perf_counter()`` seconds) in
        :attr:`step_wall_s` under ``"prompt k<k>"`` (``has_prompt``) or ``"decode k<k>"``, ``k`` the
        drafts it proposed (``" +catch-up"`` with ``catch_up_rows``), with its ``num_seqs``,
        ``num_prompt_tokens``, ``verify_k`` (drafts per decode it verified) and ``catch_up_rows``."""
        since = start if self.last_step_applied is None else self.last_step_applied
        kind = f"{'prompt' if has_prompt else 'decode'} k{k}{' +catch-up' if catch_up_rows else ''}"
        rec = self.step_wall_s.setdefault(kind, [0, 0.0, 0, 0, 0, 0])
        for i, x in enumerate((1, max(0.0, now - since), num_seqs, num_prompt_tokens, verify_k, catch_up_rows)):
            rec[i] += x
        self.last_step_applied = now

    def add_comm(self, delta: Dict[str, int]) -> None:
        for op, n in delta.items():
            self.comm_bytes[op] = self.comm_bytes.get(op, 0) + n

    def as_dict(self) -> Dict[str, object]:
        """Everything, with derived rates: output tokens per busy second, bytes per step."""
        steps = max(self.num_steps, 1)
        d: Dict[str, object] = dict(
            num_steps=self.num_steps, num_prompt_tokens=self.num_prompt_tokens,
            num_request_prompt_tokens=self.num_request_prompt_tokens,
            num_output_tokens=self.num_output_tokens, busy_time_s=self.busy_time_s,
            output_tokens_per_s=(self.num_output_tokens / self.busy_time_s) if self.busy_time_s > 0 else None,
            ttft_s=_summary(self.ttft_s), itl_s=_summary(self.itl_s), tpot_s=_summary(self.tpot_s),
            num_eager_fallbacks=self.num_eager_fallbacks, num_preemptions=self.num_preemptions,
            comm_bytes_total=dict(self.comm_bytes),
            comm_bytes_per_step={op: n / steps for op, n in self.comm_bytes.items()},
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_hit_rate=(self.prefix_cache_hits / self.prefix_cache_queries
                                   if self.prefix_cache_queries else None),
            step_wall_s={kind: list(v) for kind, v in sorted(self.step_wall_s.items())},
        )
        if self.spec is not None:
            d.update(self.spec.as_dict())
        else:  # plain decoding: the headline figures exist (None), the draft counters do not
            d.update(acceptance_length=None, acceptance_rate=None)
        return d
