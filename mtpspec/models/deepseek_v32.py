"""DeepSeek-V3.2 target model (``DeepseekV32ForCausalLM``) under tensor parallelism.

Same computation as Hugging Face ``transformers``' ``DeepseekV32ForCausalLM`` (the reference in
the tests): DeepSeek-V3 (:mod:`mtpspec.models.deepseek_v3`: GLM-4.5's decoder skeleton, DeepSeek
MoE, absorbed MLA with q-lora) where every attention layer reads only the positions its
lightning indexer selects: DeepSeek Sparse Attention (DSA; DeepSeek-V3.2-Exp report, sec. 2.1)::

    q_resid      = q_a_layernorm(q_a_proj(x))
    q            = q_b_proj(q_resid);  c_kv, k_pe = kv_a_proj_with_mqa(x) ...     as DeepSeek-V3 (rope interleaved)
    topk_pos     = indexer(x, q_resid, positions)          [T, index_topk] positions (mtpspec.layers.indexer)
    o_latent     = SparseMLAAttention(q_latent, q_pe, c_kv, k_pe, topk_pos)    only the selected latent entries
    out          = o_proj(o_latent @ W_UV^T)

The indexer is replicated on every rank (its own paged key cache per layer, same block tables
as the latent cache); MLA is split over heads exactly as DeepSeek-V3's. GLM-5
(:mod:`mtpspec.models.glm_moe_dsa`) is this model with an interleaved indexer rope and
``"shared"`` layers that carry no indexer and reuse the selection of the previous ``"full"``
layer within the same forward (``config.indexer_types``; the layers of one model share one
:class:`~mtpspec.layers.indexer.IndexSelection`, cleared when the forward ends). Everything is
sync-free with static shapes, so CUDA graphs capture it, shared layers included.

A selection computed elsewhere (MTP index sharing) enters through the forward context:
``AttentionMetadata.precomputed_topk_pos`` replaces every indexer's selection in that forward
(the indexers still write their key caches).

Checkpoint layout (``save_pretrained``; :func:`target_weight_specs`): DeepSeek-V3's with q-lora
plus, for every layer with an indexer, ``self_attn.indexer.{wq_b.weight, wk.weight,
k_norm.weight, k_norm.bias, weights_proj.weight}``.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Dict, Optional

import torch

from mtpspec.config import ModelConfig, ModelConfigError
from mtpspec.distributed import tensor_model_parallel_all_reduce
from mtpspec.layers.indexer import Indexer, IndexSelection
from mtpspec.layers.sparse_mla_attention import SparseMLAAttention
from mtpspec.models import deepseek_v3, glm4_moe
from mtpspec.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from mtpspec.models.interfaces import WeightSpec


class DeepseekV32Attention(DeepseekV3Attention):
    """MLA of this rank's heads over the positions its DSA selection names (module docstring).

    Args:
        config: the model config (q-lora required).
        params_dtype: parameter dtype.
        layer_idx: checkpoint layer index: decides whether the layer has its own ``indexer``
            (``config.layer_has_indexer``; GLM-5 ``"shared"`` layers have none).

    Attributes:
        indexer: :class:`~mtpspec.layers.indexer.Indexer` or ``None`` (shared layer).
        index_selection: the :class:`~mtpspec.layers.indexer.IndexSelection` this layer writes
            (with an indexer) or reads (without); the model gives all its layers one instance.
        mla_attn: :class:`~mtpspec.layers.sparse_mla_attention.SparseMLAAttention`.

    ``forward(positions [T], hidden_states [T, H], reduce_output=True) -> [T, H]`` (un-reduced
    partial sum with ``reduce_output=False``).

    Raises:
        ModelConfigError: ``q_lora_rank`` is None.
    """

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None, layer_idx: int = 0) -> None:
        if config.q_lora_rank is None:
            raise ModelConfigError("DSA attention needs q_lora_rank (the indexer reads the q_a_layernorm output)")
        super().__init__(config, params_dtype)
        self.layer_idx = layer_idx
        self.mla_attn = SparseMLAAttention(self.num_local_heads, self.kv_lora_rank, self.rope_dim,
                                           config.softmax_scale)
        self.indexer: Optional[Indexer] = None
        if config.layer_has_indexer(layer_idx):
            self.indexer = Indexer(config.hidden_size, config.q_lora_rank, config.index_n_heads,
                                   config.index_head_dim, config.index_topk, config.qk_rope_head_dim,
                                   config.indexer_rope_interleave, params_dtype)
        self.index_selection = IndexSelection()

    def select(self, positions: torch.Tensor, hidden_states: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        """This layer's selection ``[T, K]``: its indexer's (stored in ``index_selection``), or, for
        a layer without one, the selection the previous full layer stored there.

        Raises:
            RuntimeError: a layer without an indexer found no selection (no full layer ran before it).
        """
        if self.indexer is not None:
            topk_pos = self.indexer(hidden_states, q_resid, positions, self.rotary_emb.cos_sin_cache)
            self.index_selection.topk_pos = topk_pos
            return topk_pos
        topk_pos = self.index_selection.topk_pos
        if topk_pos is None or topk_pos.shape[0] != hidden_states.shape[0]:
            raise RuntimeError(f"layer {self.layer_idx} shares the DSA selection of an earlier 'full' layer, but no "
                               "full layer ran before it in this forward")
        return topk_pos

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                reduce_output: bool = True) -> torch.Tensor:
        t, nh = hidden_states.shape[0], self.num_local_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(t, nh, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, nh * self.rope_dim), k_pe.contiguous())
        topk_pos = self.select(positions, hidden_states, q_resid)
        w_uk, w_uv = self._w_uk_uv()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [T, nh, r]
        o_latent = self.mla_attn(q_latent.contiguous(), q_pe.view(t, nh, self.rope_dim), c_kv, k_pe, topk_pos)
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, nh, v]
        out = self.o_proj(o.reshape(t, nh * self.v_dim))
        return tensor_model_parallel_all_reduce(out) if reduce_output else out

    def write_kv_cache(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Only write this step's cache entries, as :meth:`forward` writes them (a KV-cache-only pass,
        e.g. an MTP layer in a step without drafts): the latent entries
        (:meth:`~mtpspec.models.deepseek_v3.DeepseekV3Attention.write_kv_cache`) and, with an
        indexer, its keys ``rope(k_norm(wk(x)))``
        (:meth:`~mtpspec.layers.indexer.Indexer.write_keys`; an fp8 key cache quantised with its
        ``k_scale``). Skips the query (``q_a_proj`` / ``q_b_proj``), the indexer's query, weights,
        scoring and top-k (so ``index_selection`` and any index-sharing state are left as they
        were), the sparse attention read, ``o_proj`` and the all-reduce. No collectives, no host sync.

        Args:
            positions: ``[T]`` int64; hidden_states: ``[T, H]`` (after ``input_layernorm``).
        """
        super().write_kv_cache(positions, hidden_states)
        if self.indexer is not None:
            self.indexer.write_keys(hidden_states, positions, self.rotary_emb.cos_sin_cache)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's decoder layer with :class:`DeepseekV32Attention` (built with this layer's index)."""

    @property
    def attention_cls(self):  # type: ignore[override]
        """The attention constructor ``(config, params_dtype)``, bound to ``layer_idx``: whether the
        layer has an indexer depends on it (GLM-5's ``indexer_types``)."""
        return functools.partial(DeepseekV32Attention, layer_idx=self.layer_idx)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """The DeepSeek-V3.2 target model: :class:`~mtpspec.models.deepseek_v3.DeepseekV3ForCausalLM`'s
    interface (``forward`` -> post-norm hidden states, ``compute_logits``, ``get_top_tokens``) with
    :class:`DeepseekV32DecoderLayer` layers sharing one
    :class:`~mtpspec.layers.indexer.IndexSelection` (cleared after each forward).

    Raises:
        ModelConfigError: ``num_attention_heads`` not divisible by the current tp, or no q-lora.
    """

    decoder_layer_cls: ClassVar[type] = DeepseekV32DecoderLayer

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, params_dtype)
        self.index_selection = IndexSelection()
        for layer in self.model.layers:
            layer.self_attn.index_selection = self.index_selection

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As :meth:`~mtpspec.models.glm4_moe.Glm4MoeForCausalLM.forward`; the layers' shared
        selection is dropped when the forward ends (it belongs to this forward's rows)."""
        try:
            return super().forward(input_ids, positions, inputs_embeds)
        finally:
            self.index_selection.topk_pos = None


# ------------------------------------------------------------------------------------------- weight specs
def indexer_weight_specs(cfg: ModelConfig, ck: str, mp: str) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` of one layer's indexer (``ck`` / ``mp``: the layer's
    checkpoint / parameter prefixes, as :func:`decoder_layer_weight_specs`)."""
    h, q, n, d = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    a, pa = f"{ck}self_attn.indexer.", f"{mp}self_attn.indexer."
    return {f"{a}wq_b.weight": WeightSpec(f"{pa}wq_b.weight", (n * d, q)),
            f"{a}wk.weight": WeightSpec(f"{pa}wk.weight", (d, h)),
            f"{a}k_norm.weight": WeightSpec(f"{pa}k_norm.weight", (d,)),
            f"{a}k_norm.bias": WeightSpec(f"{pa}k_norm.bias", (d,)),
            f"{a}weights_proj.weight": WeightSpec(f"{pa}weights_proj.weight", (n, h))}


def decoder_layer_weight_specs(cfg: ModelConfig, layer_idx: int, ck: str, mp: str) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` of one :class:`DeepseekV32DecoderLayer`: DeepSeek-V3's
    (:func:`mtpspec.models.deepseek_v3.decoder_layer_weight_specs`) plus the indexer's when the
    layer has one (``cfg.layer_has_indexer(layer_idx)``)."""
    s = deepseek_v3.decoder_layer_weight_specs(cfg, layer_idx, ck, mp)
    if cfg.layer_has_indexer(layer_idx):
        s.update(indexer_weight_specs(cfg, ck, mp))
    return s


def target_weight_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for :class:`DeepseekV32ForCausalLM` (GLM-4.5's top-level
    layout with :func:`decoder_layer_weight_specs` per layer)."""
    return glm4_moe.target_weight_specs(cfg, decoder_layer_weight_specs)
