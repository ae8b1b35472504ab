"""DeepSeek-V3 target model (``DeepseekV3ForCausalLM``) under tensor parallelism.

Same computation as Hugging Face ``transformers``' ``DeepseekV3ForCausalLM`` (the reference in
the tests). The layer skeleton, the dense MLP and the DeepSeek MoE (sigmoid router with
``e_score_correction_bias`` for selection only, group-limited top-k, ``norm_topk_prob``,
``routed_scaling_factor``, shared experts, ``first_k_dense_replace``) are GLM-4.5's
(:mod:`mtpspec.models.glm4_moe`, reused by subclassing); only the attention differs: multi-head
latent attention (MLA; DeepSeek-V3 technical report, arXiv:2412.19437, sec. 2.1.1), in the
absorbed form, through :class:`~mtpspec.layers.mla_attention.MLAAttention`::

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is None)
    q_nope, q_pe = split(q, [qk_nope_head_dim, qk_rope_head_dim])        per head
    c_kv, k_pe   = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    c_kv         = kv_a_layernorm(c_kv);  q_pe, k_pe = rope(q_pe, k_pe)
    q_latent[h]  = q_nope[h] @ W_UK[h]          W_UK[h] = kv_b_proj rows of head h's key part [nope, r]
    o_latent     = MLAAttention(q_latent, q_pe, c_kv, k_pe)   (paged latent cache: c_kv | k_pe per token)
    o[h]         = o_latent[h] @ W_UV[h]^T      W_UV[h] = head h's value rows of kv_b_proj [v, r]
    out          = o_proj(o)

Tensor parallelism: ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` column-parallel over heads (each
rank's ``W_UK`` / ``W_UV`` are views of its own ``kv_b_proj`` rows), ``o_proj`` row-parallel;
``q_a_proj``, ``kv_a_proj_with_mqa`` and both latent norms replicated, so every rank caches the
full latent for its heads. Rope acts on the rope channels only, pairs ``(2i, 2i + 1)`` when
``rope_interleave`` (Hugging Face's ``apply_rotary_pos_emb_interleave``) else ``(i, i + rope / 2)``;
the two layouts differ only by a channel permutation applied to q and k alike, so scores match.
YaRN: :mod:`mtpspec.models.deepseek_v3_config`. The latent norms use eps 1e-6 (Hugging Face's
``DeepseekV3RMSNorm`` default, not ``rms_norm_eps``).

Checkpoint layout (``save_pretrained``; :func:`target_weight_specs`): as GLM-4.5's with
``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj}.weight`` in place of q/k/v/o; per-expert or fused expert layouts.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Optional

import torch
from torch import nn

from mtpspec.config import ModelConfig
from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from mtpspec.layers.layernorm import RMSNorm
from mtpspec.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mtpspec.layers.mla_attention import MLAAttention
from mtpspec.layers.rotary_embedding import RotaryEmbedding
from mtpspec.models import glm4_moe
from mtpspec.models.glm4_moe import Glm4MoeDecoderLayer, Glm4MoeForCausalLM, norm_and_mlp_weight_specs
from mtpspec.models.interfaces import WeightSpec

#: eps of q_a_layernorm / kv_a_layernorm (Hugging Face builds them with DeepseekV3RMSNorm's default)
LATENT_NORM_EPS = 1e-6


class DeepseekV3Attention(nn.Module):
    """MLA self-attention of this rank's ``num_attention_heads / tp`` heads (module docstring).

    ``forward(positions [T] int64, hidden_states [T, H], reduce_output=True) -> [T, H]``; with
    ``reduce_output=False`` this rank's partial sum of ``o_proj`` (the MTP sequence-parallel path).
    """

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_local_heads = heads // get_tensor_model_parallel_world_size()
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim, self.qk_head_dim = config.qk_nope_head_dim, config.v_head_dim, config.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * self.qk_head_dim, bias=False, params_dtype=params_dtype)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=False, params_dtype=params_dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, params_dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, bias=False,
                                                 params_dtype=params_dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim, bias=False,
                                                   params_dtype=params_dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, params_dtype)
        # quantize=False: W_UK / W_UV are views of this weight (absorbed MLA); an FP8 checkpoint's
        # kv_b_proj is dequantised once, at load, into the model dtype (mtpspec.layers.fp8)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False,
                                              params_dtype=params_dtype, quantize=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias=False, reduce_results=False,
                                        params_dtype=params_dtype)
        inv_freq = torch.tensor(config.rope_inv_freq(config.rope_theta), dtype=torch.float32)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, self.rope_dim, config.max_position_embeddings,
                                          config.rope_theta, is_neox_style=not config.rope_interleave,
                                          inv_freq=inv_freq, attention_factor=config.rope_attention_factor)
        self.mla_attn = MLAAttention(self.num_local_heads, self.kv_lora_rank, self.rope_dim, config.softmax_scale)

    def _w_uk_uv(self):
        """This rank's ``W_UK [heads, nope, r]`` and ``W_UV [heads, v, r]`` (views of ``kv_b_proj``)."""
        w = self.kv_b_proj.weight.view(self.num_local_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                reduce_output: bool = True) -> torch.Tensor:
        t, nh = hidden_states.shape[0], self.num_local_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(t, nh, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, nh * self.rope_dim), k_pe.contiguous())
        w_uk, w_uv = self._w_uk_uv()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [T, nh, r]
        o_latent = self.mla_attn(q_latent.contiguous(), q_pe.view(t, nh, self.rope_dim), c_kv, k_pe)
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, nh, v]
        out = self.o_proj(o.reshape(t, nh * self.v_dim))
        return tensor_model_parallel_all_reduce(out) if reduce_output else out

    def _latent(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """``(c_kv [T, kv_lora_rank], k_pe [T, rope])``: the latent cache entry of each row, as
        :meth:`forward` computes it (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, rope on ``k_pe``)."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c_kv.contiguous()), self.rotary_emb.forward_key(positions, k_pe.contiguous())

    def write_kv_cache(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Only write this step's latent cache entries, as :meth:`forward` writes them (a KV-cache-only
        pass, e.g. an MTP layer in a step without drafts).

        Computes ``c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:, :kv_lora_rank])`` and ``k_pe`` (its
        rope part, rotated; :meth:`~mtpspec.layers.rotary_embedding.RotaryEmbedding.forward_key`)
        and writes ``[c_kv | k_pe]`` (:meth:`~mtpspec.layers.mla_attention.MLAAttention.write`; an
        fp8 cache quantised with ``k_scale``). Skips the query (``q_a_proj`` / ``q_b_proj``), the
        absorption, the attention read, ``o_proj`` and the all-reduce; every op it runs is
        replicated (no collectives), no host sync.

        Args:
            positions: ``[T]`` int64; hidden_states: ``[T, H]`` (after ``input_layernorm``).
        """
        self.mla_attn.write(*self._latent(positions, hidden_states))


class DeepseekV3DecoderLayer(Glm4MoeDecoderLayer):
    """GLM-4.5's decoder layer (norms, dense MLP / DeepSeek MoE, residual handling) with MLA."""

    attention_cls = DeepseekV3Attention


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    """The DeepSeek-V3 target model: :class:`~mtpspec.models.glm4_moe.Glm4MoeForCausalLM`'s
    interface (``forward`` -> post-norm hidden states, ``compute_logits``, ``get_top_tokens``)
    with :class:`DeepseekV3DecoderLayer` layers.

    Raises:
        ModelConfigError: ``num_attention_heads`` not divisible by the current tp (or another
            size that must split).
    """

    decoder_layer_cls: ClassVar[type] = DeepseekV3DecoderLayer


# ------------------------------------------------------------------------------------------- weight specs
def decoder_layer_weight_specs(cfg: ModelConfig, layer_idx: int, ck: str, mp: str) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` of one :class:`DeepseekV3DecoderLayer` (arguments as
    :func:`mtpspec.models.glm4_moe.decoder_layer_weight_specs`): the MLA projections and norms,
    then GLM-4.5's norms + MLP / MoE specs."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    r, rope, qk, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim, cfg.v_head_dim
    a, pa = f"{ck}self_attn.", f"{mp}self_attn."
    s: Dict[str, WeightSpec] = {}
    if cfg.q_lora_rank is None:
        s[f"{a}q_proj.weight"] = WeightSpec(f"{pa}q_proj.weight", (heads * qk, h))
    else:
        q = cfg.q_lora_rank
        s[f"{a}q_a_proj.weight"] = WeightSpec(f"{pa}q_a_proj.weight", (q, h))
        s[f"{a}q_a_layernorm.weight"] = WeightSpec(f"{pa}q_a_layernorm.weight", (q,))
        s[f"{a}q_b_proj.weight"] = WeightSpec(f"{pa}q_b_proj.weight", (heads * qk, q))
    s[f"{a}kv_a_proj_with_mqa.weight"] = WeightSpec(f"{pa}kv_a_proj_with_mqa.weight", (r + rope, h))
    s[f"{a}kv_a_layernorm.weight"] = WeightSpec(f"{pa}kv_a_layernorm.weight", (r,))
    s[f"{a}kv_b_proj.weight"] = WeightSpec(f"{pa}kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + v), r))
    s[f"{a}o_proj.weight"] = WeightSpec(f"{pa}o_proj.weight", (h, heads * v))
    s.update(norm_and_mlp_weight_specs(cfg, layer_idx, ck, mp))
    return s


def target_weight_specs(cfg: ModelConfig) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for :class:`DeepseekV3ForCausalLM` (GLM-4.5's top-level
    layout with :func:`decoder_layer_weight_specs` per layer)."""
    return glm4_moe.target_weight_specs(cfg, decoder_layer_weight_specs)
