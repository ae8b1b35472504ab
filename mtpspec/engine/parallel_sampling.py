"""Parallel sampling: one request with ``n > 1`` or ``best_of`` as child sequences (vLLM's ``ParentRequest``).

:meth:`LLMEngine.add_request <mtpspec.engine.llm_engine.LLMEngine.add_request>` turns a request
whose :class:`~mtpspec.sampling_params.SamplingParams` ask for several sequences
(``num_sequences = best_of or n > 1``) into that many child :class:`~mtpspec.engine.sequence.Sequence` s,
queued one after the other. Requests with ``n == 1`` and no ``best_of`` stay one plain sequence,
exactly as before.

Children (vLLM's rules where vLLM has them):

* request id ``f"{i}_{parent id}"``;
* sampling params: the parent's with ``n = 1`` and no ``best_of``; with a ``seed``, child ``i``
  is seeded ``seed + i`` (wrapped into the int64 range: the same 64-bit key; so child 0 draws what
  the same request with ``n = 1`` draws); without
  one, every child gets its own engine-drawn seed, so the children's random streams are
  independent;
* ``prompt_logprobs`` only on child 0: the prompt is the same, so it is scored once;
* ``best_of > n`` without ``logprobs``: the children score their sampled tokens (``logprobs=0``,
  from the verification rows the engine computes anyway) to rank by ``cumulative_logprob``; the
  per-token entries are dropped from the outputs, the sum is kept.

The children share the prompt's KV blocks, with prefix caching on or off (vLLM V0's fork of the
prompt's blocks; :mod:`mtpspec.engine.scheduler` has the rules): child 0 prefills the prompt
alone (over several steps with chunked prefill); its siblings wait in the queue, skipped so that
the requests behind them are admitted, and are admitted once a child runs past the prompt by
:meth:`~mtpspec.engine.block_manager.BlockManager.fork_hit`: the blocks of positions ``<
len(prompt) - 1`` are referenced (reference counts), the partial last one is copied, and each
sibling computes the last prompt position itself (its own sample and MTP entry). A request of
``m`` sequences thus holds one prompt's blocks plus about one block per sibling, and its
siblings' first tokens come one step after child 0's; the tokens are unchanged (each child's
equal a separate request seeded ``seed + i``). With nothing to fork (child 0 finished by its
first token, or aborted alone) siblings are admitted as any request: prefix-cache hit when on,
else the whole prompt. A preempted child forks a running sibling when it is admitted again.

Aggregation (:meth:`ParentRequest.to_output`): one :class:`~mtpspec.outputs.RequestOutput` with
the parent's id; ``outputs`` holds child ``i`` as ``index = i`` (``best_of == n``), or the ``n``
children with the highest ``cumulative_logprob`` (vLLM V0's and OpenAI's ``best_of``; ties to
the lower child), re-indexed ``0 .. n - 1`` by rank. The request is finished when every child
is; aborting it aborts every child. Metrics (:func:`merge_metrics`): counters summed over the
children, the first scheduling / first token the earliest, the last token / finish the latest.
``num_cached_tokens`` is child 0's (the prompt counts once, as in ``usage``; a forked sibling
counts 0: its shared blocks are no prefix-cache hit, nor in the prefix-cache counters).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence as Seq, Tuple

from mtpspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mtpspec.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """vLLM's child request id."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """One request of several sequences (see the module docstring).

    Args:
        request_id: the caller-visible id.
        params: the request's sampling parameters (``num_sequences > 1``).
        arrival_time: host time of arrival.

    Attributes:
        children: the child sequences in index order (filled by the engine).
    """

    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.params = params
        self.arrival_time = arrival_time
        self.children: List = []  # List[Sequence]

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_sequences(self) -> int:
        return self.params.num_sequences

    @property
    def streams(self) -> bool:
        """Whether progress snapshots mean anything: not with ``best_of > n``, whose returned
        completions are only known when all candidates are finished."""
        return self.num_sequences == self.n

    def child_params(self, index: int) -> SamplingParams:
        """Child ``index``'s sampling parameters."""
        p = self.params
        logprobs = p.logprobs
        if logprobs is None and self.num_sequences > self.n:
            logprobs = 0  # the ranking needs each sampled token's logprob
        return dataclasses.replace(
            # seed + index wrapped into the int64 range (the same 64-bit key: seed_to_u64 takes it mod 2**64)
            p, n=1, best_of=None, seed=None if p.seed is None else (p.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63,
            logprobs=logprobs,
            prompt_logprobs=p.prompt_logprobs if index == 0 else None)

    @property
    def is_finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    @property
    def is_scheduled(self) -> bool:
        """Whether any child has been scheduled."""
        return any(c.metrics.first_scheduled_time is not None for c in self.children)

    @property
    def progress(self) -> Tuple[int, int]:
        """(output tokens, finished children): changes whenever a snapshot would."""
        return sum(len(c.output_token_ids) for c in self.children), sum(c.is_finished for c in self.children)

    def to_output(self) -> RequestOutput:
        """The request's output so far (see the module docstring)."""
        comps = [c.completion_output(i) for i, c in enumerate(self.children)]
        if self.num_sequences > self.n:
            order = sorted(range(len(comps)), key=lambda i: -_score(comps[i]))[:self.n]
            comps = [dataclasses.replace(comps[i], index=r) for r, i in enumerate(order)]
            if self.params.logprobs is None:
                for c in comps:
                    c.logprobs = None  # scored for the ranking only; the sum stays
        first = self.children[0]
        pl = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(self.request_id, first.prompt, list(first.prompt_token_ids), comps, self.is_finished,
                             merge_metrics(self.arrival_time, [c.metrics for c in self.children]), pl,
                             first.metrics.num_cached_tokens)


def _score(c: CompletionOutput) -> float:
    return float("-inf") if c.cumulative_logprob is None else c.cumulative_logprob


def merge_metrics(arrival_time: float, metrics: Seq[RequestMetrics]) -> RequestMetrics:
    """One request's :class:`RequestMetrics` from its children's.

    Token and speculative-decoding counters (``num_output_tokens``, ``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``, the per-position counts and the histogram) and
    ``num_preemptions`` are sums, so ``acceptance_length`` / ``acceptance_rate`` are those of all
    the request's verifications; ``first_scheduled_time`` / ``first_token_time`` are the earliest
    child's, ``last_token_time`` the latest, ``finished_time`` the latest once every child
    finished; ``itl`` holds every child's gaps. ``tpot`` is then the time per output token of the
    children together.
    """
    out = RequestMetrics(arrival_time=arrival_time)
    out.first_scheduled_time = _pick(min, [m.first_scheduled_time for m in metrics])
    out.first_token_time = _pick(min, [m.first_token_time for m in metrics])
    out.last_token_time = _pick(max, [m.last_token_time for m in metrics])
    done = [m.finished_time for m in metrics]
    out.finished_time = None if any(t is None for t in done) else max(done)
    for m in metrics:
        out.itl.extend(m.itl)
        out.num_output_tokens += m.num_output_tokens
        out.num_drafts += m.num_drafts
        out.num_draft_tokens += m.num_draft_tokens
        out.num_accepted_tokens += m.num_accepted_tokens
        out.num_preemptions += m.num_preemptions
        out.num_accepted_tokens_per_pos = _add(out.num_accepted_tokens_per_pos, m.num_accepted_tokens_per_pos)
        out.accepted_length_histogram = _add(out.accepted_length_histogram, m.accepted_length_histogram)
    return out


def _pick(fn, values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return fn(vals) if vals else None


def _add(a: List[int], b: List[int]) -> List[int]:
    if not b:
        return a
    if not a:
        return list(b)
    return [x + y for x, y in zip(a, b)]
