"""What ``LLM.generate`` returns (vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: ``log p(token | prefix)`` under the raw model distribution (``log_softmax`` of
            the target's logits, before penalties, temperature, top-k and top-p), float32 math.
        rank: 1-based rank in that distribution: how many tokens have a log-probability ``>=``
            this one's (vLLM's definition; ties count against the token).
        decoded_token: the token's text alone (``None`` without a tokenizer, or with
            ``SamplingParams(detokenize=False)``).
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per generated token: {token id: Logprob} holding the generated token and the top-N alternatives
# (N or N + 1 entries; the generated token first). Per prompt token: the same, ``None`` for the first.
SampleLogprobs = List[Dict[int, Logprob]]
PromptLogprobs = List[Optional[Dict[int, Logprob]]]


@dataclass
class RequestMetrics:
    """Per-request timing (host ``time.perf_counter`` seconds) and speculative-decoding counters.

    Attributes:
        arrival_time, first_scheduled_time, first_token_time, last_token_time, finished_time:
            host timestamps (``None`` until they happen).
        itl: seconds between consecutive steps that emitted tokens for this request (one entry
            per step after the first; a step may emit several tokens).
        num_output_tokens: tokens emitted.
        num_drafts: verification steps that checked drafts for this request.
        num_draft_tokens: draft tokens checked (``k`` per draft at a fixed ``k``; the step's verify width under adaptive speculation length).
        num_accepted_tokens: accepted draft tokens that were emitted: drafts the verifier accepted
            but that came after a stop (EOS, stop id or string, ``max_tokens``,
            ``max_model_len``) are dropped and not counted.
        num_accepted_tokens_per_pos: ``[k]``: how often the draft at position ``j`` was accepted.
        accepted_length_histogram: ``[k + 1]``: how many drafts had ``a`` accepted tokens.
        num_preemptions: times the request was preempted and recomputed.
        num_cached_tokens: prompt tokens found in the prefix cache when the request was first
            scheduled (not computed; ``None`` before that).
    """

    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    itl: List[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: List[int] = field(default_factory=list)
    accepted_length_histogram: List[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: Optional[int] = None

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first, seconds (``None`` below 2 tokens)."""
        if self.num_output_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def acceptance_length(self) -> Optional[float]:
        """``1 + num_accepted_tokens / num_drafts`` (vLLM's mean acceptance length), counting
        only emitted drafts; ``None`` before the first verification."""
        return None if self.num_drafts == 0 else 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted draft tokens over draft tokens."""
        return None if self.num_draft_tokens == 0 else self.num_accepted_tokens / self.num_draft_tokens

    def as_dict(self) -> Dict[str, Union[float, int, List, None]]:
        """Plain-data summary (includes the derived values)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(ttft=self.ttft, tpot=self.tpot, acceptance_length=self.acceptance_length,
                 acceptance_rate=self.acceptance_rate)
        return d


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: the completion's index in its request, ``0 .. n - 1`` (``SamplingParams.n``; with
            ``best_of > n``: the rank by ``cumulative_logprob``, 0 the highest).
        text: detokenized output, cut before a matched stop string ("" without a tokenizer, or
            with ``SamplingParams(detokenize=False)``).
        token_ids: generated ids; a stop token / EOS that ended the request is included; tokens
            accepted after a stop are not.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (``max_tokens``
            or the context length), ``"abort"``, or ``None`` while running.
        stop_reason: the stop string or stop token id that matched (``None`` for EOS/length).
        logprobs: with ``SamplingParams.logprobs``: one ``{token id: Logprob}`` per token of
            ``token_ids`` (the generated token and the top-N alternatives), else ``None``.
        cumulative_logprob: the sum of the generated tokens' log-probabilities (with
            ``logprobs``, and always with ``best_of > n``, whose ranking key it is), else ``None``.
    """

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text (``None`` when the prompt was given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: ``n`` :class:`CompletionOutput` s in ``index`` order (one unless
            ``SamplingParams.n > 1``).
        finished: whether the request is done.
        metrics: timings and speculative-decoding counters (with ``n > 1`` or ``best_of``: of all
            the request's sequences together, see :mod:`mtpspec.engine.parallel_sampling`).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token, ``None`` for
            the first, then ``{token id: Logprob}`` (the prompt token and the top-N
            alternatives), from the prefill's logits; else ``None``.
        num_cached_tokens: prompt tokens served from the prefix cache when the request was
            first scheduled (vLLM's name; ``None`` before it was scheduled).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_cached_tokens: Optional[int] = None
