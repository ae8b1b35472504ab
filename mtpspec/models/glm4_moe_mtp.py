"""GLM-4.5-family MTP draft layers (multi-token prediction) under tensor parallelism.

An MTP module (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.2, eqs. 21-23; vLLM's
DeepSeek / GLM-4-MoE MTP models) predicts the token after next from the target's hidden state
``h_i`` at position ``i`` and the embedding of token ``i + 1``::

    x   = eh_proj([enorm(Emb(t_{i+1})), hnorm(h_i)])     (position-0 embeddings zeroed)
    h', r = mtp_block(x)                                  a target-style decoder layer
    out = shared_head.norm(all_reduce(h') + r)            post-norm hidden states
    logits = shared_head.head(out)

``out`` is returned once and used twice: for the draft logits (``compute_logits`` /
``get_top_tokens`` apply only ``shared_head.head``) and as the next draft step's
``previous_hidden_states`` (the recycled state is post-norm).

The block's last reduction (its MLP / MoE down projection, routed + shared partial sums) is left
undone, so the tail finishes it together with the residual add and the norm:

* ``fuse_allreduce_rmsnorm=True``: ``fused_allreduce_rms_norm(h', r, shared_head.norm)``;
* ``fuse_allreduce_rmsnorm=False`` (baseline): ``tensor_model_parallel_all_reduce`` then the norm;
* ``sequence_parallel=True`` at tp > 1: see :meth:`MultiTokenPredictorLayer.forward_sequence_parallel`.

Checkpoint layout (Hugging Face): MTP layer ``k`` lives at ``model.layers.{num_hidden_layers + k}.``
with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, optional ``shared_head.head`` and
``embed_tokens``, and the block's ``self_attn``, ``mlp``, ``input_layernorm``,
``post_attention_layernorm``; here the block's weights sit under ``mtp_block.``
(:func:`mtp_weight_specs`).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Dict, Literal, Optional, Sequence, Union

import torch
from torch import nn

from mtpspec.config import ModelConfig
from mtpspec.distributed import (
    get_tensor_model_parallel_world_size, sp_all_gather, sp_shard, tensor_model_parallel_all_reduce,
    tensor_model_parallel_reduce_scatter)
from mtpspec.layers.layernorm import RMSNorm
from mtpspec.layers.linear import ReplicatedLinear
from mtpspec.layers.logits_processor import LogitsProcessor
from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from mtpspec.models.glm4_moe import Glm4MoeDecoderLayer, decoder_layer_weight_specs
from mtpspec.models.interfaces import WeightSpec


class SharedHead(nn.Module):
    """``norm`` (the MTP layer's final RMSNorm) and ``head`` (its LM head: its own
    ``ParallelLMHead``, or the target's ``lm_head`` module itself when tied)."""

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype,
                 tied_head: Optional[ParallelLMHead] = None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)
        self.head = tied_head if tied_head is not None else ParallelLMHead(
            config.vocab_size, config.hidden_size, bias=False, params_dtype=params_dtype)
        self.tied = tied_head is not None


