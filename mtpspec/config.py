"""Configs: parallel, speculative (model config: ``ModelConfig`` below, from ``config.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Union


#: Backends of the MTP layer's fused all-reduce + RMSNorm tail (``ParallelConfig.allreduce_backend``).
ALLREDUCE_BACKENDS = ("nccl", "p2p")
#: How the engine gets its weights (vLLM's ``--load-format``): the checkpoint's (``auto`` =
#: ``safetensors``), or random ones from ``config.json`` alone (``dummy``).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
#: What the KV caches store (vLLM's ``--kv-cache-dtype``): ``auto`` = the model dtype; ``fp8`` /
#: ``fp8_e4m3`` = E4M3 with a scale per layer (:mod:`mtpspec.ops.kv_quant`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class Fp8WeightConfig:
    """FP8 block-scaled weights, from ``config.json``'s ``quantization_config`` (the layout of
    DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 ``-FP8`` checkpoints and of ``transformers``'
    ``FineGrainedFP8Config``): ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
    "dynamic", "weight_block_size": [128, 128]}``. Math and kernels: :mod:`mtpspec.ops.fp8_gemm`.

    Attributes:
        weight_block_size: ``(block_n, block_k)``: weight rows and columns per float32 scale.
        modules_to_not_convert: module names the checkpoint keeps unquantised (informational:
            mtpspec reads which weights are FP8 from the tensors' dtypes).
    """

    weight_block_size: tuple = (128, 128)
    modules_to_not_convert: tuple = ()

    @classmethod
    def from_dict(cls, q: Any) -> Optional["Fp8WeightConfig"]:
        """Parse ``quantization_config`` (None / absent: None).

        Raises:
            ModelConfigError: another quant method, fmt, activation scheme or scale format, or a
                bad block size (naming the value and what is supported).
        """
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ModelConfigError(f"quantization_config must be an object, got {q!r}")
        method = q.get("quant_method")
        if method != "fp8":
            raise ModelConfigError(f"unsupported quantization_config.quant_method {method!r}: only FP8 "
                                   "block-scaled weights ('fp8', DeepSeek-V3's format) are supported; convert the "
                                   "weights to bfloat16 first")
        for key, ok in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", ("float",))):
            if q.get(key) is not None and str(q[key]).lower() not in ok:
                raise ModelConfigError(f"unsupported quantization_config.{key} {q[key]!r}; supported: {list(ok)}")
        block = q.get("weight_block_size")
        if block is None:
            raise ModelConfigError("quantization_config: FP8 weights need weight_block_size (e.g. [128, 128]); "
                                   "per-tensor FP8 scales are not supported")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise ModelConfigError(f"quantization_config.weight_block_size must be two ints >= 1, got {block!r}")
        skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        return cls(tuple(block), tuple(skip))


@dataclass
class ParallelConfig:
    """Tensor parallelism and the collectives of the MTP draft path.

    Attributes:
        tensor_parallel_size: number of TP ranks (int >= 1; default 1).
        sequence_parallel: shard the MTP layer's tokens across ranks (``sp_shard`` /
            ``sp_all_gather``) instead of all-reducing its output; only at tp > 1 (default False).
        fuse_allreduce_rmsnorm: the MTP tail goes through ``fused_allreduce_rms_norm`` (all-reduce,
            residual add and RMSNorm in one call); ``False``: all-reduce, then the norm (default True).
        allreduce_backend: who serves ``fused_allreduce_rms_norm`` at tp > 1, set once per rank at
            worker start (:func:`mtpspec.distributed.allreduce_rms_norm.init_allreduce_rms_norm_backend`):
            ``"nccl"`` (default: the group's all-reduce + the fused add + RMSNorm kernel) or
            ``"p2p"`` (the one-kernel peer-memory backend for inputs up to its capacity, NCCL
            above it; needs the ranks on one host and CUDA, or CPU under ``TRITON_INTERPRET=1``).
            Only the fused tail uses it (not ``fuse_allreduce_rmsnorm=False`` nor sequence parallel).

    Raises:
        ValueError: tensor_parallel_size not an int >= 1, a non-bool flag, or an
            ``allreduce_backend`` not in :data:`ALLREDUCE_BACKENDS` (the message lists them).
    """

    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    fuse_allreduce_rmsnorm: bool = True
    allreduce_backend: str = "nccl"

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        for name in ("sequence_parallel", "fuse_allreduce_rmsnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.allreduce_backend not in ALLREDUCE_BACKENDS:
            raise ValueError(f"allreduce_backend must be one of {list(ALLREDUCE_BACKENDS)}, "
                             f"got {self.allreduce_backend!r}")


MAX_NUM_SPECULATIVE_TOKENS = 16


def check_hold_steps(n: object, name: str) -> None:
    """``name`` (``adaptive_hold_k0_steps`` or ``adaptive_hold_draft_steps``) set to ``n``: an int (not a
    bool) >= 1.

    Raises:
        ValueError: anything else, naming the key and the value.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {n!r}")


def check_switch_margin(m: object) -> None:
    """``adaptive_switch_margin``: a number (not a bool) in ``[0, 1)``.

    Raises:
        ValueError: anything else, naming the value.
    """
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
        raise ValueError(f"speculative_config: adaptive_switch_margin must be a number in [0, 1), got {m!r}")


def check_prompt_reserve(r: object) -> None:
    """``adaptive_prompt_reserve``: a number (not a bool) in ``[0, 1)``.

    Raises:
        ValueError: anything else, naming the value.
    """
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
        raise ValueError(f"speculative_config: adaptive_prompt_reserve must be a number in [0, 1), got {r!r}")


@dataclass
class SpeculativeConfig:
    """MTP speculative decoding (vLLM's ``speculative_config`` dict maps onto this).

    Attributes:
        method: ``"mtp"`` (vLLM's older ``"<model>_mtp"`` names, e.g. ``"deepseek_mtp"``, are read as it).
        num_speculative_tokens: k, draft tokens proposed per target step, 1..16 (default 1;
            no speculation is ``speculative_config=None``, on the command line ``-k 0``).
        use_local_argmax_reduction: (default False) greedy drafts via the model's ``get_top_tokens``
            (vocab-parallel local argmax: gathers ``[num_tokens, 2]`` pairs per rank instead of
            ``[num_tokens, vocab]`` logits). The model must implement ``SupportsLocalArgmax``.
        index_share_for_mtp_iteration: (sparse-attention models: DeepSeek-V3.2, GLM-5) the MTP
            layer's indexer runs once per round, in the first draft pass, and draft steps 2..k
            reuse its selection at each request's last accepted row plus the positions drafted
            since. ``None`` (default): the checkpoint's ``config.json`` value, else off. Setting
            it for a model without an indexer is a start-up error
            (:func:`resolve_index_share`).
        draft_sampling: ``"greedy"`` (default): every draft is the MTP layer's argmax (one-hot
            ``q``). ``"auto"``: rows sampled at temperature > 0 without top-k / top-p draw their
            drafts from the MTP layer's ``softmax(l / T)`` by vocab-parallel Gumbel-max
            (:mod:`mtpspec.sample.gumbel`) and are verified with the real ``q``; greedy rows,
            rows with top-k or top-p and, under ``adaptive``, requests with their own seed keep
            greedy drafts (exact either way; the last so that their tokens stay reproducible).
        adaptive: (default False) adaptive speculation length: each step proposes ``k`` drafts,
            ``0 <= k <= num_speculative_tokens``, the ``k`` that maximises expected tokens per
            second from a measured step-cost table (per padded batch size and ``k``) and the
            running per-position acceptance rates (:mod:`mtpspec.spec_decode.adaptive`); ``k = 0``
            is a plain decoding step plus the MTP layers' KV-cache writes. Lossless like fixed
            ``k``. ``num_speculative_tokens`` is then the largest ``k``.
        adaptive_cost_table: (adaptive only) a JSON file of step costs
            (:meth:`~mtpspec.spec_decode.adaptive.StepCostTable.load`) instead of timing them at
            start-up.
        adaptive_prompt_reserve: (adaptive only; default 0.0, off) a share ``r`` in ``[0, 1)`` of
            ``max_num_batched_tokens`` kept for prompt tokens while requests wait: a step then
            proposes only a ``k`` with ``batch * (1 + k) <= (1 - r) * max_num_batched_tokens``
            (``k = 0`` always allowed), so drafts do not take the whole token budget from waiting
            prompts (the GLM-4.5-Air-width s256 loss in BENCHMARKS.md; not yet measured).
        adaptive_hold_k0_steps: (adaptive only; default 16) after a pure-decode choice of ``k = 0``
            (or a prompt step's, where the pure-decode choice would be ``k = 0``) the engine
            proposes ``k = 0`` for this many steps in all (prompt steps among them) while the batch
            stays in that choice's bucket, without asking the policy (a choice and its timing, ~70
            us on a CPU, is host time a 64-sequence step cannot hide;
            :mod:`mtpspec.spec_decode.adaptive`); 1: the policy is asked every step.
        adaptive_hold_draft_steps: (adaptive only; default 16) the same for a pure-decode choice of a
            drafting ``k`` (outside an exploration burst) once that ``k``'s host time is measured at
            the batch's bucket: the engine proposes that ``k`` for this many pure-decode steps in all
            while the batch stays in the choice's bucket (a prompt step, or prompts waiting under a
            prompt reserve, ask again); acceptance is still counted every step. 1: asked every step.
        adaptive_switch_margin: (adaptive only; ``None``, the default, means
            :data:`~mtpspec.spec_decode.adaptive.SWITCH_MARGIN`, 0.03) a drafting ``k`` replaces
            ``k = 0`` only where its predicted rate is above ``1 +`` this times ``k = 0``'s; 0: the
            plain argmax (the A/B of the margin).
        adaptive_defer_mtp_kv: (adaptive only; ``None``, the default, means True) a step that proposes no drafts
            (``k = 0``) runs no MTP pass at all: it keeps the target's hidden states of its rows
            in a paged cache (``hidden_size`` values per token in the model dtype, counted in
            the KV sizing), and the next step that drafts for a sequence first writes the MTP
            KV entries it skipped (a KV-only pass over them,
            :mod:`mtpspec.spec_decode.deferred_mtp`). Requests that finish while ``k = 0`` never
            pay the MTP layer. ``False``: every ``k = 0`` step writes its MTP KV entries itself.

    Raises:
        ValueError: unknown method, k out of range, an unknown ``draft_sampling``, a non-bool
            ``adaptive``, a cost table or a prompt reserve without ``adaptive``, a prompt reserve
            outside ``[0, 1)``, a non-bool ``adaptive_defer_mtp_kv``, ``adaptive_hold_k0_steps`` or
            ``adaptive_hold_draft_steps`` not an int >= 1 or given without ``adaptive``,
            ``adaptive_switch_margin`` outside ``[0, 1)`` or given without ``adaptive``.
    """

    #: The keys of a ``speculative_config`` dict (vLLM's spelling).
    KEYS = ("method", "num_speculative_tokens", "use_local_argmax_reduction", "index_share_for_mtp_iteration",
            "draft_sampling", "adaptive", "adaptive_cost_table", "adaptive_prompt_reserve", "adaptive_defer_mtp_kv",
            "adaptive_hold_k0_steps", "adaptive_hold_draft_steps", "adaptive_switch_margin")
    #: Values of ``draft_sampling``.
    DRAFT_SAMPLING = ("greedy", "auto")

    method: str = "mtp"
    num_speculative_tokens: int = 1
    use_local_argmax_reduction: bool = False
    index_share_for_mtp_iteration: Optional[bool] = None
    draft_sampling: str = "greedy"
    adaptive: bool = False
    adaptive_cost_table: Optional[str] = None
    adaptive_prompt_reserve: float = 0.0
    adaptive_defer_mtp_kv: Optional[bool] = None
    adaptive_hold_k0_steps: Optional[int] = None  # None: the policy's default (HOLD_K0_STEPS)
    adaptive_hold_draft_steps: Optional[int] = None  # None: the policy's default (HOLD_DRAFT_STEPS)
    adaptive_switch_margin: Optional[float] = None  # None: the policy's default (SWITCH_MARGIN)

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")
        # each adaptive_* key's own value first, then that it needs adaptive
        if self.adaptive_cost_table is not None and (not isinstance(self.adaptive_cost_table, str)
                                                     or not self.adaptive_cost_table.strip()):
            raise ValueError(f"speculative_config: adaptive_cost_table must be the path of a JSON step cost table "
                             f"(or null to time one at start-up), got {self.adaptive_cost_table!r}")
        check_prompt_reserve(self.adaptive_prompt_reserve)
        if self.adaptive_defer_mtp_kv is not None and not isinstance(self.adaptive_defer_mtp_kv, bool):
            raise ValueError(f"speculative_config: adaptive_defer_mtp_kv must be true or false, got "
                             f"{self.adaptive_defer_mtp_kv!r}")
        if self.adaptive_hold_k0_steps is not None:
            check_hold_steps(self.adaptive_hold_k0_steps, "adaptive_hold_k0_steps")
        if self.adaptive_hold_draft_steps is not None:
            check_hold_steps(self.adaptive_hold_draft_steps, "adaptive_hold_draft_steps")
        if self.adaptive_switch_margin is not None:
            check_switch_margin(self.adaptive_switch_margin)
        given = [name for name, on in (("adaptive_cost_table", self.adaptive_cost_table is not None),
                                       ("adaptive_prompt_reserve", bool(self.adaptive_prompt_reserve)),
                                       ("adaptive_defer_mtp_kv", self.adaptive_defer_mtp_kv is not None),
                                       ("adaptive_hold_k0_steps", self.adaptive_hold_k0_steps is not None),
                                       ("adaptive_hold_draft_steps", self.adaptive_hold_draft_steps is not None),
                                       ("adaptive_switch_margin", self.adaptive_switch_margin is not None)) if on]
        if given and not self.adaptive:
            raise ValueError(f"speculative_config: {given[0]} is given but adaptive is false (the adaptive_* keys "
                             "apply to adaptive speculation only)")
        if isinstance(self.method, str) and self.method.endswith("_mtp"):
            # vLLM's older per-model names (deepseek_mtp, glm4_moe_mtp, ...) mean "mtp" there too
            self.method = "mtp"
        if self.method != "mtp":
            raise ValueError(f"speculative method must be 'mtp' (or a model-specific alias such as 'deepseek_mtp'), "
                             f"got {self.method!r}")
        if self.draft_sampling not in self.DRAFT_SAMPLING:
            raise ValueError(f"speculative_config: draft_sampling must be one of {list(self.DRAFT_SAMPLING)}, "
                             f"got {self.draft_sampling!r}")
        if self.index_share_for_mtp_iteration is not None and not isinstance(self.index_share_for_mtp_iteration, bool):
            raise ValueError(f"index_share_for_mtp_iteration must be true, false or null, got "
                             f"{self.index_share_for_mtp_iteration!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r} "
                             "(for no speculation give no speculative config; on the command line -k 0)")

    @property
    def defers_mtp_kv(self) -> bool:
        """Whether adaptive ``k = 0`` steps defer their MTP KV entries (``adaptive_defer_mtp_kv``, default on)."""
        return self.adaptive and self.adaptive_defer_mtp_kv is not False

    @classmethod
    def from_any(cls, cfg: Union[None, Dict[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """``None`` -> ``None`` (plain decoding); a dict -> a config (unknown keys raise)."""
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise TypeError(f"speculative_config must be a dict, SpeculativeConfig or None, got {type(cfg).__name__}")
        unknown = set(cfg) - set(cls.KEYS)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**cfg)


# --------------------------------------------------------------------------------------------
# Model config (from a checkpoint folder's config.json)
# --------------------------------------------------------------------------------------------

# Keys every config.json must carry, whatever the architecture (no sensible default exists for
# them); an architecture's own part may require more.
_REQUIRED_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "vocab_size", "max_position_embeddings",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


class ModelConfigError(ValueError):
    """A config.json that mtpspec cannot run: unsupported architecture, missing key, impossible value."""


def _dtype_from_name(name: Any) -> Any:
    import torch
    table = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
    if isinstance(name, torch.dtype):
        if name in table.values():
            return name
        raise ModelConfigError(f"unsupported dtype {name}; expected one of float32, bfloat16, float16")
    key = str(name).replace("torch.", "")
    if key not in table:
        raise ModelConfigError(f"unsupported dtype {name!r}; expected one of float32, bfloat16, float16")
    return table[key]


def require_int(name: str, value: Any, minimum: int = 1) -> None:
    """Raise ModelConfigError unless ``value`` is an int (not a bool) >= ``minimum`` (1 or 0)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ModelConfigError(f"config value {name}={value!r} is impossible; expected {expected}")


def rope_parameters(raw: Dict[str, Any]) -> Dict[str, Any]:
    """``raw["rope_parameters"]`` (the Hugging Face >= 5 spelling of the rope keys), ``{}`` when absent.

    Raises:
        ModelConfigError: it is present but not a JSON object.
    """
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"config key 'rope_parameters' must be an object, got {params!r}")
    return params


class ArchConfig:
    """The architecture-specific part of a :class:`ModelConfig` (``ModelConfig.arch``).

    Each architecture subclasses it (as a dataclass) in its own module and names that class in
    :mod:`mtpspec.models.registry`; :meth:`ModelConfig.from_dict` calls :meth:`from_dict` after
    the common keys are checked and :meth:`validate` / :meth:`verify_tensor_parallel` after the
    common checks. Its fields are readable on the ``ModelConfig`` itself (``cfg.head_dim`` is
    ``cfg.arch.head_dim``).
    """

    #: KV-cache block size (tokens) when none is given (``--block-size``).
    default_block_size: ClassVar[int] = 16

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "ArchConfig":
        """Read this architecture's fields from a parsed ``config.json`` (common keys present).

        Raises:
            ModelConfigError: a value this architecture cannot run.
        """
        raise NotImplementedError

    def validate(self, config: "ModelConfig") -> None:
        """Check this part's values against the whole config (any tp). Raises ModelConfigError."""

    def verify_tensor_parallel(self, config: "ModelConfig", tp: int) -> None:
        """Check this part can be split over ``tp`` ranks (heads checked already). Raises ModelConfigError."""


@dataclass
class ModelConfig:
    """A model description read from ``config.json``: the fields every supported architecture
    shares, plus ``arch``, the architecture's own part (e.g. GLM-4.5's grouped-query attention
    fields in :class:`mtpspec.models.glm4_moe_config.Glm4MoeArchConfig`).

    Field names follow Hugging Face's configs (``Glm4MoeConfig``, ``DeepseekV3Config``). Optional
    keys take Hugging Face's defaults (listed below) when absent; the keys in ``_REQUIRED_KEYS``
    must be present. The architecture is the first entry of ``architectures`` that
    :mod:`mtpspec.models.registry` lists.

    Attributes:
        architecture: the registry name, e.g. ``"Glm4MoeForCausalLM"``.
        hidden_size, intermediate_size (dense MLP), moe_intermediate_size (per expert),
        num_hidden_layers (target decoder layers, MTP layers excluded), num_attention_heads,
        vocab_size, max_position_embeddings: sizes.
        arch: the architecture's part (an :class:`ArchConfig`); its fields are also readable
            as attributes of this config (``cfg.num_key_value_heads``, ``cfg.head_dim``,
            ``cfg.rotary_dim`` for GLM-4.5), not settable through it.
        rms_norm_eps: RMSNorm epsilon (default 1e-5).
        rope_theta: rotary base (default 10000); read from the top level or from
            ``rope_parameters`` (Hugging Face >= 5 spelling).
        first_k_dense_replace: the first k layers use the dense MLP, the rest MoE (default 1).
        n_routed_experts, num_experts_per_tok (top-k), n_shared_experts (default 1),
        routed_scaling_factor (default 1.0), norm_topk_prob (default True),
        n_group (default 1), topk_group (default 1): the MoE router.
        hidden_act: only ``"silu"``.
        num_nextn_predict_layers: MTP layers in the checkpoint, stored at
            ``model.layers.{num_hidden_layers + k}`` (default 0 when the key is absent).
        tie_word_embeddings: lm_head shares the embedding (default False).
        bos_token_id, pad_token_id: int or None. eos_token_ids: tuple of ints (possibly empty).
        dtype: the checkpoint's declared dtype (``torch_dtype`` / ``dtype``), a torch dtype;
            float32 when absent.
        model_path: the folder it was read from, or None.
        quantization: :class:`Fp8WeightConfig` for an FP8 block-scaled checkpoint
            (``quantization_config``), else None.

    Raises (from :meth:`from_dict` / :meth:`from_pretrained` / :meth:`verify_tensor_parallel`):
        ModelConfigError: naming the unsupported architecture (and the supported ones), the
            missing key, or the impossible value and what was expected.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    arch: ArchConfig
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    first_k_dense_replace: int = 1
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    dtype: Any = None
    model_path: Optional[str] = None
    quantization: Optional[Fp8WeightConfig] = None
    #: whether config.json names its MTP layer count (``num_nextn_predict_layers`` / ``num_mtp_layers``;
    #: transformers' DeepseekV32Config and GlmMoeDsaConfig write neither): for error messages
    declares_mtp_layers: bool = True

    # ---------------------------------------------------------------- the architecture's part
    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: forward to the architecture's part.
        arch = self.__dict__.get("arch")
        if arch is None or name.startswith("__"):
            raise AttributeError(f"'ModelConfig' object has no attribute {name!r}")
        try:
            return getattr(arch, name)
        except AttributeError:
            raise AttributeError(f"'ModelConfig' object has no attribute {name!r} (nor has its "
                                 f"{type(arch).__name__} part)") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__dataclass_fields__ and hasattr(self.__dict__.get("arch"), name):
            raise AttributeError(f"{name!r} belongs to the {type(self.arch).__name__} part: set config.arch.{name}")
        object.__setattr__(self, name, value)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, model_path: str) -> "ModelConfig":
        """Read ``{model_path}/config.json``.

        Raises:
            FileNotFoundError: no config.json in the folder.
            ModelConfigError: see the class docstring; also for invalid JSON.
        """
        import json
        import os
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {model_path!r}")
        try:
            with open(path, "r", encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: invalid JSON ({exc})") from exc
        cfg = cls.from_dict(raw)
        cfg.model_path = model_path
        return cfg

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "ModelConfig":
        """Build from a parsed ``config.json`` dict (see the class docstring); the architecture's
        part is parsed by the ``ArchConfig`` class the registry names for it."""
        from mtpspec.models.registry import supported_architectures
        if not isinstance(raw, dict):
            raise ModelConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        if raw.get("architectures") is None:
            raise ModelConfigError("config.json is missing required key 'architectures'")
        archs = raw["architectures"]
        if not isinstance(archs, list) or not archs:
            raise ModelConfigError(f"config key 'architectures' must be a non-empty list, got {archs!r}")
        supported = supported_architectures()
        arch_name = next((a for a in archs if a in supported), None)
        if arch_name is None:  # before the other keys: an unsupported model fails for that reason
            raise ModelConfigError(f"unsupported architecture {archs!r}; supported: {supported}")
        for key in _REQUIRED_KEYS:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"config.json is missing required key {key!r}")
        from mtpspec.models.registry import get_architecture
        rope_theta = rope_parameters(raw).get("rope_theta", raw.get("rope_theta", 10000.0))
        arch = get_architecture(arch_name).config_class().from_dict(raw)

        layer_types = raw.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != raw["num_hidden_layers"]):
            raise ModelConfigError(f"config key 'layer_types' must list one entry per layer (num_hidden_layers="
                                   f"{raw['num_hidden_layers']}), got {layer_types!r}")
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        dtype_name = raw.get("torch_dtype", raw.get("dtype")) or "float32"
        cfg = cls(
            architecture=arch_name, hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
            vocab_size=raw["vocab_size"], max_position_embeddings=raw["max_position_embeddings"], arch=arch,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), rope_theta=float(rope_theta),
            first_k_dense_replace=raw.get("first_k_dense_replace", 1),
            n_routed_experts=raw["n_routed_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
            n_shared_experts=raw.get("n_shared_experts", 1) or 0,
            moe_intermediate_size=raw["moe_intermediate_size"],
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            n_group=raw.get("n_group", 1) or 1, topk_group=raw.get("topk_group", 1) or 1,
            hidden_act=raw.get("hidden_act", "silu"),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"), pad_token_id=raw.get("pad_token_id"),
            eos_token_ids=eos_ids, dtype=_dtype_from_name(dtype_name),
            quantization=Fp8WeightConfig.from_dict(raw.get("quantization_config")),
            declares_mtp_layers="num_nextn_predict_layers" in raw or "num_mtp_layers" in raw,
        )
        cfg.validate()
        return cfg

    # ---------------------------------------------------------------- derived
    @property
    def num_mtp_layers(self) -> int:
        """Alias of ``num_nextn_predict_layers``."""
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (MTP blocks: ``num_hidden_layers + k``) is MoE."""
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        """Check values that make no sense at any tp: the common fields, then ``arch.validate``.

        Raises:
            ModelConfigError: naming the field.
        """
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            require_int(name, getattr(self, name))
        for name in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"):
            require_int(name, getattr(self, name), minimum=0)
        if self.hidden_act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {self.hidden_act!r}; expected 'silu'")
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"config value rms_norm_eps={self.rms_norm_eps!r} is impossible; expected > 0")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"config value rope_theta={self.rope_theta!r} is impossible; expected > 0")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                   f"n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise ModelConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by "
                                   f"n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ModelConfigError(f"n_routed_experts / n_group = {per_group} experts per group; grouped top-k "
                                   "scores each group by its top-2 experts, so it needs >= 2")
        if self.topk_group > self.n_group:
            raise ModelConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in the "
                                   f"chosen groups (topk_group * experts per group = {self.topk_group * per_group})")
        if self.routed_scaling_factor <= 0:
            raise ModelConfigError(f"config value routed_scaling_factor={self.routed_scaling_factor!r} is "
                                   "impossible; expected > 0")
        self.arch.validate(self)

    def verify_tensor_parallel(self, tp: int) -> None:
        """Check the model can be split over ``tp`` ranks.

        Attention heads must divide evenly, then the architecture's own attention split is
        checked (``arch.verify_tensor_parallel``), then the dense and expert intermediate sizes
        must divide evenly.

        Raises:
            ModelConfigError: naming the value that cannot be split.
        """
        if not isinstance(tp, int) or tp < 1:
            raise ModelConfigError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.num_attention_heads % tp:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"tensor_parallel_size={tp}")
        self.arch.verify_tensor_parallel(self, tp)
        if self.intermediate_size % tp:
            raise ModelConfigError(f"intermediate_size={self.intermediate_size} is not divisible by "
                                   f"tensor_parallel_size={tp}")
        if self.moe_intermediate_size % tp:
            raise ModelConfigError(f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by "
                                   f"tensor_parallel_size={tp}")
