"""The engine loop on rank 0: requests in, steps out (scheduler + executor + bookkeeping)."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

from mtpspec.engine.block_manager import BlockManager
from mtpspec.engine.config import CacheConfig, SchedulerConfig
from mtpspec.sample.counter_rng import seed_to_u64
from mtpspec.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from mtpspec.engine.executor import Executor
from mtpspec.engine.scheduler import Scheduler, SchedulerOutput
from mtpspec.engine.sequence import Sequence
from mtpspec.step_io import SeqInput, StepInput
from mtpspec.outputs import RequestOutput
from mtpspec.sampling_params import SamplingParams
from mtpspec.spec_decode.metrics import EngineMetrics, SpecDecodingStats

PromptType = Union[str, Dict[str, Any]]


class LLMEngine:
    """Validates and queues requests, runs steps, returns finished outputs.

    Args:
        executor: runs steps on the ranks.
        tokenizer: for text prompts, detokenization and stop strings (``None``: token ids only).
        scheduler_config, cache_config: limits and block size.
        vocab_size: the model's vocabulary size (prompt ids must be below it).
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        seed: seeds the per-request seeds of requests that give none (``None``: random).

    Raises:
        ValueError: the KV cache cannot hold even one sequence of ``max_model_len`` tokens.
    """

    def __init__(self, executor: Executor, tokenizer: Optional[Tokenizer], scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, vocab_size: int, eos_token_ids: Collection[int],
                 seed: Optional[int] = None):
        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        bm = BlockManager(executor.num_kv_blocks, cache_config.block_size)
        need = bm.blocks_for(scheduler_config.decode_slots(scheduler_config.max_model_len)) + bm.watermark_blocks
        if need > bm.num_blocks:
            raise ValueError(
                f"the KV cache ({bm.num_blocks} blocks of {cache_config.block_size} tokens) cannot hold one sequence "
                f"of max_model_len={scheduler_config.max_model_len} tokens plus lookahead ({need} blocks needed); "
                "lower max_model_len or give the cache more memory (num_kv_blocks / gpu_memory_utilization)")
        self.scheduler = Scheduler(scheduler_config, bm, self.eos_token_ids)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._step_id = itertools.count()
        k = scheduler_config.num_speculative_tokens
        self.metrics = EngineMetrics(spec=SpecDecodingStats(k) if k else None)
        # Optional hook (analysis / tests / benchmarks): ``hook(seq, proposed_drafts) -> drafts``
        # replaces the drafts a sequence will verify next step (k ints in [0, vocab)).
        self.draft_hook: Optional[Callable[[Sequence, List[int]], List[int]]] = None

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt: PromptType, params: SamplingParams) -> Tuple[Optional[str], List[int]]:
        """Check one request without queuing it; returns ``(prompt_text, prompt_token_ids)``.

        A prompt may have at most ``max_model_len - 1`` tokens; ``max_tokens`` is not checked
        against the context (generation stops at ``max_model_len`` with ``"length"``; the OpenAI
        server checks it and answers 400).

        Raises:
            ValueError / TypeError: empty prompt, prompt too long for the context, token id outside
            ``[0, vocab_size)``, a text prompt or stop strings without a tokenizer, wrong types.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
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
                raise ValueError("text prompts need a tokenizer; the model folder has none (pass prompt_token_ids)")
            ids = self.tokenizer.encode(text)
        if not isinstance(ids, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise TypeError("prompt_token_ids must be a list of ints")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds max_model_len={limit}, "
                             "so a prompt may have at most max_model_len - 1 tokens")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model folder has none (use stop_token_ids)")
        return text, list(ids)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None) -> str:
        """Validate (:meth:`validate_request`) and queue one request; returns its id."""
        text, ids = self.validate_request(prompt, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
        seq = Sequence(rid, text, ids, params, seed_to_u64(seed),
                       time.perf_counter() if arrival_time is None else arrival_time, detok)
        self.scheduler.add(seq)
        return rid

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else seq.to_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ steps
    def _step_input(self, out: SchedulerOutput) -> StepInput:
        seqs = []
        for s in out.scheduled:
            p = s.seq.params
            seqs.append(SeqInput(s.input_token_ids, s.start_position, list(s.seq.block_table), s.is_prefill,
                                 p.temperature, p.top_k, p.top_p, s.seq.seed_key, s.next_token_id))
        return StepInput(seqs, next(self._step_id))

    def step(self) -> List[RequestOutput]:
        """Schedule and run one step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        m = self.metrics
        m.num_preemptions += len(out.preempted)
        if out.is_empty:
            return []
        result = self.executor.execute(self._step_input(out))
        now = time.perf_counter()
        k = self.scheduler_config.num_speculative_tokens
        m.num_prompt_tokens += sum(len(s.input_token_ids) for s in out.scheduled if s.is_prefill)
        before = {id(s.seq): len(s.seq.output_token_ids) for s in out.scheduled}
        finished = self.scheduler.update_from_output(out, result.new_token_ids, result.draft_token_ids if k else None,
                                                     now)
        if k:  # emitted accepted drafts only (see Scheduler.update_from_output)
            for sch in out.scheduled:
                if not sch.is_prefill:
                    m.spec.observe(sch.num_accepted_tokens)
        if self.draft_hook is not None and k:
            for sch in out.scheduled:
                if not sch.seq.is_finished and not sch.is_partial_prefill:
                    sch.seq.draft_token_ids = self._checked_drafts(self.draft_hook(sch.seq, list(sch.seq.draft_token_ids)))
        m.num_output_tokens += sum(len(s.seq.output_token_ids) - before[id(s.seq)] for s in out.scheduled)
        m.num_steps += 1
        m.num_eager_fallbacks += result.num_eager_fallbacks
        m.add_comm(result.comm_bytes)
        m.busy_time_s += now - t0
        for seq in finished:
            rm = seq.metrics
            if rm.ttft is not None:
                m.ttft_s.append(rm.ttft)
            m.itl_s.extend(rm.itl)
            if rm.tpot is not None:
                m.tpot_s.append(rm.tpot)
        return [s.to_output() for s in finished]

    def _checked_drafts(self, drafts: List[int]) -> List[int]:
        k = self.scheduler_config.num_speculative_tokens
        if len(drafts) != k or any(not 0 <= int(t) < self.vocab_size for t in drafts):
            raise ValueError(f"draft_hook must return {k} token ids in [0, {self.vocab_size}), got {drafts!r}")
        return [int(t) for t in drafts]

    def get_metrics(self) -> Dict[str, object]:
        """Totals (:class:`~mtpspec.spec_decode.metrics.EngineMetrics`) as a dict."""
        return self.metrics.as_dict()

    def reset_metrics(self) -> None:
        k = self.scheduler_config.num_speculative_tokens
        self.metrics = EngineMetrics(spec=SpecDecodingStats(k) if k else None)