def _reduce_scatter_tokens(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x [T, H]`` over ranks and keep this rank's ``ceil(T / tp)`` token rows (zero-padded)."""
    tp = get_tensor_model_parallel_world_size()
    pad = (-x.shape[0]) % tp
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return tensor_model_parallel_reduce_scatter(x, dim=0)


class MultiTokenPredictorLayer(nn.Module):
    """One MTP layer (see the module docstring).

    Args:
        config: the model config.
        layer_idx: its checkpoint index ``num_hidden_layers + k``.
        params_dtype: parameter dtype.
        tied_head: the target's ``lm_head`` when the checkpoint has no ``shared_head.head``.
        fuse_allreduce_rmsnorm: tail through ``fused_allreduce_rms_norm`` (else all-reduce + norm).
        sequence_parallel: use :meth:`forward_sequence_parallel` when tp > 1.
        block_cls: the decoder layer class of ``mtp_block`` (default :class:`Glm4MoeDecoderLayer`;
            DeepSeek-V3: its MLA layer), built with ``reduce_mlp_output=False``.

    ``forward(inputs_embeds [T, H], positions [T] int64, previous_hidden_states [T, H]) -> [T, H]``:
    the post-final-norm hidden states, in the params dtype. ``forward_kv_only`` (same arguments):
    only the block's KV-cache writes.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, params_dtype: torch.dtype,
                 tied_head: Optional[ParallelLMHead] = None, fuse_allreduce_rmsnorm: bool = True,
                 sequence_parallel: bool = False, block_cls: type = Glm4MoeDecoderLayer) -> None:
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.enorm = RMSNorm(h, config.rms_norm_eps, params_dtype)
        self.hnorm = RMSNorm(h, config.rms_norm_eps, params_dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, params_dtype=params_dtype)
        self.shared_head = SharedHead(config, params_dtype, tied_head)
        self.mtp_block = block_cls(config, layer_idx, reduce_mlp_output=False, params_dtype=params_dtype)
        self.fuse_allreduce_rmsnorm = fuse_allreduce_rmsnorm
        self.sequence_parallel = sequence_parallel

    def eh_input(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                 previous_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[enorm(inputs_embeds, position-0 rows zeroed), hnorm(previous_hidden_states)]``, ``[T, 2H]``."""
        from mtpspec.ops.eh_norm import fused_eh_norm
        return fused_eh_norm(positions, inputs_embeds, previous_hidden_states, self.enorm.weight,
                             self.hnorm.weight, self.eps)

    @staticmethod
    def _check_inputs(inputs_embeds: torch.Tensor, positions: torch.Tensor,
                      previous_hidden_states: torch.Tensor) -> None:
        if inputs_embeds.shape != previous_hidden_states.shape or inputs_embeds.shape[0] != positions.shape[0]:
            raise ValueError(f"MTP layer: inputs_embeds {tuple(inputs_embeds.shape)}, previous_hidden_states "
                             f"{tuple(previous_hidden_states.shape)} and positions {tuple(positions.shape)} "
                             "must agree ([T, H], [T, H], [T])")

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor) -> torch.Tensor:
        self._check_inputs(inputs_embeds, positions, previous_hidden_states)
        eh = self.eh_input(inputs_embeds, positions, previous_hidden_states)
        if self.sequence_parallel and get_tensor_model_parallel_world_size() > 1:
            return self.forward_sequence_parallel(eh, positions)
        hidden_states, residual = self.mtp_block(positions, self.eh_proj(eh), None)
        if self.fuse_allreduce_rmsnorm:
            from mtpspec.distributed.allreduce_rms_norm import fused_allreduce_rms_norm
            out, _ = fused_allreduce_rms_norm(hidden_states, residual, self.shared_head.norm)
        else:
            out, _ = self.shared_head.norm(tensor_model_parallel_all_reduce(hidden_states), residual)
        return out

    def forward_kv_only(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                        previous_hidden_states: torch.Tensor) -> None:
        """Write only the attention cache entries (and DSA indexer keys) :meth:`forward` writes under
        the same forward context, without its outputs (a step that drafts nothing, k = 0).

        A position's cache entries depend only on its block input, so this computes
        ``x = input_layernorm(eh_proj(eh_input(...)))`` and hands it to the block attention's
        ``write_kv_cache`` (GQA: K/V rows of ``qkv_proj``, k-norm, rope on k; MLA: ``kv_a_proj_with_mqa``,
        ``kv_a_layernorm``, rope on ``k_pe``; DSA: plus the indexer's keys). Skipped: the query, the
        attention read, ``o_proj``, the MLP / MoE, ``shared_head`` and every collective. The
        sequence-parallel option is ignored (eh_proj on all rows: the values of the plain path, equal
        to the sequence-parallel path's up to the GEMM's row blocking). No host sync, fixed shapes
        (CUDA-graph capturable).

        Args:
            inputs_embeds: ``[T, H]``; positions: ``[T]`` int64; previous_hidden_states: ``[T, H]``
                (as :meth:`forward`).

        Raises:
            ValueError: shapes that disagree, or the attention backends' metadata / cache errors.
        """
        self._check_inputs(inputs_embeds, positions, previous_hidden_states)
        eh = self.eh_input(inputs_embeds, positions, previous_hidden_states)
        blk = self.mtp_block
        blk.self_attn.write_kv_cache(positions, blk.input_layernorm(self.eh_proj(eh)))

    def forward_sequence_parallel(self, eh: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The sequence-parallel path (tp > 1), exact up to summation order.

        Token-wise work runs on this rank's ``m = ceil(T / tp)`` tokens (``sp_shard``: rows
        ``[rank * m, (rank + 1) * m)`` of the input padded with ``(-T) % tp`` zero rows):
        ``eh_proj``, both residual adds and all three norms. The tensor-parallel parts need
        every token (attention needs each sequence's whole context and every token needs every
        expert slice), so their inputs are all-gathered and their partial outputs
        reduce-scattered back to token shards (the Megatron-LM sequence-parallel pattern,
        Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
        Models", section 4.2.2)::

            x_r  = eh_proj(sp_shard(eh))                       [m, H], no communication
            a    = attention(all_gather(input_layernorm(x_r))[:T])   partial [T, H]
            a_r, res_r = post_attention_layernorm(reduce_scatter(a), x_r)
            f    = mlp(all_gather(a_r)[:T])                    partial [T, H] (experts + shared)
            out  = all_gather(shared_head.norm(reduce_scatter(f), res_r))[:T]

        Attention and the KV-cache writes see exactly the ``T`` real rows in their original
        order, so the forward context applies unchanged. Padding rows are zeros throughout
        (eh_proj has no bias; RMSNorm of a zero row is zero since eps > 0) and are trimmed.
        Communication per layer: 3 all-gathers of ``[m, H]`` and 2 reduce-scatters of
        ``[tp * m, H]`` (the plain path: 2 all-reduces of ``[T, H]``); the eh_proj GEMM, the
        norms and the adds cost ``1 / tp`` of the plain path's.
        """
        t = eh.shape[0]
        blk = self.mtp_block
        x_local = self.eh_proj(sp_shard(eh))
        h = blk.input_layernorm(x_local)
        attn = blk.self_attn(positions, sp_all_gather(h)[:t], reduce_output=False)
        h, residual = blk.post_attention_layernorm(_reduce_scatter_tokens(attn), x_local)
        mlp = blk.mlp(sp_all_gather(h)[:t])
        out, _ = self.shared_head.norm(_reduce_scatter_tokens(mlp), residual)
        return sp_all_gather(out)[:t]


class MultiTokenPredictor(nn.Module):
    """Holds the MTP layers as ``layers[str(num_hidden_layers + k)]`` (checkpoint numbering)."""

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype, tied_heads: Sequence[Optional[ParallelLMHead]],
                 fuse_allreduce_rmsnorm: bool, sequence_parallel: bool,
                 block_cls: type = Glm4MoeDecoderLayer) -> None:
        super().__init__()
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = config.num_nextn_predict_layers
        self.layers = nn.ModuleDict({
            str(self.mtp_start_layer_idx + k): MultiTokenPredictorLayer(
                config, self.mtp_start_layer_idx + k, params_dtype, tied_heads[k], fuse_allreduce_rmsnorm,
                sequence_parallel, block_cls)
            for k in range(self.num_mtp_layers)})


class Glm4MoeMTP(nn.Module):
    """The MTP draft model: ``num_nextn_predict_layers`` MTP layers sharing the target's embedding.

    Args:
        config: the model config (``num_nextn_predict_layers >= 1``).
        embed_tokens: the target's ``VocabParallelEmbedding`` (shared, not copied).
        lm_head: the target's ``ParallelLMHead`` (used for layers whose head is tied).
        tie_heads: per MTP layer (or one bool for all), whether its ``shared_head.head`` is the
            target's ``lm_head`` (checkpoint without ``shared_head.head``) rather than its own;
            kept as ``self.tie_heads`` (a list, one bool per layer).
        fuse_allreduce_rmsnorm, sequence_parallel: the tail variant (module docstring).
        params_dtype: parameter dtype (default ``config.dtype``).

    Use :func:`mtpspec.models.loader.load_models` to build one from a checkpoint.

    Every method takes ``spec_step_idx`` (the draft step, 0-based) and uses layer
    ``spec_step_idx % num_mtp_layers``:

    * ``forward(input_ids [T] int64, positions [T] int64, previous_hidden_states [T, H],
      spec_step_idx=0) -> [T, H]`` post-norm hidden states (logits input and the next step's
      ``previous_hidden_states``). Row ``i`` pairs the embedding of ``input_ids[i]`` (the token
      after the one whose hidden state is ``previous_hidden_states[i]``) with that state, at
      ``positions[i]``; rows at position 0 get a zero embedding.
    * ``forward_kv_only(input_ids, positions, previous_hidden_states, spec_step_idx=0) -> None``:
      only ``forward``'s KV-cache writes (a step without drafts).
    * ``compute_logits(hidden_states [T, H], spec_step_idx=0) -> [T, vocab_size]``.
    * ``get_top_tokens(hidden_states [T, H], spec_step_idx=0) -> [T]`` int64 (local argmax).

    Raises:
        ValueError: no MTP layers in the config, or ``spec_step_idx < 0``.
    """

    supports_local_argmax: ClassVar[Literal[True]] = True
    #: the MTP block's decoder layer class; another architecture with the same MTP layout
    #: subclasses this model and replaces it (DeepSeek-V3)
    decoder_layer_cls: ClassVar[type] = Glm4MoeDecoderLayer

    def __init__(self, config: ModelConfig, embed_tokens: VocabParallelEmbedding, lm_head: ParallelLMHead,
                 tie_heads: Union[bool, Sequence[bool]] = False, fuse_allreduce_rmsnorm: bool = True,
                 sequence_parallel: bool = False, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        n = config.num_nextn_predict_layers
        if n < 1:
            raise ValueError("the config declares no MTP layers (num_nextn_predict_layers = 0)")
        config.verify_tensor_parallel(get_tensor_model_parallel_world_size())
        ties = [tie_heads] * n if isinstance(tie_heads, bool) else list(tie_heads)
        if len(ties) != n:
            raise ValueError(f"tie_heads has {len(ties)} entries for {n} MTP layers")
        dtype = params_dtype or config.dtype or torch.get_default_dtype()
        self.config = config
        self.params_dtype = dtype
        self.tie_heads = ties
        self.embed_tokens = embed_tokens
        self.model = MultiTokenPredictor(config, dtype, [lm_head if t else None for t in ties],
                                         fuse_allreduce_rmsnorm, sequence_parallel, self.decoder_layer_cls)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def num_mtp_layers(self) -> int:
        return self.model.num_mtp_layers

    def layer_index(self, spec_step_idx: int) -> int:
        """The MTP layer (0-based) that draft step ``spec_step_idx`` uses."""
        if not isinstance(spec_step_idx, int) or spec_step_idx < 0:
            raise ValueError(f"spec_step_idx must be an int >= 0, got {spec_step_idx!r}")
        return spec_step_idx % self.num_mtp_layers

    def get_layer(self, spec_step_idx: int = 0) -> MultiTokenPredictorLayer:
        return self.model.layers[str(self.model.mtp_start_layer_idx + self.layer_index(spec_step_idx))]

    def set_variant(self, fuse_allreduce_rmsnorm: Optional[bool] = None,
                    sequence_parallel: Optional[bool] = None) -> None:
        """Switch the tail variant of every layer (same weights)."""
        for layer in self.model.layers.values():
            if fuse_allreduce_rmsnorm is not None:
                layer.fuse_allreduce_rmsnorm = fuse_allreduce_rmsnorm
            if sequence_parallel is not None:
                layer.sequence_parallel = sequence_parallel

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                spec_step_idx: int = 0) -> torch.Tensor:
        """One MTP draft pass: post-final-norm hidden states ``[num_tokens, hidden_size]``.

        Args:
            input_ids: ``[num_tokens]`` int64, the token after each position (ids shifted by one).
            positions: ``[num_tokens]`` int64; rows at position 0 get a zero embedding.
            previous_hidden_states: ``[num_tokens, hidden_size]``, the target's post-norm hidden
                states (first pass) or this model's previous output (recycled).
            spec_step_idx: draft step; selects layer ``spec_step_idx % num_mtp_layers``.

        The result feeds :meth:`compute_logits` / :meth:`get_top_tokens` (which apply only
        ``shared_head.head``) and is the next step's ``previous_hidden_states``.
        """
        layer = self.get_layer(spec_step_idx)
        return layer(self.embed_tokens(input_ids), positions, previous_hidden_states)

    def forward_kv_only(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        previous_hidden_states: torch.Tensor, spec_step_idx: int = 0) -> None:
        """:meth:`forward`'s KV-cache writes only (a step with no drafts, k = 0): layer
        ``spec_step_idx % num_mtp_layers`` writes exactly the attention cache entries (and DSA
        indexer keys) :meth:`forward` would write under the same forward context, and nothing else
        (:meth:`MultiTokenPredictorLayer.forward_kv_only`). Arguments as :meth:`forward`; returns
        ``None``. Its only collective is the vocab-parallel embedding's all-reduce at tp > 1.

        Raises:
            ValueError: ``spec_step_idx < 0``, shapes that disagree, metadata / cache errors.
        """
        layer = self.get_layer(spec_step_idx)
        layer.forward_kv_only(self.embed_tokens(input_ids), positions, previous_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """Draft logits ``[num_tokens, vocab_size]`` through layer ``spec_step_idx``'s ``shared_head.head``."""
        return self.logits_processor.compute_logits(self.get_layer(spec_step_idx).shared_head.head, hidden_states)

    def get_top_tokens(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """Greedy draft ids ``[num_tokens]`` int64 by vocab-parallel local argmax (no logits gathered)."""
        return self.logits_processor.get_top_tokens(self.get_layer(spec_step_idx).shared_head.head, hidden_states)

    def get_sampled_tokens(self, hidden_states: torch.Tensor, temperature: torch.Tensor, rows,
                           spec_step_idx: int = 0, out=None, logits_out=None):
        """Sampled draft ids and this rank's local logits
        (:meth:`~mtpspec.layers.logits_processor.LogitsProcessor.get_sampled_tokens`, same arguments)."""
        return self.logits_processor.get_sampled_tokens(self.get_layer(spec_step_idx).shared_head.head,
                                                        hidden_states, temperature, rows, out, logits_out)

    def local_vocab_range(self, spec_step_idx: int = 0):
        """``(vocab_start, num_real)`` of this rank's shard of the draft head."""
        return self.logits_processor.local_vocab_range(self.get_layer(spec_step_idx).shared_head.head)


def mtp_weight_specs(cfg: ModelConfig, layer_specs: Optional[Callable[..., Dict[str, WeightSpec]]] = None
                     ) -> Dict[str, WeightSpec]:
    """Checkpoint key -> :class:`WeightSpec` for the MTP model (:class:`Glm4MoeMTP`): layer ``k``
    of ``num_nextn_predict_layers`` at ``model.layers.{num_hidden_layers + k}.`` (module docstring).
    ``layer_specs``: the block's per-layer function (default :func:`decoder_layer_weight_specs`)."""
    layer_specs = layer_specs or decoder_layer_weight_specs
    v, h = cfg.vocab_size, cfg.hidden_size
    s: Dict[str, WeightSpec] = {}
    for k in range(cfg.num_nextn_predict_layers):
        idx = cfg.num_hidden_layers + k
        ck = mp = f"model.layers.{idx}."
        s[f"{ck}enorm.weight"] = WeightSpec(f"{mp}enorm.weight", (h,))
        s[f"{ck}hnorm.weight"] = WeightSpec(f"{mp}hnorm.weight", (h,))
        s[f"{ck}eh_proj.weight"] = WeightSpec(f"{mp}eh_proj.weight", (h, 2 * h))
        s[f"{ck}shared_head.norm.weight"] = WeightSpec(f"{mp}shared_head.norm.weight", (h,))
        s[f"{ck}shared_head.head.weight"] = WeightSpec(f"{mp}shared_head.head.weight", (v, h), optional=True,
                                                       tied_head=True)
        s[f"{ck}embed_tokens.weight"] = WeightSpec("", (v, h), optional=True, ignored=True)
        s.update(layer_specs(cfg, idx, ck, f"{mp}mtp_block."))
    return s
