"""The DeepSeek-V3.2 part of a model config (``ModelConfig.arch`` for ``DeepseekV32ForCausalLM``).

DeepSeek-V3.2 (DeepSeek-V3.2-Exp report, "DeepSeek Sparse Attention", sec. 2.1) is DeepSeek-V3's
MLA (:mod:`mtpspec.models.deepseek_v3_config`: latent ranks, head dims, YaRN) plus a lightning
indexer in every attention layer that selects the ``index_topk`` context positions each query
attends. The fields below are those Hugging Face's ``DeepseekV32Config`` adds; read as
``transformers``' ``DeepseekV32Indexer`` / ``DeepseekV32Attention`` use them:

* ``index_topk``, ``index_head_dim``, ``index_n_heads``: the selection size and the indexer's
  query heads / key size (defaults 2048, 128, 64, Hugging Face's).
* the indexer's rope acts on the first ``qk_rope_head_dim`` of its ``index_head_dim`` channels,
  half-split (``rotate_half``, "neox") for DeepSeek-V3.2, while MLA's rope is interleaved;
  ``indexer_rope_interleave`` records which (False here).
* every layer runs its indexer (``indexer_types`` all ``"full"``); GLM-5's config
  (:mod:`mtpspec.models.glm_moe_dsa_config`) may mark layers ``"shared"``.
* ``q_lora_rank`` is required: the indexer's query is ``wq_b`` of MLA's ``q_a_layernorm`` output.
* MLA's rope is always interleaved (``DeepseekV32Attention`` applies
  ``apply_rotary_pos_emb_interleave``; its config has no ``rope_interleave``), so a config.json
  that says ``rope_interleave: false`` is refused.

MTP layers (checkpoint index ``>= num_hidden_layers``) always carry their own indexer.
Light: no torch import at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, Optional, Tuple

from mtpspec.config import ModelConfig, ModelConfigError, require_int
from mtpspec.models.deepseek_v3_config import DeepseekV3ArchConfig

INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class DeepseekV32ArchConfig(DeepseekV3ArchConfig):
    """DeepSeek-V3 MLA fields (:class:`DeepseekV3ArchConfig`) plus the DSA indexer's.

    Attributes:
        index_topk: context positions each query attends (the indexer's top-k).
        index_head_dim: channels of the indexer's key and of each of its query heads.
        index_n_heads: the indexer's query heads (each weighted by ``weights_proj``).
        indexer_rope_interleave: rope pairs of the indexer are ``(2i, 2i + 1)`` (True, GLM-5) or
            ``(i, i + rope / 2)`` (False, DeepSeek-V3.2).
        indexer_types: one of ``"full"`` (runs its indexer) / ``"shared"`` (reuses the previous
            full layer's selection) per target layer, ``num_hidden_layers`` entries.
        mlp_layer_types: Hugging Face's per-layer ``"dense"`` / ``"sparse"`` list when the config
            carries it (checked against ``first_k_dense_replace``), else empty.
        index_share_for_mtp_iteration: the checkpoint's ``index_share_for_mtp_iteration`` (share
            the MTP layer's selection across the draft steps of a round), ``None`` when absent;
            ``SpeculativeConfig`` may override it (``engine.arg_utils.resolve_index_share``).
    """

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    indexer_rope_interleave: bool = False
    indexer_types: Tuple[str, ...] = ()
    mlp_layer_types: Tuple[str, ...] = ()
    index_share_for_mtp_iteration: Optional[bool] = None

    #: the registry name this part belongs to (named in error messages)
    ARCHITECTURE: ClassVar[str] = "DeepseekV32ForCausalLM"
    #: the indexer rope layout of this architecture (transformers' indexer class)
    INDEXER_ROPE_INTERLEAVE: ClassVar[bool] = False
    #: Hugging Face's default ``index_n_heads`` of this architecture
    DEFAULT_INDEX_N_HEADS: ClassVar[int] = 64

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "DeepseekV32ArchConfig":
        """Read the MLA fields (as DeepSeek-V3) and the indexer fields from a parsed config.json.

        Raises:
            ModelConfigError: the DeepSeek-V3 part's errors (rope type, ``attention_bias``);
                ``rope_interleave: false``; an ``indexer_rope_interleave`` that contradicts the
                architecture; malformed ``indexer_types`` / ``mlp_layer_types``; an
                ``index_share_for_mtp_iteration`` other than true / false / null.
        """
        if raw.get("rope_interleave") is False:
            raise ModelConfigError(f"rope_interleave=false is not supported for {cls.ARCHITECTURE}: its MLA rope is "
                                   "always interleaved (transformers' DeepseekV32Attention)")
        given = raw.get("indexer_rope_interleave")
        if given is not None and bool(given) != cls.INDEXER_ROPE_INTERLEAVE:
            raise ModelConfigError(f"indexer_rope_interleave={given!r} contradicts {cls.ARCHITECTURE}, whose indexer "
                                   f"rope is {'interleaved' if cls.INDEXER_ROPE_INTERLEAVE else 'half-split'} "
                                   "(transformers' indexer)")
        try:
            base = super().from_dict(raw)
        except ModelConfigError as exc:  # name this architecture, not DeepSeek-V3
            raise ModelConfigError(str(exc).replace("DeepseekV3ForCausalLM", cls.ARCHITECTURE)) from None
        share = raw.get("index_share_for_mtp_iteration")
        if share is not None and not isinstance(share, bool):
            raise ModelConfigError(f"config key 'index_share_for_mtp_iteration' must be true, false or null, got "
                                   f"{share!r}")
        mlp = raw.get("mlp_layer_types") or ()
        if not isinstance(mlp, (list, tuple)):
            raise ModelConfigError(f"config key 'mlp_layer_types' must be a list, got {mlp!r}")
        return replace(base, rope_interleave=True,
                       index_topk=raw.get("index_topk", 2048), index_head_dim=raw.get("index_head_dim", 128),
                       index_n_heads=raw.get("index_n_heads", cls.DEFAULT_INDEX_N_HEADS),
                       indexer_rope_interleave=cls.INDEXER_ROPE_INTERLEAVE,
                       indexer_types=cls.parse_indexer_types(raw), mlp_layer_types=tuple(mlp),
                       index_share_for_mtp_iteration=share)

    @classmethod
    def parse_indexer_types(cls, raw: Dict[str, Any]) -> Tuple[str, ...]:
        """DeepSeek-V3.2: every layer ``"full"``.

        Raises:
            ModelConfigError: the config marks a layer ``"shared"`` (a GLM-5 feature).
        """
        n = raw.get("num_hidden_layers")
        given = raw.get("indexer_types")
        if given is not None and any(t != "full" for t in given):
            raise ModelConfigError(f"{cls.ARCHITECTURE} runs its indexer in every layer; indexer_types={given!r} "
                                   "has other entries ('shared' layers are GlmMoeDsaForCausalLM's)")
        return ("full",) * n if isinstance(n, int) and n > 0 else ()

    # ---------------------------------------------------------------- per layer
    def layer_has_indexer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` runs its own indexer: ``indexer_types[layer_idx] ==
        "full"`` for a target layer, always for an MTP block (``layer_idx >= num_hidden_layers``)."""
        return layer_idx >= len(self.indexer_types) or self.indexer_types[layer_idx] == "full"

    # ---------------------------------------------------------------- checks
    def validate(self, config: ModelConfig) -> None:
        """The DeepSeek-V3 checks, then: ``q_lora_rank`` set, positive indexer sizes, a rope part
        that fits in ``index_head_dim``, ``num_hidden_layers`` indexer types with a full first
        layer, and ``mlp_layer_types`` (when given) equal to what ``first_k_dense_replace`` says.

        Raises:
            ModelConfigError: naming the value.
        """
        super().validate(config)
        if self.q_lora_rank is None:
            raise ModelConfigError(f"{self.ARCHITECTURE} needs q_lora_rank: the indexer's query is wq_b of the "
                                   "q_a_layernorm output")
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            require_int(name, getattr(self, name))
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(f"index_head_dim={self.index_head_dim} is smaller than qk_rope_head_dim="
                                   f"{self.qk_rope_head_dim}: the indexer ropes its first qk_rope_head_dim channels")
        n = config.num_hidden_layers
        types = self.indexer_types
        if len(types) != n or any(t not in INDEXER_TYPES for t in types):
            raise ModelConfigError(f"indexer_types must list one of {INDEXER_TYPES} per layer "
                                   f"(num_hidden_layers={n}), got {list(types)!r}")
        if types[0] != "full":
            raise ModelConfigError("indexer_types[0] must be 'full': a 'shared' layer reuses the selection of an "
                                   "earlier full layer")
        if self.mlp_layer_types:
            want = ["dense" if not config.is_moe_layer(i) else "sparse" for i in range(n)]
            if list(self.mlp_layer_types) != want:
                raise ModelConfigError(f"mlp_layer_types={list(self.mlp_layer_types)!r} disagrees with "
                                       f"first_k_dense_replace={config.first_k_dense_replace} (expected {want}); "
                                       "only the first-k-dense pattern is supported")

    def verify_tensor_parallel(self, config: ModelConfig, tp: int) -> None:
        """MLA's head split (:meth:`DeepseekV3ArchConfig.verify_tensor_parallel`); the indexer is
        replicated on every rank, so nothing of it must divide.

        Raises:
            ModelConfigError: ``num_attention_heads % tp != 0``.
        """
        super().verify_tensor_parallel(config, tp)


def indexer_types_from_schedule(num_layers: int, pattern: Optional[Any] = None, freq: Optional[int] = None,
                                offset: Optional[int] = None) -> Tuple[str, ...]:
    """GLM-5's per-layer indexer types as ``transformers``' ``GlmMoeDsaConfig`` derives them when
    ``indexer_types`` is absent: from ``index_topk_pattern`` (a string of ``F`` / ``S`` or a list
    of types), else layer ``i`` is ``"full"`` iff ``max(i - offset + 1, 0) % freq == 0``
    (``index_topk_freq`` default 1, ``index_skip_topk_offset`` default 2).

    Raises:
        ModelConfigError: a pattern character other than ``F`` / ``S``, or a non-positive freq.
    """
    if pattern is not None:
        if isinstance(pattern, str):
            table = {"F": "full", "S": "shared"}
            bad = sorted(set(pattern) - set(table))
            if bad:
                raise ModelConfigError(f"index_topk_pattern={pattern!r} has characters {bad}; expected 'F' / 'S'")
            return tuple(table[c] for c in pattern)
        return tuple(pattern)
    freq = max(1 if freq is None else int(freq), 1)
    offset = 2 if offset is None else int(offset)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
