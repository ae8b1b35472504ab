"""``EngineArgs``: the engine's arguments, one set for ``LLM(...)`` and every command (vLLM's
``vllm/engine/arg_utils.py``).

``mtpspec generate``, ``serve``, ``eval gsm8k --model`` (and ``bench arms``' ``--server-args``,
which are ``serve`` flags) take these flags through :meth:`EngineArgs.add_cli_args` and read
them back with :meth:`EngineArgs.from_cli_args`; ``LLM(...)`` builds an ``EngineArgs`` from its
keyword arguments; :meth:`EngineArgs.create_engine_config` validates everything and returns the
one :class:`~mtpspec.engine.config.EngineConfig` that goes to the ranks.

Primary spellings are vLLM's; today's short flags stay as aliases:

====================================  ============================  ==========  ==========================================
flag (vLLM spelling)                  aliases                       default     meaning
====================================  ============================  ==========  ==========================================
``--model``                                                         demo model  checkpoint folder
``--tensor-parallel-size``            ``-tp``, ``--tp``             1           tensor-parallel ranks
``--speculative-config JSON``                                       none        ``{"method": "mtp", "num_speculative_tokens":
                                                                                k, "use_local_argmax_reduction": bool}``
``--num-speculative-tokens``          ``-k``                        3           shorthand: k (0 = no speculation), [0, 16]
``--no-local-argmax``                                               off         shorthand: ``use_local_argmax_reduction`` false
``--adaptive-speculation``                                          off         shorthand: ``"adaptive": true`` (each step
                                                                                proposes the best k in 0..k; mtpspec's own)
``--no-fusion``                                                     off         MTP tail: all-reduce, then RMSNorm
``--sequence-parallel``                                             off         sequence-parallel MTP layer (tp > 1)
``--allreduce-backend``                                             nccl        fused tail's backend: nccl | p2p
``--max-model-len``                                                 model's     tokens per sequence (at most 8192 default;
                                                                                4k = 4,000, 4K = 4,096 as vLLM)
``--max-num-seqs``                                                  64          sequences per step
``--max-num-batched-tokens``                                        derived     new tokens per step
``--enable-chunked-prefill``                                        on          split prompts to fill each step's budget;
                                                                                off: ``--no-enable-chunked-prefill``
``--long-prefill-token-threshold``                                  0           most tokens of one prompt per step (0: no cap)
``--enable-prefix-caching``                                         on          reuse cached KV blocks of shared prefixes;
                                                                                off: ``--no-enable-prefix-caching``
``--gpu-memory-utilization``                                        0.9         GPU memory fraction for the engine
``--block-size``                                                    arch's      tokens per KV block (16; MLA: 64)
``--num-kv-blocks``                   ``--num-gpu-blocks-override`` sized       KV blocks per layer (skip profiling)
``--kv-cache-dtype``                                                auto        cache storage: auto (model dtype) | fp8 |
                                                                                fp8_e4m3 (E4M3, scale 1.0 per layer)
``--dtype``                                                         auto        auto (the checkpoint's) / float32 /
                                                                                bfloat16 / float16
``--generation-config``                                             auto        auto (the model's
                                                                                generation_config.json: EOS ids,
                                                                                sampling defaults) | vllm (EOS
                                                                                ids only) | FOLDER
``--tokenizer``                                                     model's     a folder holding the tokenizer
``--max-logprobs``                                                  20          most logprobs a request may ask for
                                                                                per token (-1: no cap)
``--device``                                                        cuda if any cpu / cuda / cuda:N
``--enforce-eager``                                                 off         never use CUDA graphs
``--seed``                                                          0           engine seed: seeds requests without one
``--trust-remote-code``                                             off         accepted, changes nothing (no
                                                                                checkpoint code is ever run)
====================================  ============================  ==========  ==========================================

How the shorthand flags combine with ``--speculative-config``: the JSON is read as vLLM reads it
(absent keys take :class:`~mtpspec.config.SpeculativeConfig`'s defaults: k 1, local argmax
off). ``-k N`` (N >= 1) and ``--no-local-argmax`` fill in or agree with the JSON; a shorthand that
contradicts a key the JSON sets (``-k 2`` with ``"num_speculative_tokens": 3``, ``-k 0`` with any
JSON, ``--no-local-argmax`` with ``"use_local_argmax_reduction": true``) is an error naming both.
Without either, the command line decodes with k = 3 and local argmax on (``-k 3``).
"""

from __future__ import annotations

import argparse
import json
import numbers
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional, Tuple, Union

from mtpspec.config import (ALLREDUCE_BACKENDS, KV_CACHE_DTYPES, LOAD_FORMATS, MAX_NUM_SPECULATIVE_TOKENS,
                            ModelConfig, ParallelConfig, SpeculativeConfig, check_hold_steps,
                            check_prompt_reserve, check_switch_margin)

