"""Per-request state: tokens, KV progress, block table, pending drafts, stop state, metrics."""

from __future__ import annotations

import enum
from typing import Dict, List, Optional, Union

from mtpspec.engine.detokenizer import IncrementalDetokenizer
from mtpspec.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mtpspec.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request (one completion).

    Attributes:
        request_id: the caller-visible id.
        prompt: prompt text or ``None``.
        prompt_token_ids / output_token_ids: token ids.
        params: its :class:`SamplingParams`.
        seed_key: 64-bit key of its random draws (:func:`~mtpspec.sample.counter_rng.seed_to_u64`).
        num_computed_tokens: leading positions whose target (and MTP) KV entries are valid.
        mtp_len: leading positions whose MTP KV entries are written (final); below
            ``num_computed_tokens`` only while adaptive speculation defers them
            (:mod:`mtpspec.spec_decode.deferred_mtp`).
        mtp_noted: positions of ``mtp_len`` already recorded on the blocks (prefix caching).
        is_prefill: the sequence still has prompt (after a preemption: prompt + output) tokens
            to prefill: new, partially prefilled (chunked prefill), or preempted. Cleared by the
            step that prefills its last chunk (which samples its next token); set again by a
            preemption.
        block_table: KV block ids, one per ``block_size`` positions; shared by the target and
            the MTP layers' caches (leading blocks may be shared with other sequences: prefix
            caching, :mod:`mtpspec.engine.block_manager`).
        block_hashes: chained content hashes of the full blocks hashed so far (prefix caching).
        num_cached_blocks: leading blocks of ``block_table`` already in the prefix cache (or
            left out of it because another block holds their key).
        draft_token_ids: drafts proposed in the previous step, verified in the next one.
        finish_reason / stop_reason: see :class:`~mtpspec.outputs.CompletionOutput`.
        output_logprobs / cumulative_logprob: one ``{token id: Logprob}`` per output token and
            their sum (``None`` unless ``params.logprobs`` is set).
        prompt_logprobs: ``[None, {id: Logprob}, ...]`` once the prefill scored the prompt
            (``None`` before, and unless ``params.prompt_logprobs`` is set).
        parent: the :class:`~mtpspec.engine.parallel_sampling.ParentRequest` this sequence is a
            child of (a request with ``n > 1`` or ``best_of``), else ``None``.
    """

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 params: SamplingParams, seed_key: int, arrival_time: float,
                 detokenizer: Optional[IncrementalDetokenizer] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: List[int] = []
        self.params = params
        self.seed_key = seed_key
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.mtp_len = 0
        self.mtp_noted = 0
        self.is_prefill = True
        self.block_table: List[int] = []
        self.block_hashes: List[int] = []
        self.num_cached_blocks = 0
        self.draft_token_ids: List[int] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.detokenizer = detokenizer
        self.output_text = ""
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.output_logprobs: Optional[List[Dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None
        self.parent = None  # Optional[ParentRequest]
        # distinct prompt ids (the repetition penalty's prompt mask), computed once when needed
        self._distinct_prompt_ids: Optional[List[int]] = None

    @property
    def distinct_prompt_token_ids(self) -> List[int]:
        """The prompt's distinct token ids, sorted (cached)."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = sorted(set(self.prompt_token_ids))
        return self._distinct_prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def completion_output(self, index: int = 0) -> CompletionOutput:
        """Its completion so far (token and logprob lists copied)."""
        return CompletionOutput(index, self.output_text, list(self.output_token_ids), self.finish_reason,
                                self.stop_reason, _copy(self.output_logprobs), self.cumulative_logprob)

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [self.completion_output()],
                             self.is_finished, self.metrics, _copy(self.prompt_logprobs),
                             self.metrics.num_cached_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, prefill={self.is_prefill}, blocks={len(self.block_table)})")


def _copy(x: Optional[list]) -> Optional[list]:
    return None if x is None else list(x)
