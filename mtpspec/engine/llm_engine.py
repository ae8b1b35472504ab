"""The engine loop on rank 0: requests in, steps out (scheduler + executor + bookkeeping)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import time
from typing import Any, Callable, Collection, Dict, List, NamedTuple, Optional, Tuple, Union

from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import CacheConfig, SchedulerConfig
from mtpspec.sample.counter_rng import seed_to_u64
from mtpspec.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from mtpspec.engine.executor import Executor
from mtpspec.engine.parallel_sampling import ParentRequest, child_request_id
from mtpspec.engine.scheduler import DRAFT_PENDING, ScheduledSeq, Scheduler, SchedulerOutput
from mtpspec.engine.sequence import Sequence
from mtpspec.step_io import SeqInput, StepInput, StepOutput
from mtpspec.outputs import Logprob, RequestOutput
from mtpspec.sample.logits_processors import SeqLogitsParams
from mtpspec.sample.logprobs import TokenLogprobs
from mtpspec.sampling_params import SamplingParams
from mtpspec.spec_decode.adaptive import AdaptiveSpecPolicy
from mtpspec.spec_decode.deferred_mtp import sequence_lag
from mtpspec.spec_decode.metrics import EngineMetrics, SpecDecodingStats

logger = logging.getLogger(__name__)
# MTPSPEC_LOG_STEPS=1: one log line per step (host phases in ms, tokens), to find where time goes.
_LOG_STEPS = os.environ.get("MTPSPEC_LOG_STEPS", "") not in ("", "0")


class ValidatedPrompt(NamedTuple):
    """A prompt :meth:`LLMEngine.validate_request` accepted together with ``params``.

    Passed back as the prompt of ``validate_request`` / ``add_request`` with the very same
    ``params`` object, it is not tokenized or checked again (a request is validated once, on
    the thread that received it, not again on the engine thread). With other params it is
    checked again as a ``{"prompt", "prompt_token_ids"}`` dict. Do not change its
    ``token_ids`` after validation (they are not copied until the request is queued).

    Attributes:
        text: the prompt text, ``None`` for a token-id prompt.
        token_ids: ``[P]`` prompt token ids (checked: ints in ``[0, vocab_size)``, ``P <
            max_model_len``).
        params: the :class:`SamplingParams` it was validated with.
    """

    text: Optional[str]
    token_ids: List[int]
    params: SamplingParams


PromptType = Union[str, Dict[str, Any], ValidatedPrompt]

# Most alternatives per position a request may ask for by default (vLLM's --max-logprobs default).
MAX_LOGPROBS = 20


def exceeds_max_logprobs(n: int, max_logprobs: int) -> bool:
    """Whether ``n`` alternatives per position (``-1`` already resolved to the vocabulary size) are
    more than ``max_logprobs`` allows (``-1``: no cap)."""
    return max_logprobs != -1 and n > max_logprobs


def _all_ints(ids: Union[List[Any], Tuple[Any, ...]]) -> bool:
    """Whether every element is an ``int`` and not a ``bool`` (by its distinct types: about 4x
    quicker than an ``isinstance`` per element on a long prompt)."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, ids)))


class _InFlight(NamedTuple):
    """A launched step whose tokens are not applied yet (:meth:`LLMEngine._step_ahead`): its
    scheduler output, handle, whether it held only decodes whose logits do not depend on
    their outputs (no prefill chunk, no ``logits_params``), and the start of the call that
    launched it (``time.perf_counter()`` s: the first step's start in ``step_wall_s``)."""

    out: SchedulerOutput
    handle: Any
    plain: bool
    launch_t0: float


