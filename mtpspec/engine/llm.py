"""``LLM``: the offline-inference entry point (vLLM-like)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from mtpspec.config import SpeculativeConfig
from mtpspec.engine.arg_utils import (DEFAULT_MAX_MODEL_LEN, EngineArgs, check_bool,  # noqa: F401
                                      check_max_logprobs, drop_vllm_only_args, model_path_problem)
from mtpspec.engine.detokenizer import Tokenizer, load_tokenizer
from mtpspec.engine.executor import InProcessExecutor, make_executor
from mtpspec.engine.gc_heap import freeze_gc_heap, refreeze_gc_heap, release_gc_heap
from mtpspec.engine.generation_config import default_sampling_fields, generation_eos_token_ids, load_generation_config
from mtpspec.engine.llm_engine import LLMEngine, PromptType, ValidatedPrompt
from mtpspec.engine.worker import follower_loop
from mtpspec.outputs import RequestOutput
from mtpspec.sampling_params import SamplingParams


def _params_list(sampling_params: Any) -> List[SamplingParams]:
    """``sampling_params`` given as a sequence (one per prompt), checked to be one: a dict or a string
    would otherwise be iterated into its keys or characters.

    Raises:
        TypeError: not a ``SamplingParams`` nor a sequence of them.
    """
    if isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__iter__"):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(sampling_params).__name__}")
    return list(sampling_params)


def _refuse_lora_and_priority(lora_request: Any, priority: Optional[Sequence[int]]) -> None:
    """vLLM's per-request ``lora_request`` / ``priority``, refused unless they ask for nothing.

    Raises:
        ValueError: a LoRA request (a non-``None`` one, or a list holding one), or a ``priority`` other
            than 0 (vLLM refuses those too without ``scheduling_policy="priority"``).
    """
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(x is not None for x in loras):
        raise ValueError("lora_request: mtpspec does not serve LoRA adapters (no enable_lora); pass None")
    if priority is not None and any(p != 0 for p in priority):
        raise ValueError(f"priority {list(priority)!r}: mtpspec schedules first come, first served (vLLM's "
                         "default policy, which refuses a priority too); pass None or zeros")


def _unsupported(name: str, instead: str) -> Callable[..., Any]:
    """An ``LLM`` method of vLLM's that mtpspec does not have: it raises a ``ValueError`` naming
    itself and what to use instead (not an ``AttributeError``)."""
    def method(self: "LLM", *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"LLM.{name}() is not supported by mtpspec ({instead})")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"vLLM's ``LLM.{name}``, not supported.\n\nRaises:\n    ValueError: always ({instead})."
    return method


_POOLING = "a pooling model's API: mtpspec runs generative models only; use generate or chat"


class LLM:
    """Generate from a GLM-4.5-family checkpoint, optionally with MTP speculative decoding.

    Args:
        model: checkpoint folder (``config.json`` + safetensors; a tokenizer is used if present).
        tensor_parallel_size: ranks; > 1 spawns them (or, under ``torchrun`` with the same
            ``WORLD_SIZE``, uses the launched processes: call ``LLM`` and ``generate`` on every
            rank with the same arguments; rank 0 schedules, every rank returns the outputs).
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` or ``None`` (the checkpoint's).
        device: ``"cuda"`` / ``"cpu"``; default CUDA when present.
        speculative_config: ``None`` (plain decoding) or ``{"method": "mtp",
            "num_speculative_tokens": k, "use_local_argmax_reduction": bool}`` (all keys:
            :class:`~mtpspec.config.SpeculativeConfig`; ``"adaptive": true``: each step proposes
            ``0 .. k`` drafts by :mod:`mtpspec.spec_decode.adaptive`, its step costs timed on the
            ranks at start-up unless ``"adaptive_cost_table"`` names a file).
        fuse_allreduce_rmsnorm: MTP tail through the fused all-reduce + RMSNorm (default True).
        sequence_parallel: sequence-parallel MTP layer (tp > 1; default False).
        allreduce_backend: ``"nccl"`` (default) or ``"p2p"``: who serves the fused tail's
            all-reduce + RMSNorm on every rank (:class:`~mtpspec.config.ParallelConfig`; a no-op
            at tp 1; ``"p2p"`` needs CUDA, or CPU under ``TRITON_INTERPRET=1``).
        max_num_seqs, max_model_len (default: the model's ``max_position_embeddings``, at most
        8192), max_num_batched_tokens: scheduler limits (:class:`~mtpspec.engine.config.SchedulerConfig`).
        enable_chunked_prefill: split prompts into chunks that fill each step after the running
            decodes (default True, as vLLM V1); ``False``: every prompt in one step (then
            ``max_num_batched_tokens >= max_model_len``).
        long_prefill_token_threshold: most tokens of one prompt per step (0: no cap; needs chunking).
        async_scheduling: apply a step's tokens and schedule the next step while its draft passes
            run on the device (default True; the outputs are the same with it off).
        block_size, num_kv_blocks, gpu_memory_utilization, cpu_kv_cache_gib: KV cache
            (:class:`~mtpspec.engine.config.CacheConfig`).
        enable_prefix_caching: reuse the KV blocks of prefixes computed before (default True;
            outputs are the same with it off, :mod:`mtpspec.engine.block_manager`).
        kv_cache_dtype: ``"auto"`` (the model dtype, default) or ``"fp8"`` / ``"fp8_e4m3"``
            (vLLM's): E4M3 caches with a scale per layer (1.0), dequantised inside the attention
            kernels; twice the blocks for the same memory (:class:`~mtpspec.engine.config.CacheConfig`).
        tokenizer: a folder to load the tokenizer from, a :class:`Tokenizer`, or ``None`` (the model folder's).
        seed: engine seed: seeds the seeds of requests that give none (``None``: random).
        enforce_eager: never use CUDA graphs.
        graph_mode: override: ``"auto"`` (default: CUDA graphs for pure-decode steps on a GPU), ``"off"``, ``"cuda"``, or ``"static"`` (the graph path's padded static
            buffers without capture; for CPU tests). See :mod:`mtpspec.engine.forward`.
        load_format: ``"auto"`` (the checkpoint's weights) or ``"dummy"`` (random weights from
            ``config.json`` alone, as vLLM's ``load_format="dummy"``; for benchmarks).
        disable_shared_experts_fusion: keep MoE shared experts as their own MLP (default: fused
            into the routed experts' kernels, :class:`~mtpspec.engine.arg_utils.EngineArgs`).
        trust_remote_code: vLLM's argument, accepted and unused (mtpspec's architectures are its own
            classes: no code from a checkpoint is ever run).
        generation_config: ``"auto"`` (the model folder's ``generation_config.json``: its EOS ids end
            requests, its sampling settings are :meth:`get_default_sampling_params`), ``"vllm"``
            (its EOS ids only) or a folder holding one (:mod:`mtpspec.engine.generation_config`).
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for per token
            (default 20, vLLM's; ``-1``: no cap).
        **vllm_args: vLLM's arguments that mtpspec does not implement
            (:data:`~mtpspec.engine.arg_utils.VLLM_ONLY_ARGS`: ``revision``, ``quantization``,
            ``enable_lora``, ``pipeline_parallel_size``, ``swap_space``, ``cpu_offload_gb``, ...),
            accepted and ignored at vLLM's default (``pipeline_parallel_size=1``, ``quantization=None``,
            ...); ``disable_log_stats`` either way (mtpspec logs no periodic stats).

    Raises:
        TypeError: a vLLM argument of ``vllm_args`` set to anything but its default (naming it and what
            mtpspec does instead), or an unknown keyword argument.
        ValueError / TypeError: a bad argument (k out of range, unknown speculative keys, a
            ``max_model_len`` above the model's positions, a ``device`` other than ``"cpu"`` /
            ``"cuda"`` / ``"cuda:N"``, or ``"cuda"`` on a machine without CUDA, a flag
            (``enforce_eager``, ``enable_prefix_caching``, ``trust_remote_code``, ...) that is not a
            bool (numpy bools are accepted), an
            ``allreduce_backend`` other than ``"nccl"`` / ``"p2p"`` (the message lists them),
            ``"p2p"`` at tp > 1 on CPU without ``TRITON_INTERPRET=1`` (before any rank starts; at
            tp 1 ``"p2p"`` is a no-op), a ``seed`` that is not an int, a ``tokenizer`` folder holding no
            tokenizer, ...). Spawned ranks that cannot set up ``"p2p"`` (e.g. no
            Triton, peer memory refused) fail with WorkerError carrying the rank's message.
        LocalArgmaxUnsupportedError (tp 1) or WorkerError (tp > 1, with the same message):
            ``use_local_argmax_reduction`` requested from a draft model without ``get_top_tokens``;
            the message names the model class.
        FileNotFoundError: ``model`` is no folder with a ``config.json`` (a Hugging Face Hub id: the
            message says to download it first; mtpspec loads local folders only).
        ModelConfigError / CheckpointError: see :mod:`mtpspec.models.loader` (a checkpoint is read
            by the ranks: at tp > 1 a WorkerInputError, also a ValueError, with the rank's message).
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype: Optional[str] = None,
                 device: Optional[str] = None,
                 speculative_config: Union[None, Dict[str, Any], SpeculativeConfig] = None,
                 fuse_allreduce_rmsnorm: bool = True, sequence_parallel: bool = False, allreduce_backend: str = "nccl",
                 max_num_seqs: int = 256,
                 max_model_len: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 async_scheduling: bool = True, block_size: Optional[int] = None, num_kv_blocks: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 cpu_kv_cache_gib: float = 1.0, enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                 tokenizer: Union[None, str, Tokenizer] = None,
                 seed: Optional[int] = None, enforce_eager: bool = False, graph_mode: Optional[str] = None,
                 load_format: str = "auto", disable_shared_experts_fusion: bool = False,
                 generation_config: str = "auto", trust_remote_code: bool = False, max_logprobs: int = 20,
                 **vllm_args: Any):
        drop_vllm_only_args(vllm_args)  # vLLM's pipeline_parallel_size=1, quantization=None, ...: nothing to do
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint folder (a path), got {type(model).__name__} "
                            "(the bundled demo model: mtpspec.demo_model_path())")
        check_bool(trust_remote_code, "trust_remote_code")  # vLLM's argument, accepted: mtpspec runs no checkpoint code
        why = model_path_problem(os.fspath(model), arg="model")
        if why is not None:  # e.g. a Hub id: say so, not only "no config.json"
            raise FileNotFoundError(why)
        check_max_logprobs(max_logprobs)
        args = EngineArgs(
            model=model, tensor_parallel_size=tensor_parallel_size, speculative_config=speculative_config,
            fuse_allreduce_rmsnorm=fuse_allreduce_rmsnorm, sequence_parallel=sequence_parallel,
            allreduce_backend=allreduce_backend, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold, async_scheduling=async_scheduling,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, cpu_kv_cache_gib=cpu_kv_cache_gib,
            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
            device=device, enforce_eager=enforce_eager, graph_mode=graph_mode, seed=seed, load_format=load_format,
            disable_shared_experts_fusion=disable_shared_experts_fusion, generation_config=generation_config)
        config = args.create_engine_config()
        self.engine_config = config
        self.model_config = mcfg = config.model_config
        self.speculative_config = config.speculative_config
        self.parallel_config = config.parallel_config
        sched, cache = config.scheduler_config, config.cache_config
        if isinstance(tokenizer, Tokenizer):
            tok: Optional[Tokenizer] = tokenizer
        else:
            tok = load_tokenizer(tokenizer or model)
            if tokenizer is not None and tok is None:  # a path given is a path that must hold one (vLLM fails too)
                raise ValueError(f"tokenizer={tokenizer!r}: no tokenizer there (expected a folder with "
                                 "tokenizer.json or tokenizer_config.json)")
        gen = load_generation_config(config.model, generation_config)  # a bad file fails before any model loads
        gen_eos = generation_eos_token_ids(gen)
        #: ``SamplingParams`` fields the model's generation_config.json sets (``generation_config``)
        self.default_sampling_fields: Dict[str, Any] = default_sampling_fields(gen, generation_config)
        try:
            SamplingParams(**self.default_sampling_fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"generation_config.json of {config.model!r}: {exc} (--generation-config vllm ignores "
                             "the file)") from None
        spec = config.speculative_config
        costs = None
        if spec is not None and spec.adaptive_cost_table:  # a bad file fails before any model loads
            from mtpspec.spec_decode.adaptive import AdaptiveSpecPolicy, StepCostTable
            costs = StepCostTable.load(spec.adaptive_cost_table)
            try:
                AdaptiveSpecPolicy(spec.num_speculative_tokens, costs)
            except ValueError as exc:
                raise ValueError(f"adaptive_cost_table {spec.adaptive_cost_table!r}: {exc}") from None
        self.executor = make_executor(config)
        try:  # a failure (or Ctrl-C) from here on must not leave the ranks running
            self._torchrun = isinstance(self.executor, InProcessExecutor) and self.executor.broadcast
            self._rank = int(os.environ.get("RANK", "0")) if self._torchrun else 0
            eos = set(mcfg.eos_token_ids) | gen_eos
            if tok is not None and tok.eos_token_id is not None:
                eos.add(int(tok.eos_token_id))
            self.llm_engine = LLMEngine(self.executor, tok, sched, cache, mcfg.vocab_size, eos, config.seed,
                                        max_logprobs=max_logprobs)
            # every start-up object out of the cyclic collector's passes (mtpspec.engine.gc_heap), before
            # the adaptive policy's timing (a pass over the heap inside a timed step would skew its table)
            self._gc_frozen = freeze_gc_heap()
            if spec is not None and spec.adaptive:
                from mtpspec.spec_decode.adaptive import (HOLD_DRAFT_STEPS, HOLD_K0_STEPS, SWITCH_MARGIN,
                                                          AdaptiveSpecPolicy, measure_step_costs)
                if costs is None:  # timed on every rank alike (the units hold collectives); rank 0's figures
                    print(f"adaptive speculation: timing the step-cost table (batch sizes up to {sched.max_num_seqs}, "
                          "k = 0.." + str(spec.num_speculative_tokens) + "; on a CPU this takes a minute or more: a "
                          "saved one is reused with speculative_config adaptive_cost_table, docs/serving.md) ...",
                          file=sys.stderr, flush=True)
                    t_cal = time.perf_counter()
                    costs = self.executor.collective_rpc(measure_step_costs)[0]
                    print(f"adaptive speculation: step-cost table timed in {time.perf_counter() - t_cal:.1f} s",
                          file=sys.stderr, flush=True)
                self.llm_engine.spec_policy = AdaptiveSpecPolicy(
                    spec.num_speculative_tokens, costs, prompt_reserve=float(spec.adaptive_prompt_reserve),
                    hold_k0_steps=spec.adaptive_hold_k0_steps or HOLD_K0_STEPS,
                    hold_draft_steps=spec.adaptive_hold_draft_steps or HOLD_DRAFT_STEPS,
                    switch_margin=SWITCH_MARGIN if spec.adaptive_switch_margin is None
                    else float(spec.adaptive_switch_margin),
                    trace=[] if os.environ.get("MTPSPEC_ADAPTIVE_TRACE", "") not in ("", "0") else None)
                self.llm_engine.defer_mtp_kv = spec.defers_mtp_kv
                if max(costs.verify_ms[0]) < sched.max_num_seqs:  # a table timed for fewer sequences
                    print(f"adaptive speculation: warning: the step-cost table ({costs.source}) goes up to batch "
                          f"{max(costs.verify_ms[0])} but max_num_seqs is {sched.max_num_seqs}: larger batches are "
                          "priced at its largest; time one at this max_num_seqs (adaptive_cost_table null, or "
                          "benchmarks/calibrate_spec_costs.py)", file=sys.stderr)
                for b in sorted(costs.verify_ms[0]):  # what the policy will weigh, once, in the log
                    print(f"adaptive speculation: batch {b}: step ms for k = 0..: "
                          + ", ".join(f"{costs.step_ms(b, j):.3f}" for j in costs.ks) + f" ({costs.source})",
                          file=sys.stderr)
                if spec.defers_mtp_kv:  # what a drafting step pays per entry its k = 0 steps deferred
                    print(f"adaptive speculation: catch-up of a deferred MTP entry: "
                          f"{1e3 * costs.catch_up_ms_per_row:.2f} us"
                          + ("" if costs.catch_up_ms_per_row else " (not in this table: not charged)"), file=sys.stderr)
        except BaseException:
            # (under torchrun every process is a rank and fails here alike: no stop message to send)
            if not (isinstance(self.executor, InProcessExecutor) and self.executor.broadcast):
                self.executor.shutdown()
            if getattr(self, "_gc_frozen", False):
                self._gc_frozen = False
                release_gc_heap()
            raise

    # ------------------------------------------------------------------ API
    def get_tokenizer(self) -> Optional[Tokenizer]:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the fields the model's ``generation_config.json`` sets
        (:mod:`mtpspec.engine.generation_config`; none with ``generation_config="vllm"``): what
        :meth:`generate` uses without sampling params (vLLM's method of that name)."""
        return SamplingParams(**self.default_sampling_fields)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: Union[bool, Callable[..., Any]] = True, lora_request: Any = None,
                 priority: Optional[Sequence[int]] = None) -> List[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Args:
            prompts: a string, ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``, or a list of them.
            sampling_params: one for all prompts, one per prompt, or ``None`` (defaults).
            use_tqdm: show a progress bar (stderr) over finished requests; a callable (vLLM's) is
                the bar's class, called as ``tqdm`` is.
            lora_request, priority: vLLM's; only ``None`` (and priorities of 0) are accepted.

        ``SamplingParams(n=..., best_of=...)``: each output holds ``n`` completions (``index``
        0 .. n - 1; see :mod:`mtpspec.engine.parallel_sampling`).

        Context length (vLLM's offline rules): a prompt must leave room for one token (at most
        ``max_model_len - 1`` tokens); prompt + ``max_tokens`` beyond ``max_model_len`` is not an
        error: the request stops at the end of the context with ``finish_reason == "length"``
        (the OpenAI server answers such a request with a 400 instead).

        Raises:
            ValueError / TypeError: a bad prompt (e.g. ``max_model_len`` tokens or more) or
                parameter, a ``lora_request`` or a ``priority`` other than 0, raised before any work
                starts and naming the prompt's index; nothing is queued, so other requests are unaffected.
        """
        _refuse_lora_and_priority(lora_request, priority)
        refreeze_gc_heap()  # after another engine's shutdown: this one's objects out of the collector's passes again
        single = isinstance(prompts, (str, dict, ValidatedPrompt))
        if not single and (isinstance(prompts, bytes) or not hasattr(prompts, "__iter__")):
            raise TypeError(f"prompts must be a string, a {{'prompt_token_ids': [...]}} / {{'prompt': ...}} dict or a "
                            f"list of them, got {type(prompts).__name__}")
        plist = [prompts] if single else list(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(plist)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = _params_list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling params for {len(plist)} prompts")
        eng = self.llm_engine
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                plist[i] = eng.validated_prompt(p, sp)  # tokenized once: add_request does not again
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        if self._torchrun and self._rank != 0:
            return follower_loop(self.executor.runner, self.executor.group)
        ids = [eng.add_request(p, sp) for p, sp in zip(plist, params)]
        wanted = set(ids)
        done: Dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(plist) > 1:
            from tqdm import tqdm
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(plist), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in eng.step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not eng.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("engine has no work left but requests are unfinished")
        except BaseException:
            for rid in ids:
                if rid not in done:
                    eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [done[r] for r in ids]
        if self._torchrun:
            self.executor.finish_call(outputs)
        return outputs

    def chat(self, messages: Union[Sequence[Dict[str, Any]], Sequence[Sequence[Dict[str, Any]]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: Union[bool, Callable[..., Any]] = True,
             add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[Dict[str, Any]] = None,
             chat_template: Optional[str] = None,
             continue_final_message: bool = False,
             tools: Optional[List[Dict[str, Any]]] = None, lora_request: Any = None) -> List[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages, oldest
        first) or a list of conversations, rendered as the OpenAI server renders them (the
        tokenizer's chat template, with ``chat_template_kwargs`` as more template variables, e.g.
        ``{"enable_thinking": False}``, or ``chat_template``, a Jinja template used instead of it;
        else the plain ``Question:`` / ``Answer:`` template, whose stop string ``"Question:"`` is
        added to the sampling params), tokenized without special tokens (the template writes its
        own), then :meth:`generate`.

        ``content``: a string, a list of ``{"type": "text", "text": ...}`` parts (joined with newlines,
        as vLLM joins them) or ``None`` (empty); a message's other fields (``name``, ``tool_calls``
        with their ``arguments`` parsed as vLLM parses them, ...) reach the template.
        ``chat_template``: a template, or a file holding one. ``continue_final_message``: leave the
        last message (usually the assistant's) open for the model to go on with it (needs
        ``add_generation_prompt=False``, as in vLLM). ``tools``: OpenAI tool definitions for the
        template's ``tools`` variable (vLLM's; the plain template ignores them; tool calls in the
        output are returned as text, not parsed).

        Raises:
            ValueError / TypeError: no tokenizer, an empty conversation, a message that is not a
                dict with a ``role`` and text ``content`` (named by conversation and message index),
                an unknown role, ``continue_final_message`` with ``add_generation_prompt``, a malformed
                ``tool_calls`` entry, ``tools`` not a list of objects, ``chat_template_kwargs`` setting
                what the renderer sets, the
                template refusing the conversation, a ``lora_request``, the plain template (whose stop
                string needs text) with ``detokenize=False``, or as :meth:`generate`.
        """
        from dataclasses import replace

        _refuse_lora_and_priority(lora_request, None)
        from mtpspec.entrypoints.chat_template import (check_continue_final, check_template_kwargs,
                                                       load_chat_template, render_chat, text_messages)
        check_template_kwargs(chat_template_kwargs)  # a bad one (or pair of flags) is no conversation's fault
        check_continue_final(add_generation_prompt, continue_final_message)
        if chat_template is not None:  # a file or the template (as given: no escapes decoded)
            chat_template = load_chat_template(chat_template, "chat_template", decode_escapes=False)
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer; the model folder has none")
        if isinstance(messages, (str, bytes, dict)):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts (one conversation) or a list of "
                            f"such lists, got {type(messages).__name__}")
        messages = list(messages)  # any iterable of messages or conversations
        single = not messages or isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            base = [sampling_params or self.get_default_sampling_params()] * len(convs)
        else:
            base = _params_list(sampling_params)
            if len(base) != len(convs):
                raise ValueError(f"got {len(base)} sampling params for {len(convs)} conversations")
        prompts, params = [], []
        for i, (conv, sp) in enumerate(zip(convs, base)):
            try:
                pairs = text_messages(conv)
            except TypeError as exc:
                raise TypeError(f"conversation {i}, {exc}") from None
            try:
                text, stops = render_chat(tok, pairs, add_generation_prompt, chat_template_kwargs, chat_template,
                                           continue_final_message, tools)
            except ValueError as exc:
                raise ValueError(f"conversation {i}: {exc}") from None
            have = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
            extra = [s for s in stops if s not in have]
            if extra and not sp.detokenize:
                raise ValueError(f"conversation {i}: the plain Question: / Answer: template (the tokenizer has no chat "
                                 f"template) ends answers at the stop string {extra[0]!r}, and stop strings need "
                                 "detokenize=True (or pass chat_template=...)")
            params.append(replace(sp, stop=have + extra) if extra else sp)
            try:  # the template writes its own special tokens (BOS): none added, as vLLM's chat
                prompts.append(self.llm_engine.validated_prompt(text, params[-1], add_special_tokens=False))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"conversation {i}: {exc}") from None
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    encode = _unsupported("encode", _POOLING)
    embed = _unsupported("embed", _POOLING)
    classify = _unsupported("classify", _POOLING)
    score = _unsupported("score", _POOLING)
    reward = _unsupported("reward", _POOLING)
    beam_search = _unsupported("beam_search", "sample several completions with SamplingParams(n=..., best_of=...)")

    def get_metrics(self) -> Dict[str, object]:
        """Engine totals: acceptance counters, throughput, TTFT / ITL, eager fall-backs, bytes per step.

        A dict, not vLLM's list of ``Metric`` objects: vLLM's ``vllm:spec_decode_num_drafts`` /
        ``_num_draft_tokens`` / ``_num_accepted_tokens`` (counters) and
        ``_num_accepted_tokens_per_pos`` (a vector) are ``m["num_drafts"]``,
        ``m["num_draft_tokens"]``, ``m["num_accepted_tokens"]`` and ``m["num_accepted_tokens_per_pos"]``
        (absent without speculative decoding); ``m["acceptance_length"]`` is vLLM's mean
        acceptance length, ``1 + accepted / drafts``."""
        return self.llm_engine.get_metrics()

    def reset_metrics(self) -> None:
        self.llm_engine.reset_metrics()

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block no running request references; returns how many."""
        return self.llm_engine.reset_prefix_cache()

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        """Run the picklable ``fn(model_runner, *args)`` on every rank; results in rank order."""
        return self.executor.collective_rpc(fn, *args)

    def shutdown(self) -> None:
        """Stop the ranks (idempotent)."""
        ex = getattr(self, "executor", None)
        if ex is not None:
            ex.shutdown()
        if getattr(self, "_gc_frozen", False):
            self._gc_frozen = False
            release_gc_heap()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_torchrun", False) and getattr(self, "_rank", 0) != 0:
            return  # a follower would wait for rank 0's stop; explicit shutdown() does that
        try:
            self.shutdown()
        except Exception:
            pass