#: ``max_model_len`` when none is given: the model's ``max_position_embeddings``, at most this
#: (without chunked prefill one step may hold a whole ``max_model_len`` prompt).
DEFAULT_MAX_MODEL_LEN = 8192
#: k on the command line when neither ``-k`` nor ``--speculative-config`` is given.
DEFAULT_CLI_NUM_SPECULATIVE_TOKENS = 3
GRAPH_MODES = ("auto", "off", "cuda", "static")

SpecArg = Union[None, str, Dict[str, Any], SpeculativeConfig]

_LORA = "serves no LoRA adapters: merge the adapter into the checkpoint's weights"
_HUB = "loads a local checkpoint folder and downloads nothing: check the revision out there"
#: Arguments of vLLM's ``LLM(...)`` / ``EngineArgs`` that mtpspec does not implement: name -> (the
#: values that ask for nothing, vLLM's defaults: accepted and dropped; what mtpspec does instead).
#: Another value is a TypeError saying so (:func:`drop_vllm_only_args`), as ``SamplingParams``'
#: :data:`~mtpspec.sampling_params.VLLM_ONLY_FIELDS`.
VLLM_ONLY_ARGS: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "revision": ((None,), _HUB),
    "tokenizer_revision": ((None,), _HUB),
    "code_revision": ((None,), "runs no code from a checkpoint (its architectures are its own classes)"),
    "download_dir": ((None,), _HUB),
    "tokenizer_mode": (("auto", "hf"), "loads the folder's tokenizer.json with the tokenizers library (tokenizer=...)"),
    "skip_tokenizer_init": ((False,), "loads the tokenizer when the folder has one; for token ids only, pass "
                                      "token-id prompts and SamplingParams(detokenize=False)"),
    "quantization": ((None,), "reads quantization_config from the checkpoint's config.json (FP8 block-scaled "
                              "weights load as stored) and quantizes nothing on load"),
    "enable_lora": ((False,), _LORA),
    "max_lora_rank": ((16,), _LORA),
    "max_loras": ((1,), _LORA),
    "pipeline_parallel_size": ((1,), "runs tensor parallelism only (tensor_parallel_size)"),
    "data_parallel_size": ((1,), "runs one engine per LLM: start one per process for data parallelism"),
    "enable_expert_parallel": ((False,), "shards the experts with tensor parallelism (tensor_parallel_size)"),
    "distributed_executor_backend": ((None, "mp"), "starts one process per rank (multiprocessing), or runs under "
                                                   "torchrun"),
    "swap_space": ((4, 4.0, 0, 0.0), "recomputes a preempted sequence's KV cache (no CPU swap space)"),
    "cpu_offload_gb": ((0, 0.0), "keeps every weight on the device: use a larger tensor_parallel_size"),
    "kv_cache_memory_bytes": ((None,), "sizes the KV cache from gpu_memory_utilization, or num_kv_blocks"),
    "hf_overrides": ((None,), "reads config.json as it is: edit a copy of the checkpoint folder"),
    "compilation_config": ((None,), "captures its own CUDA graphs (enforce_eager / graph_mode)"),
    "chat_template": ((None,), "takes the template per call: LLM.chat(..., chat_template=...)"),
    "logits_processors": ((None,), "takes per-request SamplingParams(logit_bias=...)"),
    "scheduling_policy": (("fcfs",), "schedules first come, first served"),
    "disable_log_stats": ((True, False), "logs no periodic stats either way"),
}


def drop_vllm_only_args(kwargs: Dict[str, Any], what: str = "LLM") -> None:
    """Remove from ``kwargs`` the :data:`VLLM_ONLY_ARGS` that ask for nothing (``None``, an empty
    dict or list, or a listed value of the same type: ``pipeline_parallel_size=1``,
    ``enable_lora=False``, ...).

    Raises:
        TypeError: any other value of such an argument (naming it, the value and what mtpspec does
            instead), or a name that is not one of them (Python's "unexpected keyword argument").
    """
    for name in list(kwargs):
        value = kwargs[name]
        if name not in VLLM_ONLY_ARGS:
            raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
        offs, instead = VLLM_ONLY_ARGS[name]
        empty = None in offs and isinstance(value, (dict, list)) and not value  # hf_overrides={}, ...
        if empty or any(value is o or (type(value) is type(o) and value == o) for o in offs):
            del kwargs[name]
        else:
            ok = " or ".join(repr(o) for o in offs if not isinstance(o, float))
            raise TypeError(f"{what}({name}={value!r}): a vLLM argument mtpspec does not implement; mtpspec {instead} "
                            f"(accepted only as {ok})")