class LLMEngine:
    """Validates and queues requests, runs steps, returns finished outputs.

    Args:
        executor: runs steps on the ranks.
        tokenizer: for text prompts, detokenization and stop strings (``None``: token ids only).
        scheduler_config, cache_config: limits and block size.
        vocab_size: the model's vocabulary size (prompt ids must be below it).
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        seed: seeds the per-request seeds of requests that give none (``None``: random).
        max_logprobs: the most logprobs / prompt logprobs a request may ask for per token
            (``-1``: no cap; vLLM's ``--max-logprobs``, default :data:`MAX_LOGPROBS`).

    Raises:
        ValueError: the KV cache cannot hold even one sequence of ``max_model_len`` tokens.
    """

    def __init__(self, executor: Executor, tokenizer: Optional[Tokenizer], scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, vocab_size: int, eos_token_ids: Collection[int],
                 seed: Optional[int] = None, max_logprobs: int = MAX_LOGPROBS):
        self.executor = executor
        self.max_logprobs = max_logprobs
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        bm = BlockManager(executor.num_kv_blocks, cache_config.block_size,
                          enable_caching=cache_config.enable_prefix_caching,
                          key_next_token=scheduler_config.num_speculative_tokens > 0)
        need = bm.blocks_for(scheduler_config.decode_slots(scheduler_config.max_model_len)) + bm.watermark_blocks
        if need > bm.num_blocks:
            raise ValueError(
                f"the KV cache ({bm.num_blocks} blocks of {cache_config.block_size} tokens) cannot hold one sequence "
                f"of max_model_len={scheduler_config.max_model_len} tokens plus lookahead ({need} blocks needed); "
                "lower max_model_len (CLI: --max-model-len) or give the cache more memory: num_kv_blocks (CLI: "
                "--num-kv-blocks), or on a GPU gpu_memory_utilization (CLI: --gpu-memory-utilization), on a CPU "
                "cpu_kv_cache_gib (CLI: --cpu-kv-cache-gib)")
        self.scheduler = Scheduler(scheduler_config, bm, self.eos_token_ids)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._step_id = itertools.count()
        k = scheduler_config.num_speculative_tokens
        self.metrics = EngineMetrics(spec=SpecDecodingStats(k) if k else None)
        # Optional hook (analysis / tests / benchmarks): ``hook(seq, proposed_drafts) -> drafts``
        # replaces the drafts a sequence will verify next step (k ints in [0, vocab)).
        self.draft_hook: Optional[Callable[[Sequence, List[int]], List[int]]] = None
        self._token_texts: Dict[int, str] = {}  # token id -> its text alone (Logprob.decoded_token)
        self._parents: Dict[str, ParentRequest] = {}  # unfinished requests of several sequences
        # async scheduling: the last step's (SchedulerOutput, StepHandle) until its drafts are taken
        self._pending_drafts: Optional[Tuple[SchedulerOutput, Any]] = None
        # async scheduling at k = 0: the step in flight, whose tokens are applied after the next
        # step is launched (:meth:`_step_ahead`)
        self._inflight: Optional[_InFlight] = None
        self._ahead = scheduler_config.async_scheduling and k == 0
        # adaptive speculation length: picks each step's number of drafts (LLM sets it up)
        self.spec_policy: Optional[AdaptiveSpecPolicy] = None
        # with a policy: its k = 0 steps write no MTP KV entries, the next drafting step catches up
        # (speculative_config adaptive_defer_mtp_kv; LLM sets it with the policy)
        self.defer_mtp_kv = False
        self._stepped = False  # a step was applied (the policy does not time the first one: _time_step)
        # the step applied in this call, timed for the policy when the call returns (_observe_spec, _time_step)
        self._untimed: Optional[Tuple[SchedulerOutput, int, float]] = None
        # an error of a call that also returned finished requests, raised by the next call (_step_ahead)
        self._deferred_error: Optional[Exception] = None
        # a held choice: (steps left to propose it without asking, its bucket, its k)
        self._hold: Tuple[int, int, int] = (0, 0, 0)
        #: running mean (weight 1/20) of finished sequences' output lengths: how many tokens a request
        #: not ignoring EOS is expected to emit (:meth:`_catch_up_ahead`); None before the first
        self._mean_output_len: Optional[float] = None

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt: PromptType, params: SamplingParams,
                         add_special_tokens: bool = True) -> Tuple[Optional[str], List[int]]:
        """Check one request without queuing it; returns ``(prompt_text, prompt_token_ids)``.
        A text prompt is tokenized with the tokenizer's special tokens (``add_special_tokens``,
        vLLM's default for ``LLM.generate``: e.g. DeepSeek-V3's BOS) or without them.

        A prompt may have at most ``max_model_len - 1`` tokens; ``max_tokens`` is not checked
        against the context (generation stops at ``max_model_len`` with ``"length"``; the OpenAI
        server checks it and answers 400).

        Raises:
            ValueError / TypeError: empty prompt, prompt too long for the context, token id outside
            ``[0, vocab_size)``, a text prompt or stop strings without a tokenizer, wrong types, a
            sampling field set after construction to a bad value (:meth:`SamplingParams.check`),
            ``logprobs`` / ``prompt_logprobs`` above ``max_logprobs`` (``-1`` = the whole
            vocabulary), ``logit_bias`` or ``stop_token_ids`` ids outside the vocabulary (vLLM's
            messages for the first).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.check()  # a field set after construction (sp.temperature = -5) fails here, not in the sampler
        if isinstance(prompt, ValidatedPrompt):
            if prompt.params is params:
                return prompt.text, prompt.token_ids
            prompt = {"prompt_token_ids": prompt.token_ids} if prompt.text is None else \
                {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or not prompt:
                raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        else:
            raise TypeError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise TypeError(f"'prompt' must be a string, got {type(text).__name__}")
            if not text:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; the model folder has none (pass prompt_token_ids; "
                                 "CLI: --prompt-token-ids; HTTP: token ids as the 'prompt')")
            try:
                ids = self.tokenizer.encode(text, add_special_tokens)
            except TypeError:  # tokenizers' "TextInputSequence must be str": a lone surrogate, as JSON allows
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"the prompt is not valid Unicode text: a lone surrogate "
                                     f"U+{ord(text[exc.start]):04X} at character {exc.start}") from None
                raise
        if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
            raise TypeError("prompt_token_ids must be a list of ints")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, your request has "
                             f"{len(ids)} input tokens (at most max_model_len - 1 = {limit - 1}: the context must "
                             "also hold an output token). Please reduce the length of the input.")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model folder has none (use stop_token_ids, a "
                             "SamplingParams / request field; `mtpspec generate` has no flag for it)")
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            n = self._num_logprobs(getattr(params, name))
            if n is not None and exceeds_max_logprobs(n, self.max_logprobs):
                raise ValueError(f"Requested {what} logprobs of {n}, which is greater than max allowed: "
                                 f"{self.max_logprobs}")
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:  # never generated, so never a stop: the caller's mistake (the server's 400 says the same)
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                                 f"Vocabulary size: {self.vocab_size}")
        return text, list(ids)

    def validated_prompt(self, prompt: PromptType, params: SamplingParams,
                         add_special_tokens: bool = True) -> ValidatedPrompt:
        """:meth:`validate_request`, its result kept with ``params`` (see :class:`ValidatedPrompt`).

        Raises:
            ValueError / TypeError: as ``validate_request``.
        """
        text, ids = self.validate_request(prompt, params, add_special_tokens)
        return ValidatedPrompt(text, ids, params)

    def _num_logprobs(self, n: Optional[int]) -> Optional[int]:
        return self.vocab_size if n == -1 else n

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None) -> str:
        """Validate (:meth:`validate_request`) and queue one request; returns its id.

        A request with ``params.num_sequences > 1`` (``n > 1`` or ``best_of``) is queued as that
        many child sequences (:mod:`mtpspec.engine.parallel_sampling`); its output carries the
        request's id.
        """
        text, ids = self.validate_request(prompt, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        n = params.num_sequences
        new_ids = [rid] if n == 1 else [rid] + [child_request_id(rid, i) for i in range(n)]
        sched = self.scheduler  # the ranks key per-request state by id: two live requests must not share one
        live = {s.request_id for s in itertools.chain(sched.waiting, sched.running)} | set(self._parents)
        used = [x for x in new_ids if x in live]
        if used:
            raise ValueError(f"request id {used[0]!r} is already in use by an unfinished request")
        if n == 1:
            self.scheduler.add(self._sequence(rid, text, ids, params, arrival))
            return rid
        parent = ParentRequest(rid, params, arrival)
        for i in range(params.num_sequences):
            seq = self._sequence(child_request_id(rid, i), text, ids, parent.child_params(i), arrival)
            seq.parent = parent
            parent.children.append(seq)
        for seq in parent.children:
            self.scheduler.add(seq)
        self._parents[rid] = parent
        return rid

    def _sequence(self, rid: str, text: Optional[str], ids: List[int], params: SamplingParams,
                  arrival: float) -> Sequence:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        detok = None  # none: no text (detokenize=False, or no tokenizer); stop_checker then appends ids only
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return Sequence(rid, text, ids, params, seed_to_u64(seed), arrival, detok)

    def get_parent(self, request_id: str) -> Optional[ParentRequest]:
        """The unfinished request of several sequences with this id, else ``None``."""
        return self._parents.get(request_id)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a request (every child of one with several sequences); returns its output, or
        ``None`` when no unfinished request has this id."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for seq in parent.children:
                if not seq.is_finished:
                    self.scheduler.abort(seq.request_id)
            self._unpin_if_idle()
            return parent.to_output()
        seq = self.scheduler.abort(request_id)
        self._unpin_if_idle()
        return None if seq is None else seq.to_output()

    def _unpin_if_idle(self) -> None:
        """With nothing waiting, running or in flight, unpin the last step's block-copy sources
        (:meth:`BlockManager.release_pinned`; their copies ran). The scheduler unpins them when it
        schedules the next step, which an idle engine never does: an ``n > 1`` request aborted right
        after its siblings forked child 0 left that block in use while idle."""
        if not self.has_unfinished_requests():
            self.scheduler.block_manager.release_pinned()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ------------------------------------------------------------------ steps
    def _step_input(self, out: SchedulerOutput) -> StepInput:
        seqs = []
        for s in out.scheduled:
            seq, p = s.seq, s.seq.params
            si = SeqInput(s.input_token_ids, s.start_position, list(seq.block_table), s.is_prefill,
                          p.temperature, p.top_k, p.top_p, seq.seed_key, s.next_token_id)
            si.request_id = seq.request_id
            # a seeded request stays reproducible under adaptive speculation: argmax drafts (step_io.SeqInput)
            si.greedy_drafts = p.seed is not None and self.spec_policy is not None
            si.logprobs = self._num_logprobs(p.logprobs)
            if p.prompt_logprobs is not None and s.is_prefill:
                self._prompt_logprob_rows(s, si)
            si.logits_params = None if s.is_partial_prefill else self._logits_params(seq)
            # deferred MTP entries to catch up (a step scheduled ahead of one in flight: that step is
            # at k = 0, so it defers too and leaves mtp_len as it is)
            if self.defer_mtp_kv and out.num_proposed_tokens and seq.mtp_len < s.start_position:
                si.mtp_lag, si.mtp_lag_token_ids = sequence_lag(seq.mtp_len, s.start_position, seq.all_token_ids)
                self.metrics.spec.num_mtp_catch_up_tokens += si.mtp_lag
                out.num_catch_up_rows += si.mtp_lag
            seqs.append(si)
        return StepInput(seqs, next(self._step_id), list(out.block_copies), out.num_spec_tokens,
                         out.num_proposed_tokens, out.defers_mtp)

    def _prompt_logprob_rows(self, sch: ScheduledSeq, si: SeqInput) -> None:
        """Ask a prefill (chunk) to score the prompt positions it predicts that are not scored yet.

        Row ``i`` of a chunk starting at position ``s`` predicts position ``s + i + 1``; the
        prompt's positions ``1 .. P - 1`` are scored once, chunk after chunk. A preemption before
        they are all scored restarts them with the recomputed prefill (same values).
        """
        seq = sch.seq
        n_prompt = len(seq.prompt_token_ids)
        done = seq.prompt_logprobs
        if done is not None and len(done) >= n_prompt:
            return  # complete (a recompute after a preemption needs none)
        if done is None or sch.start_position != len(done) - 1:
            done = seq.prompt_logprobs = [None]  # first chunk, or a recompute from position 0
            if sch.start_position != 0:
                raise RuntimeError(f"{seq!r}: prompt logprobs would skip positions before {sch.start_position}")
        rows = min(len(sch.input_token_ids) + (1 if sch.is_partial_prefill else 0) - 1,
                   n_prompt - 1 - sch.start_position)
        if rows > 0:
            si.prompt_logprobs = self._num_logprobs(seq.params.prompt_logprobs)
            si.prompt_logprob_rows = rows

    def _logits_params(self, seq: Sequence) -> Optional[SeqLogitsParams]:
        """The sequence's logit edits for its next rows, or ``None`` when nothing applies."""
        p = seq.params
        remaining = max(0, p.min_tokens - len(seq.output_token_ids))
        if not (p.uses_penalties or p.logit_bias or remaining):
            return None
        lp = SeqLogitsParams(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        if p.uses_penalties:
            lp.output_token_ids = list(seq.output_token_ids)
            if p.repetition_penalty != 1.0:
                lp.prompt_token_ids = seq.distinct_prompt_token_ids
        if p.logit_bias:
            lp.logit_bias = sorted(p.logit_bias.items())
        if remaining:
            # vLLM's all_stop_token_ids: the EOS ids (also with ignore_eos) and the stop ids
            stop = set(self.eos_token_ids) | set(p.stop_token_ids or ())
            lp.suppressed_token_ids = sorted(t for t in stop if 0 <= t < self.vocab_size)
            lp.min_tokens_remaining = remaining
        return None if lp.is_noop else lp

    def step(self) -> List[RequestOutput]:
        """Schedule and run one step; returns the requests that finished in it (a request of
        several sequences once all of them did).

        With ``async_scheduling`` the step returns once its tokens are known, while its draft
        passes still run on the device; the next step is scheduled and sent to the ranks with
        :data:`~mtpspec.engine.scheduler.DRAFT_PENDING` drafts, which the ranks fill from the
        drafts they computed (no host wait between the steps), unless a decode needs its drafts
        on the host (:meth:`_drafts_stay_on_device`). Plain decoding and the adaptive
        speculation length leave every step in flight instead (:meth:`_step_ahead`). Same
        outputs either way.
        """
        self._untimed = None
        if self._deferred_error is not None:
            exc, self._deferred_error = self._deferred_error, None
            raise exc
        if self._ahead or self._inflight is not None or (
                self.spec_policy is not None and self.scheduler_config.async_scheduling):
            outs = self._step_ahead()
        else:
            outs = self._finished_outputs(self._step_sync())
        if self._untimed is not None:
            self._time_step()
        self._unpin_if_idle()
        return outs

    def _launch(self) -> Optional[Tuple[SchedulerOutput, Any, StepInput]]:
        """Schedule the next step after the last one's tokens are applied and launch it, with the
        last step's drafts taken on the host before (a decode needs them there) or after the launch
        (they stay on the device); ``None`` when nothing is scheduled."""
        out = self.scheduler.schedule()
        on_device = self._drafts_stay_on_device(out)
        if not on_device:
            self._take_drafts(out)
        self.metrics.num_preemptions += len(out.preempted)
        if out.is_empty:
            self._hold = (0, 0, 0)  # idle: the next run's first steps ask the policy (no hold carried over)
            return None
        self._choose_k(out)
        step = self._step_input(out)
        handle = self.executor.execute_async(step)
        if on_device:  # the host's copy of the last step's drafts, while this step runs
            self._take_drafts()
        return out, handle, step

    def _step_sync(self) -> List[Sequence]:
        """One step applied before the next is scheduled (its draft passes may still run); returns
        the sequences that finished."""
        t0 = time.perf_counter()
        launched = self._launch()
        if launched is None:
            return []
        out, handle, _ = launched
        return self._finish(out, handle, t0, time.perf_counter())

    def _choose_k(self, out: SchedulerOutput) -> None:
        """The adaptive policy's number of drafts for ``out`` to propose (if any policy). A
        pure-decode choice of ``k = 0`` outside an exploration burst (or a prompt step's, where the
        policy's pure-decode choice would be ``k = 0`` too:
        :meth:`~mtpspec.spec_decode.adaptive.AdaptiveSpecPolicy.k0_is_best`) is held for the
        policy's ``hold_k0_steps`` steps (the asked one included) while the batch stays in the
        choice's bucket (:meth:`~mtpspec.spec_decode.adaptive.AdaptiveSpecPolicy.bucket`; a
        policy without one: the same batch size), prompt steps among them; a pure-decode choice of
        a drafting ``k`` outside a burst, once measured at that bucket
        (:meth:`~mtpspec.spec_decode.adaptive.AdaptiveSpecPolicy.holds_draft`), for its
        ``hold_draft_steps`` pure-decode steps likewise (a prompt step, or waiting prompts under a
        prompt reserve, ask again). ``out.policy_held`` on the steps that did not ask
        (:mod:`mtpspec.spec_decode.adaptive`'s docstring)."""
        policy = self.spec_policy
        if policy is not None and out.num_proposed_tokens:
            left, held_key, held_k = self._hold
            if left > 0 and self._hold_key(len(out.scheduled)) == held_key and held_k <= out.num_proposed_tokens \
                    and (not held_k or not (out.num_prefill_tokens or (getattr(policy, "prompt_reserve", 0) > 0
                                                                       and self.scheduler.waiting))):
                self._hold = (left - 1, held_key, held_k)
                out.num_proposed_tokens, out.policy_held = held_k, True
                out.defers_mtp = self.defer_mtp_kv and held_k == 0
                return
            n_prompt = out.num_prefill_tokens
            # chunks that do not end their prompt: their drafts are dropped (a pure-decode step has
            # none: no O(batch) pass then)
            partial = sum(1 for s in out.scheduled if s.is_partial_prefill) if n_prompt else 0
            # prompt tokens left after this step (requests waiting, or a partial chunk): looked at
            # only when the policy keeps a reserve for them
            waiting = policy.prompt_reserve > 0 and (bool(self.scheduler.waiting) or partial > 0)
            # what a drafting step would catch up (built only if the policy's choice can depend on it)
            lags = functools.partial(self._catch_up_ahead, out) if self.defer_mtp_kv else ()
            out.num_proposed_tokens = k = policy.choose(len(out.scheduled), n_prompt, waiting,
                                                        self.scheduler_config.max_num_batched_tokens,
                                                        num_partial_prefills=partial, catch_up=lags)
            out.defers_mtp = self.defer_mtp_kv and k == 0
            hold = int(getattr(policy, "hold_k0_steps", 1))  # a policy without it is asked every step
            hold_draft = int(getattr(policy, "hold_draft_steps", 1))
            exploring = getattr(policy, "exploring", False)
            # a prompt step's k = 0 holds where the pure-decode choice would be k = 0 too (a run of
            # prompt steps, e.g. a wave of admissions, would otherwise ask at each)
            best0 = getattr(policy, "k0_is_best", None) if n_prompt else None
            # a drafting k is held only once measured at this bucket (a policy without holds_draft: always)
            measured = getattr(policy, "holds_draft", None) if k > 0 and hold_draft > 1 else None
            if k == 0 and hold > 1 and not exploring and (
                    not n_prompt or (best0 is not None and best0(len(out.scheduled)))):
                self._hold = (hold - 1, self._hold_key(len(out.scheduled)), 0)
            elif k > 0 and hold_draft > 1 and not exploring and not n_prompt and (
                    measured is None or measured(len(out.scheduled), k)):
                self._hold = (hold_draft - 1, self._hold_key(len(out.scheduled)), k)
            else:
                self._hold = (0, 0, 0)

    def _hold_key(self, batch: int) -> int:
        """What a held choice is kept for: the policy's bucket of ``batch`` (where it has
        ``bucket``), else ``batch`` itself."""
        bucket = getattr(self.spec_policy, "bucket", None)
        return batch if bucket is None else bucket(batch)

    def _catch_up_ahead(self, out: SchedulerOutput) -> List[Tuple[int, float]]:
        """``(rows, tokens left)`` of each sequence of ``out`` with deferred MTP entries: the entries
        a drafting step would write first (``start_position - mtp_len``, as :meth:`_step_input`
        computes them) and the tokens it is expected to emit still: what ``max_tokens`` and the
        model length leave, and unless it ignores EOS at most the mean output length of the
        requests finished so far (:attr:`_mean_output_len`) less what it emitted (at least 1)."""
        lags = []
        max_len, mean = self.scheduler_config.max_model_len, self._mean_output_len
        for s in out.scheduled:  # a hot loop (every prompt step): locals, no properties
            seq = s.seq
            lag = s.start_position - seq.mtp_len
            if lag > 0:
                p, done = seq.params, len(seq.output_token_ids)
                left = max_len - len(seq.prompt_token_ids) - done
                if p.max_tokens is not None and p.max_tokens - done < left:
                    left = p.max_tokens - done
                if mean is not None and not p.ignore_eos and mean - done < left:
                    left = mean - done
                lags.append((lag, float(left) if left > 1.0 else 1.0))
        return lags

    def _step_ahead(self) -> List[RequestOutput]:
        """Async scheduling for plain decoding (``k = 0``) and the adaptive speculation length:
        every step is left in flight when its call returns, so the caller's work between calls runs
        under it. The next call schedules and launches the next step while the one in flight runs,
        its decodes one position ahead with their newest token
        :data:`~mtpspec.engine.scheduler.TOKEN_PENDING` (each rank takes it from the step in
        flight on the device), then applies the step in flight's tokens; returns what finished in
        it. A decode that finishes there (EOS, a stop) had one row in the next step computed for
        nothing; that row is dropped. The step in flight is applied first, and the next one
        scheduled after it (:meth:`_launch`), when requests wait for admission and a sequence slot
        is free, when it held prefill chunks or preemptions, when a decode's logits depend on its
        output tokens (penalties, ``min_tokens``, ...: :meth:`_logits_params`), when a decode could
        not grow ahead or when it verified or proposed drafts (an adaptive step: the next one's
        rows depend on what it accepted). A step left holding only rows of requests that just
        finished is waited for and dropped. Same outputs either way (greedy and seeded; an aborted
        request may lose the tokens of the step in flight). A step is timed for the adaptive policy
        over the call that applies it (:meth:`_time_step`): one scheduling and launch in each step's
        time whichever way it went, the caller's time between calls in none."""
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        finished: List[Sequence] = []
        try:
            if prev is not None and not self._can_step_ahead(prev):
                finished = self._finish(prev.out, prev.handle, t0, t0, busy=False, launch_t0=prev.launch_t0)
                prev = None
            if prev is None and not self._ahead:  # adaptive: the next step after the tokens it builds on
                launched = self._launch()
                if launched is not None:
                    out, handle, step = launched
                    plain = all(not si.is_prefill and si.logits_params is None for si in step.seqs)
                    self._inflight = _InFlight(out, handle, plain, t0)
            else:
                out = self.scheduler.schedule(pending=[id(s.seq) for s in prev.out.scheduled] if prev else None)
                self.metrics.num_preemptions += len(out.preempted)
                t1 = time.perf_counter()
                if out.is_empty:
                    self._hold = (0, 0, 0)  # (as in _launch)
                else:
                    self._choose_k(out)  # adaptive: any k
                    step = self._step_input(out)
                    plain = all(not si.is_prefill and si.logits_params is None for si in step.seqs)
                    self._inflight = _InFlight(out, self.executor.execute_async(step), plain, t0)
                if prev is not None:
                    finished += self._finish(prev.out, prev.handle, t0, t1, busy=False, launch_t0=prev.launch_t0)
            if self._inflight is not None and all(s.seq.is_finished for s in self._inflight.out.scheduled):
                self._inflight.handle.output()  # only rows of requests that just finished: wait, drop, count nothing
                self._inflight = None
        except BaseException as exc:
            self._inflight = None  # a failed step leaves nothing in flight (a dead engine must not look busy)
            if not finished or not isinstance(exc, Exception):
                raise
            # the step applied here finished requests, then the next one failed to launch: they are
            # returned now, the error raised by the next call (as when they finished a call earlier)
            self._deferred_error = exc
        self.metrics.busy_time_s += time.perf_counter() - t0
        return self._finished_outputs(finished)

    def _can_step_ahead(self, prev: "_InFlight") -> bool:
        sched = self.scheduler  # waiting requests block it only while a sequence slot is free for them
        admit = bool(sched.waiting) and len(sched.running) < self.scheduler_config.max_num_seqs
        return (prev.plain and not prev.out.num_spec_tokens and not prev.out.num_proposed_tokens and not admit
                and not prev.out.preempted and not prev.out.needs_sync)

    def _finish(self, out: SchedulerOutput, handle: Any, t0: float, t1: Optional[float] = None,
                busy: bool = True, launch_t0: Optional[float] = None) -> List[Sequence]:
        """Wait for ``out``'s tokens and apply them (stops, metrics, log-probabilities); returns
        the sequences that finished. ``busy``: count ``t0`` .. now as engine busy time (the
        caller counts it otherwise: :meth:`_step_ahead`, whose steps overlap). ``launch_t0``: the
        start of the call that launched it (default ``t0``), where the first step's wall starts."""
        m = self.metrics
        t1 = t0 if t1 is None else t1
        result = handle.output()
        now = time.perf_counter()
        k = self.scheduler_config.num_speculative_tokens
        m.num_prompt_tokens += sum(len(s.input_token_ids) for s in out.scheduled if s.is_prefill)
        m.prefix_cache_queries += out.prefix_cache_queries
        m.prefix_cache_hits += out.prefix_cache_hits
        before = {id(s.seq): len(s.seq.output_token_ids) for s in out.scheduled}
        finished = self.scheduler.update_from_output(out, result.new_token_ids, None, now,
                                                     drafts_pending=bool(out.num_proposed_tokens))
        m.num_request_prompt_tokens += sum(len(s.seq.prompt_token_ids) for s in out.scheduled
                                           if s.is_prefill and not before[id(s.seq)] and s.seq.output_token_ids)
        if result.logprobs is not None or result.prompt_logprobs is not None:
            self._store_logprobs(out, result, before)
        if k:
            self._observe_spec(out, result, t0)
            # a step that proposed no drafts (adaptive k = 0) leaves none to take: update_from_output gave its
            # sequences [] already, and the next step need not walk its batch twice for them (H100, 2026-12-06:
            # adaptive k = 0 prompt steps at 64 sequences took ~0.4 ms more than plain decoding's)
            self._pending_drafts = (out, handle) if out.num_proposed_tokens else None
            if not self.scheduler_config.async_scheduling:
                self._take_drafts()
        m.num_output_tokens += sum(len(s.seq.output_token_ids) - before[id(s.seq)] for s in out.scheduled)
        m.num_steps += 1
        m.num_eager_fallbacks += result.num_eager_fallbacks
        m.add_comm(result.comm_bytes)
        m.add_step_wall(out.num_prefill_tokens > 0, out.num_proposed_tokens, t0 if launch_t0 is None else launch_t0,
                        now, len(out.scheduled), out.num_prefill_tokens,
                        out.num_spec_tokens if out.num_decode_tokens else 0, out.num_catch_up_rows)
        if busy:
            m.busy_time_s += now - t0
        if _LOG_STEPS:
            logger.warning("step %d: schedule %.2f ms, execute %.2f ms, update %.2f ms; %d prefill + %d decode tokens, "
                           "%d seqs", m.num_steps, (t1 - t0) * 1e3, (now - t1) * 1e3,
                           (time.perf_counter() - now) * 1e3, out.num_prefill_tokens, out.num_decode_tokens,
                           len(out.scheduled))
        for seq in finished:
            n = len(seq.output_token_ids)
            self._mean_output_len = n if self._mean_output_len is None else self._mean_output_len + (
                n - self._mean_output_len) / 20
            rm = seq.metrics
            if rm.ttft is not None:
                m.ttft_s.append(rm.ttft)
            m.itl_s.extend(rm.itl)
            if rm.tpot is not None:
                m.tpot_s.append(rm.tpot)
        return finished

    def _observe_spec(self, out: SchedulerOutput, result, t0: float) -> None:
        """Count a speculative step's drafts in the metrics (emitted accepted drafts only, see
        :meth:`Scheduler.update_from_output`) and feed the adaptive policy, if any: per-decode
        accepted counts (the verifier's: a stop inside the block is no rejection) now, and the
        step's wall time from ``t0`` (``time.perf_counter()`` seconds at the start of the call
        applying it) when the call returns (:meth:`_time_step`)."""
        m, v, policy = self.metrics, out.num_spec_tokens, self.spec_policy
        for i, sch in enumerate(out.scheduled if v else ()):
            if not sch.is_prefill:
                m.spec.observe(sch.num_accepted_tokens, v)
                if policy is not None:
                    policy.observe(v, len(result.new_token_ids[i]) - 1)
        m.spec.observe_step(out.num_proposed_tokens)
        if policy is not None:
            if out.policy_held:  # not timed for the policy, but a step of the run of its k (or a prompt step)
                held = getattr(policy, "observe_held_step", None)
                if held is not None:
                    held(out.num_prefill_tokens, out.num_proposed_tokens)
                self._stepped = True
            else:
                self._untimed = (out, sum(map(len, result.new_token_ids)), t0)
            policy.end_step()

    def _time_step(self) -> None:
        """Tell the adaptive policy what the step applied in this call took: from the start of the
        call to its end, host included (one step is applied per call); the first step is not timed.
        With async scheduling the call also scheduled and launched the next step (before applying
        this one's tokens or after), so each step's time holds one launch, and the caller's time
        between calls, which the device spends on the step in flight, none."""
        out, emitted, t0 = self._untimed
        self._untimed = None
        if self._stepped:
            self.spec_policy.observe_step_time(len(out.scheduled), out.num_proposed_tokens,
                                               (time.perf_counter() - t0) * 1e3, out.num_spec_tokens,
                                               out.num_prefill_tokens, emitted, num_catch_up_rows=out.num_catch_up_rows)
        self._stepped = True

    def _drafts_stay_on_device(self, out: SchedulerOutput) -> bool:
        """Whether ``out``'s decodes may read the last step's drafts on the ranks: async scheduling,
        no ``draft_hook`` (it edits drafts on the host) and no decode whose logits edits depend
        on its drafts (penalties count them; :func:`_logits_params`)."""
        if self._pending_drafts is None or not self.scheduler_config.async_scheduling or self.draft_hook is not None:
            return False
        return not any(not sch.is_prefill and self._logits_params(sch.seq) is not None for sch in out.scheduled)

    def _take_drafts(self, out: Optional[SchedulerOutput] = None) -> None:
        """Give the sequences of the last step their drafts (waiting for its draft passes), through
        ``draft_hook`` when set, and put them into the decodes of ``out`` (scheduled meanwhile with
        :data:`~mtpspec.engine.scheduler.DRAFT_PENDING` ids). Sequences that finished, were
        preempted or were a partial prefill chunk get none."""
        if self._pending_drafts is not None:
            prev, handle = self._pending_drafts
            self._pending_drafts = None
            drafts = handle.drafts()
            # its catch-up is done: what it took (a policy without observe_catch_up learns nothing from it)
            observe = getattr(self.spec_policy, "observe_catch_up", None) if prev.num_catch_up_rows else None
            if observe is not None:
                ms = handle.catch_up_ms()
                if ms is not None:
                    observe(prev.num_catch_up_rows, ms)
            for i, sch in enumerate(prev.scheduled):
                seq = sch.seq
                if seq.is_finished or seq.is_prefill or sch.is_partial_prefill:
                    continue
                d = list(drafts[i])
                seq.draft_token_ids = d if self.draft_hook is None or not d else self._checked_drafts(
                    self.draft_hook(seq, d), len(d))
        if out is not None:
            for sch in out.scheduled:
                if not sch.is_prefill:
                    if DRAFT_PENDING in sch.seq.draft_token_ids:
                        raise RuntimeError(f"{sch.seq!r} is scheduled with drafts that were never computed")
                    sch.input_token_ids[1:] = sch.seq.draft_token_ids[:len(sch.input_token_ids) - 1]
            out.rows_changed()

    def _finished_outputs(self, finished: List[Sequence]) -> List[RequestOutput]:
        """Outputs of the requests that finished: a plain sequence's own, a parent's once its last
        child finished."""
        outs = []
        for seq in finished:
            parent = seq.parent
            if parent is None:
                outs.append(seq.to_output())
            elif parent.is_finished and self._parents.pop(parent.request_id, None) is not None:
                outs.append(parent.to_output())
        return outs

    def _token_text(self, tid: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(tid)
        if text is None:
            text = self._token_texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text

    def _logprob_dict(self, token: int, lp: TokenLogprobs, decode: bool = True) -> Dict[int, Logprob]:
        """vLLM's layout: the chosen token first (its rank), then the top-N (ranks 1 .. N); each
        ``decoded_token`` ``None`` unless ``decode`` (the request's ``detokenize``)."""
        text = self._token_text if decode else lambda t: None
        d = {token: Logprob(lp.logprob, lp.rank, text(token))}
        for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            if t not in d:
                d[t] = Logprob(v, r, text(t))
        return d

    def _store_logprobs(self, out: SchedulerOutput, result: StepOutput, before: Dict[int, int]) -> None:
        """Attach the step's scores to the sequences: one per output token that was kept (tokens
        dropped after a stop lose theirs), the prompt's after its prefill."""
        for i, sch in enumerate(out.scheduled):
            seq = sch.seq
            if result.prompt_logprobs is not None and result.prompt_logprobs[i] is not None:
                # row j scored the token after it (a partial chunk's last row: the next chunk's first)
                toks = sch.input_token_ids[1:] + ([sch.next_token_id] if sch.is_partial_prefill else [])
                seq.prompt_logprobs.extend(self._logprob_dict(toks[j], lp, seq.params.detokenize)
                                           for j, lp in enumerate(result.prompt_logprobs[i]))
            if result.logprobs is None or result.logprobs[i] is None or seq.output_logprobs is None:
                continue
            new = seq.output_token_ids[before[id(seq)]:]
            for tok, lp in zip(new, result.logprobs[i]):
                seq.output_logprobs.append(self._logprob_dict(tok, lp, seq.params.detokenize))
                seq.cumulative_logprob += lp.logprob

    def _checked_drafts(self, drafts: List[int], k: int) -> List[int]:
        if len(drafts) != k or any(not 0 <= int(t) < self.vocab_size for t in drafts):
            raise ValueError(f"draft_hook must return {k} token ids in [0, {self.vocab_size}), got {drafts!r}")
        return [int(t) for t in drafts]

    def get_metrics(self) -> Dict[str, object]:
        """Totals (:class:`~mtpspec.spec_decode.metrics.EngineMetrics`) as a dict."""
        return self.metrics.as_dict()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no running request references (vLLM's
        ``reset_prefix_cache``); returns how many."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def reset_metrics(self) -> None:
        self._hold = (0, 0, 0)  # a measured run starts asking the adaptive policy, as after an idle spell
        k = self.scheduler_config.num_speculative_tokens
        self.metrics = EngineMetrics(spec=SpecDecodingStats(k) if k else None)
