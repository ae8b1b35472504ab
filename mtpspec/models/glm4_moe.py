"""GLM-4.5-family target model (``Glm4MoeForCausalLM``) under tensor parallelism.

Same computation as Hugging Face ``transformers``' ``Glm4MoeForCausalLM`` (the reference in
the tests), laid out like vLLM: a flattened ``[num_tokens]`` batch, fused q/k/v and gate/up
projections, the residual carried beside the hidden states so each norm adds it in one step
(``RMSNorm.forward(x, residual) -> (norm(x + residual), x + residual)``).

Per decoder layer ``l``::

    residual = x                            (first layer; later: fused add in the norm)
    h = input_layernorm(x [+ residual])
    h = o_proj(attention(rotary(qk_norm(qkv_proj(h)))))        all-reduced over tp
    h, residual = post_attention_layernorm(h, residual)
    h = mlp(h)       dense SwiGLU for l < first_k_dense_replace, MoE after; all-reduced
    -> (h, residual)

and the model ends with ``norm(h, residual)``. Attention reads the forward context
(:mod:`mtpspec.layers.attention`).

Checkpoint layout (what ``transformers`` writes with ``save_pretrained``; :func:`target_weight_specs`):
``model.embed_tokens.weight``, ``model.layers.{i}.…`` (``self_attn.{q,k,v,o}_proj``, optional
``q_norm`` / ``k_norm`` / q,k,v biases, ``input_layernorm``, ``post_attention_layernorm``, dense
``mlp.{gate,up,down}_proj`` or MoE ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.{gate,up,down}_proj.weight``),
``model.norm.weight``, ``lm_head.weight`` (absent when ``tie_word_embeddings``). Experts may
instead be stored fused, as ``transformers`` >= 5 keeps them in memory: ``mlp.experts.gate_up_proj
[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj [E, H, I]``; either layout loads (not
both at once). The architecture's config part: :mod:`mtpspec.models.glm4_moe_config`.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Dict, Literal, Optional, Tuple

import torch
from torch import nn

from mtpspec.config import ModelConfig
from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from mtpspec.layers.activation import SiluAndMul
from mtpspec.layers.attention import Attention
from mtpspec.layers.fused_moe import FusedMoE, MoEGate
from mtpspec.layers.layernorm import RMSNorm
from mtpspec.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mtpspec.layers.logits_processor import LogitsProcessor
from mtpspec.layers.rotary_embedding import get_rope
from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from mtpspec.models.interfaces import WeightSpec


class Glm4MoeMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``, gate/up column-parallel, down row-parallel.

    Args:
        hidden_size, intermediate_size: full sizes (intermediate divisible by tp).
        reduce_results: all-reduce the output; ``False`` returns this rank's partial sum.
        params_dtype: parameter dtype.

    ``forward(x [T, H]) -> [T, H]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True,
                 params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       params_dtype=params_dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                           reduce_results=reduce_results, params_dtype=params_dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Glm4MoeMoE(nn.Module):
    """Routed experts + shared experts: ``experts(x, gate(x)) + shared_experts(x)``.

    Both parts return this rank's partial sums; they are added first and then all-reduced once
    (``reduce_results=True``) or returned un-reduced (``False``: the MTP block, whose caller
    finishes the reduction inside the fused all-reduce + norm).

    ``forward(x [T, H]) -> [T, H]`` in x's dtype.
    """

    def __init__(self, config: ModelConfig, reduce_results: bool = True,
                 params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.reduce_results = reduce_results
        self.gate = MoEGate(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                            config.n_group, config.topk_group, config.norm_topk_prob,
                            config.routed_scaling_factor)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                reduce_results=False, params_dtype=params_dtype)
        self.shared_experts: Optional[Glm4MoeMLP] = None
        if config.n_shared_experts > 0:
            self.shared_experts = Glm4MoeMLP(config.hidden_size,
                                             config.moe_intermediate_size * config.n_shared_experts,
                                             reduce_results=False, params_dtype=params_dtype)

    def fuse_shared_experts(self) -> bool:
        """Move the shared experts into the routed experts' weights (:meth:`FusedMoE.absorb_shared_experts`;
        the router then emits them as ``n_shared_experts`` more ids, weight 1.0), when both are plain
        (not FP8) weights of one dtype. Returns whether it did. Called after loading
        (:func:`~mtpspec.models.loader.load_models` with ``fuse_shared_experts``)."""
        sh = self.shared_experts
        if sh is None or self.experts.fp8_block is not None:
            return False
        gate_up, down = sh.gate_up_proj.weight, sh.down_proj.weight
        if {gate_up.dtype, down.dtype} != {self.experts.w13_weight.dtype}:
            return False
        n = gate_up.shape[0] // (2 * self.experts.intermediate_size_per_partition)
        self.experts.absorb_shared_experts(gate_up.data, down.data, n)
        self.gate.num_shared_fused = n
        self.shared_experts = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out


class Glm4MoeAttention(nn.Module):
    """GQA self-attention with partial rotary, optional qk-norm and q/k/v bias.

    Heads are split across ranks (``QKVParallelLinear``); ``o_proj`` is row-parallel. The
    output is all-reduced unless ``forward(..., reduce_output=False)`` (then this rank's partial).

    ``forward(positions [T] int64, hidden_states [T, H], reduce_output=True) -> [T, H]``.
    """

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          params_dtype=params_dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=False,
                                        reduce_results=False, params_dtype=params_dtype)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, params_dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, params_dtype)
        self.rotary_emb = get_rope(hd, config.rotary_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_is_neox_style)
        self.attn = Attention(self.num_heads, hd, hd ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                reduce_output: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out = self.o_proj(self.attn(q, k, v))  # v: strided rows of qkv; the cache write and attention take them
        return tensor_model_parallel_all_reduce(out) if reduce_output else out

    def write_kv_cache(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Only write this step's KV cache entries, as :meth:`forward` writes them (a KV-cache-only
        pass, e.g. an MTP layer in a step without drafts).

        Computes ``k, v`` from the K/V rows of this rank's ``qkv_proj`` weight
        (:meth:`~mtpspec.layers.linear.QKVParallelLinear.forward_kv`: a view of the fused weight and
        bias; FP8 weights sliced with their block scales when ``q_size`` is block-aligned, else the
        full projection with ``q`` dropped), ``k_norm`` (qk-norm), rotary on ``k`` only
        (:meth:`~mtpspec.layers.rotary_embedding.RotaryEmbedding.forward_key`) and the cache write
        (:meth:`~mtpspec.layers.attention.Attention.write`; fp8 caches quantised with the layer's
        scales). Skips the query, its norm and rotary, the attention read, ``o_proj`` and the
        all-reduce. No collectives, no host sync.

        Args:
            positions: ``[T]`` int64; hidden_states: ``[T, H]`` (the attention's input, i.e. after
                ``input_layernorm``).
        """
        t = hidden_states.shape[0]
        k, v = self.qkv_proj.forward_kv(hidden_states).split([self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        k = self.rotary_emb.forward_key(positions, k)
        self.attn.write(k, v)


class Glm4MoeDecoderLayer(nn.Module):
    """One decoder layer (see the module docstring).

    Args:
        config: the model config.
        layer_idx: index in the checkpoint (MTP blocks: ``num_hidden_layers + k``); decides
            dense MLP vs MoE.
        reduce_mlp_output: ``False`` leaves the MLP/MoE output un-reduced (this rank's partial
            sum): the MTP block's last reduction, done later by the caller.
        params_dtype: parameter dtype.

    ``forward(positions [T], hidden_states [T, H], residual [T, H] or None) -> (h, residual)``;
    ``h + residual`` (after the all-reduce of ``h`` when un-reduced) is the layer's output.

    ``attention_cls``: the attention module class (``cls(config, params_dtype)``, ``forward(positions,
    hidden_states, reduce_output=True)``); other architectures subclass and replace it
    (DeepSeek-V3: MLA).
    """

    attention_cls: type = Glm4MoeAttention

    def __init__(self, config: ModelConfig, layer_idx: int, reduce_mlp_output: bool = True,
                 params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = self.attention_cls(config, params_dtype)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp: nn.Module = Glm4MoeMoE(config, reduce_mlp_output, params_dtype)
        else:
            self.mlp = Glm4MoeMLP(config.hidden_size, config.intermediate_size, reduce_mlp_output, params_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Glm4MoeModel(nn.Module):
    """Embedding, decoder layers, final norm. ``forward(input_ids [T], positions [T]) -> [T, H]``.

    ``layer_cls``: the decoder layer class (default :class:`Glm4MoeDecoderLayer`)."""

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None,
                 layer_cls: type = Glm4MoeDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype)
        self.layers = nn.ModuleList([layer_cls(config, i, True, params_dtype)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Glm4MoeForCausalLM(nn.Module):
    """The target model.

    Args:
        config: a :class:`~mtpspec.config.ModelConfig` (checked against the current tp).
        params_dtype: parameter dtype (default ``config.dtype``); the router stays fp32.

    Use :func:`mtpspec.models.loader.load_target_model` to build one from a checkpoint.

    Methods:
        forward(input_ids [T] int64, positions [T] int64) -> final post-norm hidden states
            ``[T, H]`` (params dtype); run it inside ``set_forward_context(...)`` for paged
            attention, or without for one causal sequence.
        compute_logits(hidden_states [T, H]) -> ``[T, vocab_size]`` logits (all-gathered).
        get_top_tokens(hidden_states [T, H], spec_step_idx=0) -> ``[T]`` int64 greedy ids
            (vocab-parallel local argmax, equal to ``compute_logits(...).argmax(-1)``;
            ``spec_step_idx`` is ignored, it exists so both models share
            :class:`~mtpspec.models.interfaces.SupportsLocalArgmax`).

    Raises:
        ModelConfigError: the config cannot be split over the current tp.
    """

    supports_local_argmax: ClassVar[Literal[True]] = True
    #: the decoder layer class; another architecture with the same layer skeleton subclasses this
    #: model and replaces it (DeepSeek-V3: :class:`~mtpspec.models.deepseek_v3.DeepseekV3DecoderLayer`)
    decoder_layer_cls: ClassVar[type] = Glm4MoeDecoderLayer

    def __init__(self, config: ModelConfig, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        config.verify_tensor_parallel(get_tensor_model_parallel_world_size())
        self.config = config
        dtype = params_dtype or config.dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        self.model = Glm4MoeModel(config, dtype, self.decoder_layer_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=False, params_dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final post-norm hidden states ``[num_tokens, hidden_size]`` (model dtype).

        ``input_ids`` / ``positions``: ``[num_tokens]`` int64 of the flattened varlen batch that the
        current ``AttentionMetadata`` (``set_forward_context``) describes; ``inputs_embeds``
        ``[num_tokens, hidden_size]`` replaces the embedding lookup when given. Out-of-range ids
        raise ``ValueError`` (see ``VocabParallelEmbedding``).
        """
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full logits ``[num_tokens, vocab_size]`` in the head's dtype from post-norm ``hidden_states``
        ``[num_tokens, H]`` (one all-gather); ``out``: an optional contiguous ``[num_tokens, padded
        vocab]`` buffer they are written into (:meth:`LogitsProcessor.compute_logits`, whose errors
        it raises)."""
        return self.logits_processor.compute_logits(self.lm_head, hidden_states, out=out)

    def get_top_tokens(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """Greedy ids ``[num_tokens]`` int64, ``== compute_logits(h).argmax(-1)``, by vocab-parallel
        local argmax (``spec_step_idx`` is ignored; it keeps one signature with the MTP model)."""
        return self.logits_processor.get_top_tokens(self.lm_head, hidden_states)


# ------------------------------------------------------------------------------------------- weight specs
def decoder_layer_weight_specs(cfg: ModelConfig, layer_idx: int, ck: str, mp: str) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` of one :class:`Glm4MoeDecoderLayer`.

    Args:
        cfg: the model config.
        layer_idx: the layer's checkpoint index (decides dense MLP vs MoE).
        ck: checkpoint key prefix, e.g. ``"model.layers.3."``.
        mp: parameter name prefix of the layer inside the module being loaded.

    Both expert layouts are listed (``layout`` ``":per_expert"`` / ``":fused"``).
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    s: Dict[str, WeightSpec] = {
        f"{ck}self_attn.o_proj.weight": WeightSpec(f"{mp}self_attn.o_proj.weight", (h, nq)),
    }
    for name, start, rows in (("q", 0, nq), ("k", nq, nkv), ("v", nq + nkv, nkv)):
        span = (start, start + rows)
        s[f"{ck}self_attn.{name}_proj.weight"] = WeightSpec(f"{mp}self_attn.qkv_proj.weight", (rows, h), name,
                                                            rows=span)
        if cfg.attention_bias:
            s[f"{ck}self_attn.{name}_proj.bias"] = WeightSpec(f"{mp}self_attn.qkv_proj.bias", (rows,), name,
                                                              rows=span)
    if cfg.use_qk_norm:
        s[f"{ck}self_attn.q_norm.weight"] = WeightSpec(f"{mp}self_attn.q_norm.weight", (hd,))
        s[f"{ck}self_attn.k_norm.weight"] = WeightSpec(f"{mp}self_attn.k_norm.weight", (hd,))
    s.update(norm_and_mlp_weight_specs(cfg, layer_idx, ck, mp))
    return s


def norm_and_mlp_weight_specs(cfg: ModelConfig, layer_idx: int, ck: str, mp: str) -> Dict[str, WeightSpec]:
    """The attention-independent part of :func:`decoder_layer_weight_specs` (same arguments): the
    two layer norms and the dense MLP or the MoE (router, both expert layouts, shared experts).
    Shared with other architectures whose layers differ only in attention (DeepSeek-V3)."""
    h = cfg.hidden_size
    s: Dict[str, WeightSpec] = {
        f"{ck}input_layernorm.weight": WeightSpec(f"{mp}input_layernorm.weight", (h,)),
        f"{ck}post_attention_layernorm.weight": WeightSpec(f"{mp}post_attention_layernorm.weight", (h,)),
    }

    def mlp(ckp: str, mpp: str, inter: int) -> None:
        s[f"{ckp}gate_proj.weight"] = WeightSpec(f"{mpp}gate_up_proj.weight", (inter, h), 0, rows=(0, inter))
        s[f"{ckp}up_proj.weight"] = WeightSpec(f"{mpp}gate_up_proj.weight", (inter, h), 1, rows=(inter, 2 * inter))
        s[f"{ckp}down_proj.weight"] = WeightSpec(f"{mpp}down_proj.weight", (h, inter))

    if not cfg.is_moe_layer(layer_idx):
        mlp(f"{ck}mlp.", f"{mp}mlp.", cfg.intermediate_size)
        return s
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    s[f"{ck}mlp.gate.weight"] = WeightSpec(f"{mp}mlp.gate.weight", (e, h))
    s[f"{ck}mlp.gate.e_score_correction_bias"] = WeightSpec(f"{mp}mlp.gate.e_score_correction_bias", (e,))
    group = f"{ck}mlp.experts"
    w13, w2 = f"{mp}mlp.experts.w13_weight", f"{mp}mlp.experts.w2_weight"
    for x in range(e):
        per = f"{group}:per_expert"
        s[f"{ck}mlp.experts.{x}.gate_proj.weight"] = WeightSpec(w13, (i, h), "w1", x, per, rows=(0, i))
        s[f"{ck}mlp.experts.{x}.up_proj.weight"] = WeightSpec(w13, (i, h), "w3", x, per, rows=(i, 2 * i))
        s[f"{ck}mlp.experts.{x}.down_proj.weight"] = WeightSpec(w2, (h, i), "w2", x, per)
    s[f"{ck}mlp.experts.gate_up_proj"] = WeightSpec(w13, (e, 2 * i, h), "w13", None, f"{group}:fused")
    s[f"{ck}mlp.experts.down_proj"] = WeightSpec(w2, (e, h, i), "w2", None, f"{group}:fused")
    if cfg.n_shared_experts > 0:
        mlp(f"{ck}mlp.shared_experts.", f"{mp}mlp.shared_experts.", i * cfg.n_shared_experts)
    return s


def target_weight_specs(cfg: ModelConfig, layer_specs: Optional[Callable[..., Dict[str, WeightSpec]]] = None
                        ) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for the target model (:class:`Glm4MoeForCausalLM`).

    ``layer_specs``: the per-layer function (default :func:`decoder_layer_weight_specs`; another
    architecture with the same top-level layout passes its own)."""
    layer_specs = layer_specs or decoder_layer_weight_specs
    v, h = cfg.vocab_size, cfg.hidden_size
    s = {"model.embed_tokens.weight": WeightSpec("model.embed_tokens.weight", (v, h)),
         "model.norm.weight": WeightSpec("model.norm.weight", (h,)),
         "lm_head.weight": WeightSpec("lm_head.weight", (v, h), optional=cfg.tie_word_embeddings,
                                      ignored=cfg.tie_word_embeddings,
                                      tied_to="model.embed_tokens.weight" if cfg.tie_word_embeddings else None)}
    for i in range(cfg.num_hidden_layers):
        s.update(layer_specs(cfg, i, f"model.layers.{i}.", f"model.layers.{i}."))
    return s