def model_path_problem(model: str, explicit: bool = True, arg: str = "--model") -> Optional[str]:
    """Why ``model`` is not a checkpoint folder mtpspec can load, or ``None`` when it has a
    ``config.json``. ``explicit``: the user named it (``--model``), else it is the bundled default;
    ``arg``: how the message names the argument (``LLM``'s ``"model"``).
    (The weights are checked when they load.)"""
    import os
    if os.path.isfile(os.path.join(model, "config.json")):
        return None
    if not explicit:
        return f"the bundled demo model is not at {model!r}; pass --model PATH (a checkpoint folder)"
    if os.path.isdir(model):
        return (f"{model!r} has no config.json: {arg} takes a checkpoint folder (config.json and *.safetensors, "
                "as transformers' save_pretrained writes it)")
    if os.path.exists(model):
        return f"{arg} {model!r} is a file; it takes a checkpoint folder (config.json and *.safetensors)"
    from mtpspec import DEMO_MODELS, demo_model_path
    for arch, folder in DEMO_MODELS.items():  # the README's repo-relative path, run from another folder
        if os.path.normpath(model) == os.path.join("mtpspec", folder):
            return (f"no folder {model!r} here ({os.getcwd()}): that path is relative to the repository's root; the "
                    f"bundled model is at {demo_model_path(arch)!r} (or leave --model out for the default)")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return (f"no folder {model!r}: mtpspec loads local checkpoint folders and does not download Hugging Face "
                f"Hub ids (e.g. `huggingface-cli download {model} --local-dir DIR`, then pass DIR as {arg})")
    return f"no folder {model!r} ({arg} takes a local checkpoint folder)"


def human_readable_int(value: str) -> int:
    """``--max-model-len`` as vLLM reads it: ``"4096"``, ``"4k"`` (4,000), ``"25.6k"`` (25,600),
    ``"4K"`` (4,096), ``"1M"`` (1,048,576); lower-case k / m / g are powers of 1,000 (decimals
    allowed), upper-case K / M / G powers of 1,024 (whole numbers only).

    Raises:
        argparse.ArgumentTypeError: anything else (the message says what is accepted).
    """
    from decimal import Decimal, InvalidOperation
    text = str(value).strip()
    if text and text[-1] in "kmgKMG":
        num, suffix = text[:-1], text[-1]
        power = "kmg".find(suffix.lower()) + 1
        try:
            if suffix.islower() and num.replace(".", "", 1).isdigit():
                n = Decimal(num) * 1000 ** power  # exact: 32.7k is 32,700 (a float gives 32,700.000000000004)
                if n == n.to_integral_value() and n > 0:
                    return int(n)
            elif num.isdigit():
                return int(num) * 1024 ** power
        except InvalidOperation:
            pass
    elif text.lstrip("-").isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number such as 4096, 4k (4,000), 25.6k or 4K (4,096), "
                                     f"got {value!r}")


def check_device(device: Optional[str]) -> None:
    """Raise ValueError unless ``device`` is None, ``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` with CUDA present."""
    if device is None:
        return
    if not isinstance(device, str) or device.split(":", 1)[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or None for CUDA when present), got {device!r}")
    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this torch ({torch.__version__}) sees no CUDA GPU; use device='cpu' "
                         "(CLI: --device cpu)")


def check_bool(value: Any, name: str) -> bool:
    """``value`` as a Python bool: a bool or a numpy bool (``enforce_eager="false"`` must not turn it on).

    Raises:
        ValueError: anything else (a string, 0 / 1, None), naming ``name`` (the configs' message).
    """
    import numpy as np
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_max_logprobs(value: Any) -> None:
    """``max_logprobs`` (``--max-logprobs``) is an int >= 0, or -1 for no cap.

    Raises:
        TypeError: not an int (a bool included).
        ValueError: below -1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_logprobs must be an int >= 0, or -1 for no cap, got {value!r}")
    if value < -1:
        raise ValueError(f"max_logprobs must be an int >= 0, or -1 for no cap (--max-logprobs), got {value!r}")


def check_p2p_supported(par: ParallelConfig, device: Optional[str]) -> None:
    """Before any rank starts: ``allreduce_backend="p2p"`` at tp > 1 on CPU ranks needs
    ``TRITON_INTERPRET=1`` (the ranks inherit the environment). The ranks check again at start
    (:func:`~mtpspec.distributed.allreduce_rms_norm.check_allreduce_backend_supported`).

    Raises:
        ValueError: saying what ``"p2p"`` needs and naming ``"nccl"`` as the alternative.
    """
    if par.allreduce_backend != "p2p" or par.tensor_parallel_size == 1:
        return
    import torch
    on_cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if not on_cuda:
        from mtpspec.distributed.allreduce_rms_norm import check_allreduce_backend_supported
        from mtpspec.ops.triton_utils import interpreting
        if not interpreting():
            check_allreduce_backend_supported("p2p", torch.device("cpu"))
            raise ValueError("allreduce_backend='p2p' on CPU ranks needs TRITON_INTERPRET=1; use 'nccl' "
                             "(CLI: --allreduce-backend nccl)")


def parse_speculative_config(value: SpecArg, target: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """A ``speculative_config`` as a plain dict (or ``None``), keys and values checked.

    Args:
        value: ``None``; a JSON string (``--speculative-config``; ``"null"`` = none); a dict; or a
            :class:`~mtpspec.config.SpeculativeConfig`. vLLM's ``model`` key is taken and dropped
            when it is ``null`` or names the target (MTP drafts come from the target's own
            checkpoint; vLLM fills it with the target for ``method: "mtp"``).
        target: the model the engine serves (path); given, a ``model`` other than it is refused.

    Raises:
        ValueError: invalid JSON, not an object, an unknown key (named, with the accepted keys),
            or a bad value (named: ``method`` must be ``"mtp"``, ``num_speculative_tokens`` an int in
            [1, 16], ``use_local_argmax_reduction`` a bool, ``model`` null or the target).
        TypeError: ``value`` of another type.
    """
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        out = {k: getattr(value, k) for k in SpeculativeConfig.KEYS if getattr(value, k) is not None}
        if out.get("draft_sampling") == "greedy":  # the default: absent, as in the JSON it came from
            del out["draft_sampling"]
        if out.get("adaptive") is False:  # likewise
            del out["adaptive"]
        if not out.get("adaptive_prompt_reserve"):  # likewise (0.0)
            out.pop("adaptive_prompt_reserve", None)
        if out.get("adaptive_defer_mtp_kv") is None:  # likewise (None: on under adaptive)
            out.pop("adaptive_defer_mtp_kv", None)
        return out
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config: invalid JSON ({exc}); expected e.g. "
                             '\'{"method": "mtp", "num_speculative_tokens": 3}\'') from None
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {json.dumps(value)}")
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict, SpeculativeConfig, JSON string or None, "
                        f"got {type(value).__name__}")
    unknown = [key for key in value if key not in SpeculativeConfig.KEYS and key != "model"]
    if unknown:
        raise ValueError(f"unknown speculative_config keys: {unknown}; expected some of {list(SpeculativeConfig.KEYS)}")
    out = dict(value)
    draft = out.pop("model", None)
    if draft is not None and (not isinstance(draft, str) or (target is not None and not _same_model(draft, target))):
        raise ValueError(f"speculative_config: model must be null or the target model{f' ({target!r})' if target else ''}"
                         f", got {draft!r}: mtpspec drafts with the target checkpoint's own MTP layers "
                         "(method 'mtp'), not a separate draft model")
    if isinstance(out.get("method"), str) and out["method"].endswith("_mtp"):
        out["method"] = "mtp"  # vLLM's older per-model names (deepseek_mtp, glm4_moe_mtp, ...)
    if "method" in out and out["method"] != "mtp":
        raise ValueError(f"speculative_config: method must be 'mtp' (or a model-specific alias such as "
                         f"'deepseek_mtp'), got {out['method']!r}")
    k = out.get("num_speculative_tokens", 1)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                         f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r} (for no speculation give no "
                         "speculative config; on the command line -k 0)")
    la = out.get("use_local_argmax_reduction", False)
    if not isinstance(la, bool):
        raise ValueError(f"speculative_config: use_local_argmax_reduction must be true or false, got {la!r}")
    share = out.get("index_share_for_mtp_iteration")
    if share is not None and not isinstance(share, bool):
        raise ValueError(f"speculative_config: index_share_for_mtp_iteration must be true, false or null, "
                         f"got {share!r}")
    ds = out.get("draft_sampling", "greedy")
    if ds not in SpeculativeConfig.DRAFT_SAMPLING:
        raise ValueError(f"speculative_config: draft_sampling must be one of {list(SpeculativeConfig.DRAFT_SAMPLING)}, "
                         f"got {ds!r}")
    ad = out.get("adaptive", False)
    if not isinstance(ad, bool):
        raise ValueError(f"speculative_config: adaptive must be true or false, got {ad!r}")
    table = out.get("adaptive_cost_table")
    if table is not None and (not ad or not isinstance(table, str)):
        raise ValueError(f"speculative_config: adaptive_cost_table must be a file name and needs adaptive=true, "
                         f"got {table!r} with adaptive={ad!r}")
    check_prompt_reserve(out.get("adaptive_prompt_reserve", 0.0))  # "needs adaptive": after the flags merge
    for key in ("adaptive_hold_k0_steps", "adaptive_hold_draft_steps"):  # "needs adaptive": after the flags merge
        if out.get(key) is not None:
            check_hold_steps(out[key], key)
    if out.get("adaptive_switch_margin") is not None:  # likewise
        check_switch_margin(out["adaptive_switch_margin"])
    if out.get("adaptive_defer_mtp_kv") is not None and not isinstance(out["adaptive_defer_mtp_kv"], bool):
        raise ValueError(f"speculative_config: adaptive_defer_mtp_kv must be true or false, got "
                         f"{out['adaptive_defer_mtp_kv']!r}")
    return out


def resolve_index_share(spec: Optional[SpeculativeConfig], mcfg: ModelConfig) -> Optional[SpeculativeConfig]:
    """``spec`` with ``index_share_for_mtp_iteration`` resolved against the model: the given
    value, else the checkpoint's (``config.json``'s ``index_share_for_mtp_iteration``), else off;
    always off for a model without an indexer (no ``index_topk``).

    Raises:
        ValueError: sharing requested for a model without an indexer (names the architecture).
    """
    if spec is None:
        return None
    has_indexer = getattr(mcfg.arch, "index_topk", None) is not None
    want = spec.index_share_for_mtp_iteration
    if not has_indexer:
        if want:
            raise ValueError(f"speculative_config: index_share_for_mtp_iteration=true needs a sparse-attention "
                             f"model with an indexer (DeepSeek-V3.2, GLM-5); {mcfg.architecture} has none")
        return replace(spec, index_share_for_mtp_iteration=False)
    ckpt = bool(getattr(mcfg.arch, "index_share_for_mtp_iteration", None) or False)
    return replace(spec, index_share_for_mtp_iteration=ckpt if want is None else want)


def _same_model(a: str, b: str) -> bool:
    """Whether two model arguments name the same checkpoint: equal strings, or one folder."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_num_speculative_tokens(k: Any) -> None:
    """Raise ValueError unless ``k`` (the ``-k`` shorthand) is an int in [0, 16] (0 = no speculation)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"-k/--num-speculative-tokens (num_speculative_tokens) must be an int in "
                         f"[0, {MAX_NUM_SPECULATIVE_TOKENS}] (0 = no speculation), got {k!r}")


@dataclass
class EngineArgs:
    """Arguments of the engine (see the module docstring for the flags and their defaults).

    Attributes:
        model: checkpoint folder; ``None``: the bundled demo model.
        tensor_parallel_size: ranks (int >= 1).
        speculative_config: ``None``, a dict / JSON string / :class:`SpeculativeConfig` (vLLM's keys).
        num_speculative_tokens: shorthand k in [0, 16] (0 = no speculation) or ``None`` (not given);
            combines with ``speculative_config`` as the module docstring says.
        no_local_argmax: shorthand for ``use_local_argmax_reduction: false``.
        adaptive_speculation: shorthand for ``"adaptive": true`` (adaptive speculation length).
        fuse_allreduce_rmsnorm, sequence_parallel, allreduce_backend: see
            :class:`~mtpspec.config.ParallelConfig`.
        max_model_len (``None``: the model's positions, at most 8192), max_num_seqs,
            max_num_batched_tokens (``None``: derived), enable_chunked_prefill (default on),
            long_prefill_token_threshold (0: no cap), async_scheduling (default on): see
            :class:`~mtpspec.engine.config.SchedulerConfig`.
        block_size, num_kv_blocks (``None``: sized from memory), gpu_memory_utilization,
            cpu_kv_cache_gib, enable_prefix_caching (default on), kv_cache_dtype (``"auto"``: the
            model dtype; ``"fp8"`` / ``"fp8_e4m3"``: E4M3 caches; CacheConfig.cache_dtype): see
            :class:`~mtpspec.engine.config.CacheConfig`.
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` or ``None`` (the checkpoint's).
        device: ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` or ``None`` (CUDA when present).
        enforce_eager: never use CUDA graphs.
        graph_mode: override of the runner's graph mode (``"auto"``, ``"off"``, ``"cuda"``,
            ``"static"``); ``None``: ``"off"`` with ``enforce_eager``, else ``"auto"``.
        seed: engine seed; seeds the seeds of requests that give none (``None``: random).
        load_format: ``"auto"`` / ``"safetensors"`` (the checkpoint's weights) or ``"dummy"``
            (random weights from ``config.json`` alone, vLLM's ``--load-format dummy``: for
            benchmarks of shapes without a checkpoint).
        disable_shared_experts_fusion: keep each MoE's shared experts as their own MLP (SGLang's
            ``--disable-shared-experts-fusion``); by default they run inside the routed experts'
            kernels as extra experts of weight 1 (fewer launches per MoE layer).

    Raises:
        ValueError: on construction, a bool field (``enforce_eager``, ``enable_prefix_caching``,
            ``async_scheduling``, ...) that is neither a bool nor a numpy bool, naming it.
    """

    model: Optional[str] = None
    tensor_parallel_size: int = 1
    speculative_config: SpecArg = None
    num_speculative_tokens: Optional[int] = None
    no_local_argmax: bool = False
    adaptive_speculation: bool = False
    fuse_allreduce_rmsnorm: bool = True
    sequence_parallel: bool = False
    allreduce_backend: str = "nccl"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True
    block_size: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    dtype: Optional[str] = None
    device: Optional[str] = None
    enforce_eager: bool = False
    graph_mode: Optional[str] = None
    seed: Optional[int] = 0
    load_format: str = "auto"
    disable_shared_experts_fusion: bool = False
    generation_config: str = "auto"
    tokenizer: Optional[str] = None
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for f in fields(self):  # every flag (a bool field): a bool, or a numpy bool made one
            if f.type in (bool, "bool"):  # a string under `from __future__ import annotations`, else the type
                setattr(self, f.name, check_bool(getattr(self, f.name), f.name))

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model: bool = True) -> argparse.ArgumentParser:
        """Add the engine flags (module docstring) to ``parser``; returns it.

        Args:
            parser: a parser or an argument group.
            model: also add ``--model`` (``False`` where the command defines it itself).
        """
        p = parser
        if model:
            p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
        p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tensor_parallel_size", type=int, default=1,
                       help="tensor-parallel ranks (default 1)")
        p.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s JSON: \'{"method": "mtp", "num_speculative_tokens": 3, '
                            '"use_local_argmax_reduction": true}\' (absent keys: k 1, local argmax off)')
        p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                       help=f"shorthand: draft tokens k in [0, {MAX_NUM_SPECULATIVE_TOKENS}] (0: no speculation; "
                            f"default {DEFAULT_CLI_NUM_SPECULATIVE_TOKENS} unless --speculative-config is given)")
        p.add_argument("--no-local-argmax", action="store_true",
                       help="shorthand: use_local_argmax_reduction false (drafts via compute_logits + argmax)")
        p.add_argument("--adaptive-speculation", action="store_true",
                       help='shorthand: "adaptive": true (each step proposes the k in 0..k that maximises expected '
                            "tokens per second from measured step costs and running acceptance rates)")
        p.add_argument("--no-fusion", action="store_true", help="MTP tail: all-reduce then RMSNorm (unfused)")
        p.add_argument("--sequence-parallel", action="store_true", help="sequence-parallel MTP layer (tp > 1)")
        p.add_argument("--allreduce-backend", default="nccl", choices=list(ALLREDUCE_BACKENDS),
                       help="backend of the fused all-reduce + RMSNorm tail (default nccl; p2p: one-kernel "
                            "peer-memory backend, ranks on one host)")
        p.add_argument("--max-model-len", type=human_readable_int, default=None,
                       help=f"context length (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})")
        p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default 64)")
        p.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="most new tokens per step, decode rows + prefill chunks (default: max(min(max_model_len, "
                            "2048), max_num_seqs * (1 + k)); with --no-enable-chunked-prefill max(max_model_len, "
                            "max_num_seqs * (1 + k)))")
        p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split prompts into chunks that fill each step after the running decodes (default on; "
                            "--no-enable-chunked-prefill prefills every prompt in one step)")
        p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="most tokens of one prompt per step with chunked prefill (default 0: no cap)")
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="apply a step's tokens and schedule the next step while its draft passes run on the "
                            "device (default on; same outputs; --no-async-scheduling waits for each whole step)")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV blocks of prompt prefixes computed before (automatic prefix caching, "
                            "by block content; default on; --no-enable-prefix-caching computes every prompt)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory the engine may use (default 0.9)")
        p.add_argument("--block-size", type=int, default=None,
                       help="tokens per KV block (default: the architecture's, 16; 64 for MLA models)")
        p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                       help="KV blocks per layer (default: sized from free memory)")
        p.add_argument("--cpu-kv-cache-gib", type=float, default=1.0,
                       help="on a CPU: GiB for the KV cache when --num-kv-blocks is not given (default 1; vLLM's "
                            "CPU backend reads VLLM_CPU_KVCACHE_SPACE for this)")
        p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="KV-cache storage: auto = the model dtype (default); fp8 / fp8_e4m3: E4M3 with a scale "
                            "per layer (1.0), dequantised inside the attention kernels; twice the blocks per byte")
        p.add_argument("--dtype", default=None,
                       help="auto / float32 / bfloat16 / float16 (default auto: the checkpoint's, float32 kept where "
                            "vLLM would cast it to 16 bits; half, float as vLLM)")
        p.add_argument("--generation-config", default="auto",
                       help="auto: the model folder's generation_config.json (its EOS ids end requests; its "
                            "temperature / top_p / top_k / repetition_penalty / max_new_tokens are the defaults of "
                            "requests that leave them unset, its max_new_tokens caps the server's max_tokens); "
                            "vllm: its EOS ids only; or a folder holding one")
        p.add_argument("--tokenizer", default=None,
                       help="a folder to load the tokenizer from (tokenizer.json / tokenizer_config.json; default: the "
                            "model folder's), as vLLM's --tokenizer")
        p.add_argument("--max-logprobs", type=int, default=20,
                       help="most logprobs / prompt_logprobs (top_logprobs) a request may ask for per token "
                            "(default 20, vLLM's; -1: no cap, the whole vocabulary may be asked for)")
        p.add_argument("--device", default=None, help="cuda / cuda:N / cpu (default: cuda when present)")
        p.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
        p.add_argument("--seed", type=int, default=0,
                       help="engine seed: seeds the sampling of requests that give no seed (default 0)")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="accepted so vLLM command lines run unchanged; mtpspec runs no code from the checkpoint "
                            "(its architectures are its own classes: the flag changes nothing)")
        p.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                       help="auto / safetensors: the checkpoint's weights (default); dummy: random weights from "
                            "config.json alone (benchmarks of shapes without a checkpoint; outputs are noise)")
        p.add_argument("--disable-shared-experts-fusion", action="store_true",
                       help="run MoE shared experts as their own MLP, not as extra experts of the routed kernels")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The :class:`EngineArgs` of parsed :meth:`add_cli_args` flags (other attributes ignored).

        Without ``-k`` and ``--speculative-config`` k is :data:`DEFAULT_CLI_NUM_SPECULATIVE_TOKENS`.
        """
        kw: Dict[str, Any] = {}
        for f in fields(cls):
            if hasattr(args, f.name):
                kw[f.name] = getattr(args, f.name)
        if hasattr(args, "no_fusion"):
            kw["fuse_allreduce_rmsnorm"] = not args.no_fusion
        if kw.get("num_speculative_tokens") is None and kw.get("speculative_config") is None:
            kw["num_speculative_tokens"] = DEFAULT_CLI_NUM_SPECULATIVE_TOKENS
        return cls(**kw)

    # ------------------------------------------------------------------ resolution
    def model_path(self) -> str:
        """``model``, or the bundled demo model's folder."""
        if self.model:
            return self.model
        from mtpspec import demo_model_path
        return str(demo_model_path())

    def resolved_speculative_config(self) -> Optional[SpeculativeConfig]:
        """``speculative_config`` combined with the shorthand flags (module docstring).

        Raises:
            ValueError: a bad JSON key / value, ``-k`` outside [0, 16], or a shorthand that
                contradicts the JSON (both named).
        """
        spec = parse_speculative_config(self.speculative_config, target=self.model_path())
        k = self.num_speculative_tokens
        if k is not None:
            check_num_speculative_tokens(k)
        if spec is None:
            if not k:
                if self.adaptive_speculation:
                    raise ValueError("--adaptive-speculation needs speculative decoding (k >= 1), got k = 0 / none")
                return None
            return SpeculativeConfig("mtp", k, not self.no_local_argmax, adaptive=self.adaptive_speculation)
        if k is not None:
            if k == 0:
                raise ValueError("-k/--num-speculative-tokens 0 (no speculation) conflicts with "
                                 f"--speculative-config {json.dumps(spec)}; give one of them")
            if "num_speculative_tokens" in spec and spec["num_speculative_tokens"] != k:
                raise ValueError(f"-k/--num-speculative-tokens {k} conflicts with --speculative-config "
                                 f"num_speculative_tokens={spec['num_speculative_tokens']}; give one of them")
            spec["num_speculative_tokens"] = k
        if self.no_local_argmax:
            if spec.get("use_local_argmax_reduction") is True:
                raise ValueError("--no-local-argmax conflicts with --speculative-config "
                                 "use_local_argmax_reduction=true; give one of them")
            spec["use_local_argmax_reduction"] = False
        if self.adaptive_speculation:
            if spec.get("adaptive") is False:
                raise ValueError("--adaptive-speculation conflicts with --speculative-config adaptive=false; "
                                 "give one of them")
            spec["adaptive"] = True
        return SpeculativeConfig(**spec)

    def parallel_config(self) -> ParallelConfig:
        """The :class:`~mtpspec.config.ParallelConfig` (raises ValueError on a bad value)."""
        return ParallelConfig(self.tensor_parallel_size, self.sequence_parallel, self.fuse_allreduce_rmsnorm,
                              self.allreduce_backend)

    def create_engine_config(self, model_config: Optional[ModelConfig] = None) -> Any:
        """Validate every argument and build the :class:`~mtpspec.engine.config.EngineConfig`.

        Args:
            model_config: the checkpoint's config if already read (default: read ``config.json``).

        Raises:
            ValueError / TypeError: a bad argument, naming it (tp, device, speculative config /
                shorthand, backend, ``max_model_len`` above the model's positions, MTP requested
                from a checkpoint without MTP layers, graph mode, scheduler / cache limits).
            FileNotFoundError, ModelConfigError: no or a bad ``config.json``.
        """
        from mtpspec.engine.config import CacheConfig, EngineConfig, SchedulerConfig
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise TypeError(f"seed must be an int (or None: random), got {self.seed!r}")
        seed = None if self.seed is None else int(self.seed)  # a numpy int as a Python int
        par = self.parallel_config()
        check_device(self.device)
        check_p2p_supported(par, self.device)
        spec = self.resolved_speculative_config()
        model = self.model_path()
        mcfg = model_config or ModelConfig.from_pretrained(model)
        mcfg.verify_tensor_parallel(par.tensor_parallel_size)
        if spec is not None and mcfg.num_nextn_predict_layers < 1:
            said = ("declares num_nextn_predict_layers = 0" if mcfg.declares_mtp_layers else
                    "has no num_nextn_predict_layers in its config.json (transformers' DeepseekV32Config and "
                    "GlmMoeDsaConfig do not write it)")
            raise ValueError(f"speculative decoding with MTP needs MTP layers, but {model!r} {said}: set "
                             "num_nextn_predict_layers in config.json if the checkpoint holds MTP layers, or run "
                             "without speculative decoding (-k 0, speculative_config=None)")
        spec = resolve_index_share(spec, mcfg)
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(mcfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be an int in [2, max_position_embeddings="
                             f"{mcfg.max_position_embeddings}], got {max_model_len!r}")
        k = spec.num_speculative_tokens if spec is not None else 0
        sched = SchedulerConfig(self.max_num_seqs, max_model_len, self.max_num_batched_tokens, k,
                                self.enable_chunked_prefill, self.long_prefill_token_threshold, self.async_scheduling)
        block_size = mcfg.arch.default_block_size if self.block_size is None else self.block_size
        cache = CacheConfig(block_size, self.num_kv_blocks, self.gpu_memory_utilization, self.cpu_kv_cache_gib,
                            self.enable_prefix_caching, self.kv_cache_dtype)
        mode = "off" if self.enforce_eager else (self.graph_mode or "auto")
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be 'auto', 'off', 'cuda' or 'static', got {self.graph_mode!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        dtype = None if self.dtype in (None, "auto") else self.dtype  # auto: the checkpoint's, as vLLM
        return EngineConfig(model, dtype, self.device, mcfg, par, spec, cache, sched, mode, seed,
                            self.load_format, self.disable_shared_experts_fusion)

    def llm_kwargs(self) -> Dict[str, Any]:
        """``LLM(**kwargs)`` for these arguments (``model`` resolved; speculative config resolved
        to a dict or ``None``).

        Raises:
            ValueError: as :meth:`resolved_speculative_config`; ``max_logprobs`` below -1.
            TypeError: ``max_logprobs`` not an int.
        """
        spec = self.resolved_speculative_config()
        check_max_logprobs(self.max_logprobs)  # serve / bench arms: before any engine starts
        return dict(model=self.model_path(), tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype,
                    device=self.device,
                    speculative_config=None if spec is None else parse_speculative_config(spec),
                    fuse_allreduce_rmsnorm=self.fuse_allreduce_rmsnorm, sequence_parallel=self.sequence_parallel,
                    allreduce_backend=self.allreduce_backend, max_num_seqs=self.max_num_seqs,
                    max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                    enable_chunked_prefill=self.enable_chunked_prefill,
                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                    async_scheduling=self.async_scheduling, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                    gpu_memory_utilization=self.gpu_memory_utilization, cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                    enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
                    seed=self.seed, enforce_eager=self.enforce_eager, graph_mode=self.graph_mode,
                    load_format=self.load_format, disable_shared_experts_fusion=self.disable_shared_experts_fusion,
                    generation_config=self.generation_config, tokenizer=self.tokenizer,
                    max_logprobs=self.max_logprobs)
