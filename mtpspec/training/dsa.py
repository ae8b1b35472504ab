"""Training-time DeepSeek Sparse Attention (DSA) for mtpspec's DeepSeek-V3.2 / GLM-5 models.

The inference layers (:class:`~mtpspec.models.deepseek_v32.DeepseekV32Attention`: the lightning
indexer's Triton / torch ops, a non-differentiable top-k, sparse MLA over a paged latent cache)
never expose attention probabilities and cannot switch between dense and sparse attention.
``transformers``' ``GlmMoeDsaIndexer.forward`` runs under ``torch.no_grad`` (its indexer cannot
be trained) and its attention always applies the top-k mask (eager attention does return the
per-head probabilities). Training needs dense and sparse attention with autograd and the
attention distribution as the indexer's target, so :class:`DsaTraining` replaces the ``forward``
of every ``DeepseekV32Attention`` of the given models (an instance attribute: parameters, their
names and the checkpoint layout are untouched) by :func:`dsa_attention_forward`, the same layer in
plain torch:

* MLA in the non-absorbed form (``transformers``' ``GlmMoeDsaAttention``): per head
  ``q = [q_nope | rope(q_pe)]``, ``k = [k_nope | rope(k_pe)]`` and ``v`` from
  ``kv_b_proj(kv_a_layernorm(c_kv))``, ``softmax_scale``, equal to the absorbed form the engine
  runs (``q_nope . W_UK c = (W_UK^T q_nope) . c``), through ``scaled_dot_product_attention``;
* the indexer's logits as :mod:`mtpspec.layers.indexer` defines them, with autograd
  (:func:`indexer_scores`), and its selection by the engine's own
  :func:`~mtpspec.ops.indexer.indexer_topk` (ties to the lower position);
* GLM-5 ``"shared"`` layers attend the selection of the previous full layer (the model's
  :class:`~mtpspec.layers.indexer.IndexSelection`), as in inference.

Indexer training (DeepSeek-V3.2-Exp report, sec. 2.1 "Continued Pre-Training": its "Dense Warm-up Stage" and
"Sparse Training Stage"; the indexer itself is the report's eq. 1)::

    p_t      = (sum_h P_h[t, :]) / (sum_s sum_h P_h[t, s])   main attention probabilities at query t,
                                                              summed over heads, L1-normalised, detached
    dense warm-up:   L^I = sum_t KL(p_t || softmax(I_t))                         (mode "dense")
    sparse training: L^I = sum_t KL(p_{t, S_t} || softmax(I_{t, S_t}))           (mode "sparse")

where ``I_t`` are the indexer logits of query ``t`` over its causal context and ``S_t`` its top
``index_topk`` positions. In ``"dense"`` mode the main model attends the whole causal context; in
``"sparse"`` mode every query attends only ``S_t`` (its own indexer's, or the previous full
layer's in a shared layer), so ``p_{t, S_t}`` is that sparse attention's distribution. In both
modes the indexer's inputs (the hidden states and MLA's ``q_resid``) are detached, as the report
does for its sparse stage: the indexer learns from ``L^I`` alone, the main model from the
language-modelling (and MTP) loss alone (the selection is a discrete top-k, so no gradient
reaches the indexer through it).

Where this recipe departs from the report, and why:

1. The report's warm-up starts from a trained dense model and freezes it (only the indexer
   trains, 1,000 steps). Here the model is trained from scratch, so during the dense warm-up the
   main model trains too (dense attention, its usual loss) while the indexer learns from its
   attention distribution; the switch to sparse attention comes after a fraction of the budget
   (``--indexer-warmup-fraction``).
2. ``L^I`` is the mean over the real (non-padding) query rows of each indexer call, summed over
   the calls of a forward (each indexer's gradient then does not depend on the batch shape or
   on the number of other indexers), instead of a sum over tokens. With AdamW this only changes
   the indexers' share of the global gradient-norm clip.
3. GLM-5 shared layers have no indexer and add no ``L^I`` term; a full layer's indexer is
   trained towards its own layer's attention only.
4. An MTP layer's own indexer gets the same ``L^I`` at every MTP depth the loss runs (the depths
   reuse the layer, as the engine's draft steps do).
5. With ``kl_row_stride = s > 1`` (the recipe's ``--indexer-kl-row-stride``), ``L^I`` of a call is
   the mean over every ``s``-th query row of each sequence from a random offset (an unbiased
   estimate of the all-rows mean): the indexer's logits with autograd and the target ``p`` are
   built for those rows only (``B * L / s`` rows instead of ``B * L``), and in ``"sparse"`` mode the
   selection of every row comes from logits computed without autograd. On an H200 the indexer
   terms made a training step of the demo preset 1.4x (256-token rows) to 3.2x (2,048-token rows)
   as long as the GLM-4.5 demo's (``benchmarks/profile_dsa_train.py``).

Layout: the rows of a forward are ``B`` sequences of equal length ``L`` laid end to end
(``query_lens = seq_lens = [L] * B`` without a KV cache: :func:`mtpspec.training.step.forward_loss`),
or one causal sequence when no attention metadata is set. Memory per DSA layer call: the indexer
logits and their per-head ReLU terms, ``B * L * L * (index_n_heads + 1)`` fp32 values kept for
autograd, and transiently ``B * L * L`` fp32 per chunk of heads for ``p``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from mtpspec.layers.attention import get_forward_context
from mtpspec.layers.indexer import Indexer, apply_indexer_rope
from mtpspec.ops.indexer import indexer_topk

MODES = ("dense", "sparse")

#: ``p`` is computed over chunks of heads of at most this many ``[B, heads, L, L]`` elements.
PROB_CHUNK_ELEMS = 1 << 27


@dataclass
class DsaRecord:
    """What the DSA layers of one training forward report (:meth:`DsaTraining.collect`).

    Attributes:
        valid: ``[T]`` bool, the real (non-padding) rows of the forward, or ``None`` (all rows).
        measure: also compute ``L^I`` of indexers that do not train, and the indexer's recall
            (the share of the dense attention mass ``p`` on its top-k, over rows whose causal
            context is longer than ``index_topk``); costs an extra dense ``p`` in ``"sparse"`` mode.
        kl: one scalar per indexer call: the mean ``KL`` over the valid rows (with autograd when
            the indexer trains).
        recall_mass, recall_rows: sums for the recall (``measure`` only).
    """

    valid: Optional[torch.Tensor] = None
    measure: bool = False
    kl: List[torch.Tensor] = field(default_factory=list)
    recall_mass: float = 0.0
    recall_rows: int = 0

    def loss(self) -> Optional[torch.Tensor]:
        """``sum`` of the per-call mean KLs (the ``L^I`` to backprop), ``None`` when no indexer reported."""
        return torch.stack(self.kl).sum() if self.kl else None

    def stats(self) -> Dict[str, object]:
        """Detached figures: ``indexer_kl`` (mean over calls), ``indexer_kl_calls`` (per call, in
        forward order), ``index_recall`` (``measure`` only; ``None`` without rows longer than
        ``index_topk``)."""
        out: Dict[str, object] = {}
        if self.kl:
            calls = [float(x.detach()) for x in self.kl]
            out.update(indexer_kl=sum(calls) / len(calls), indexer_kl_calls=calls)
        if self.measure:
            out["index_recall"] = self.recall_mass / self.recall_rows if self.recall_rows else None
            out["index_recall_rows"] = self.recall_rows
        return out


def sequence_rows(num_tokens: int) -> Tuple[int, int]:
    """``(B, L)`` of the current forward: one causal sequence without attention metadata, else
    ``B`` equal-length sequences of ``L`` rows without a KV cache.

    Raises:
        ValueError: metadata with a KV cache, unequal sequences, or lengths that do not add up
            to ``num_tokens``.
    """
    meta = get_forward_context().attn_metadata
    if meta is None:
        return 1, num_tokens
    ql = [int(x) for x in meta.query_lens]
    if meta.block_tables is not None:
        raise ValueError("training DSA attention runs without a KV cache: build the metadata with block_tables=None")
    if not ql or any(x != ql[0] for x in ql) or ql[0] * len(ql) != num_tokens or (
            meta.seq_lens_list and [int(x) for x in meta.seq_lens_list] != ql):
        raise ValueError(f"training DSA attention needs B sequences of one length L laid end to end "
                         f"(query_lens = seq_lens = [L] * B, B * L = {num_tokens} rows); got query_lens={ql}, "
                         f"seq_lens={list(meta.seq_lens_list)}")
    return len(ql), ql[0]


def indexer_scores(indexer: Indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, b: int, length: int,
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The lightning indexer's logits with autograd (:mod:`mtpspec.layers.indexer`; DeepSeek-V3.2-Exp
    report, eq. 1), for ``B`` sequences of ``L`` rows.

    ``I[b, t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` in fp32 for ``s <= t``, ``-inf``
    elsewhere, with ``q = rope(wq_b(q_resid))``, ``k = rope(k_norm(wk(x)))`` and ``w =
    weights_proj(x) * index_n_heads ** -0.5 * index_head_dim ** -0.5``: the arithmetic of the
    engine's :func:`~mtpspec.ops.indexer.indexer_logits_ref` (q and k cast to fp32, the same
    einsums), so the selections agree.

    Args:
        indexer: the layer's :class:`~mtpspec.layers.indexer.Indexer` (its parameters get the
            gradient; the inputs are detached by the caller or not, as it chooses).
        hidden_states: ``[B * L, hidden]``; q_resid: ``[B * L, q_lora_rank]``; positions:
            ``[B * L]`` rope positions; cos_sin_cache: MLA's rope table.
        rows: ``[R]`` int64 query rows (positions within each sequence) to score, or ``None``
            (all ``L``).

    Returns:
        ``[B, L, L]`` fp32 (``[B, R, L]`` with ``rows``).
    """
    t = hidden_states.shape[0]
    n, d = indexer.index_n_heads, indexer.index_head_dim
    cs = cos_sin_cache.index_select(0, positions.long())
    k = indexer.k_norm(indexer.wk(hidden_states))
    k = apply_indexer_rope(k[:, None, :], cs, indexer.qk_rope_head_dim, indexer.rope_interleave)[:, 0]
    q = indexer.wq_b(q_resid).view(t, n, d)
    q = apply_indexer_rope(q, cs, indexer.qk_rope_head_dim, indexer.rope_interleave)
    w = indexer.weights_proj(hidden_states.float()) * indexer.weights_scale
    qv, wv = q.float().view(b, length, n, d), w.float().view(b, length, n)
    if rows is not None:
        qv, wv = qv[:, rows], wv[:, rows]
    s = torch.relu(torch.einsum("bqhd,bsd->bqhs", qv, k.float().view(b, length, d)))
    logits = torch.einsum("bqhs,bqh->bqs", s, wv)
    return logits.masked_fill(~causal_mask(length, logits.device, rows), float("-inf"))


def causal_mask(length: int, device: torch.device, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[L, L]`` bool, ``True`` where key ``s <= `` query ``t`` (``[R, L]`` for the query ``rows``)."""
    r = torch.arange(length, device=device)
    q = r if rows is None else rows.to(device)
    return r[None, :] <= q[:, None]


def selection_mask(topk_pos: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """``[B * L, K]`` selected positions (``-1`` = none) -> ``[B, L, L]`` bool, ``True`` at the
    selected key positions of each query row."""
    pos = topk_pos.long()
    m = torch.zeros(b * length, length + 1, dtype=torch.bool, device=pos.device)
    m.scatter_(1, torch.where(pos >= 0, pos, length), True)
    return m[:, :length].view(b, length, length)


@torch.no_grad()
def head_mean_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's target ``p``: the attention probabilities over the ``allowed`` keys, summed
    over heads and L1-normalised (each head's row sums to 1, so this is the mean over heads).

    Args:
        q: ``[B, heads, R, D]``, k: ``[B, heads, L, D]`` (any float dtype; scores in fp32); ``R`` query
            rows (``L``, or a subset).
        allowed: ``[B, R, L]`` bool (at least one key per row).
        scale: the softmax scale.

    Returns:
        ``[B, R, L]`` fp32, detached, 0 outside ``allowed``.
    """
    b, nh, nrows, _ = q.shape
    length = k.shape[2]
    out = torch.zeros(b, nrows, length, dtype=torch.float32, device=q.device)
    hc = max(1, min(nh, PROB_CHUNK_ELEMS // max(1, b * nrows * length)))
    for h0 in range(0, nh, hc):
        s = torch.matmul(q[:, h0:h0 + hc].float(), k[:, h0:h0 + hc].float().transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        out += torch.softmax(s, dim=-1).sum(1)
    return out / nh


def indexer_kl(p: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per row ``KL(p_t || softmax(I_t))`` over the ``allowed`` keys (DeepSeek-V3.2-Exp report, sec. 2.1:
    the dense warm-up loss with every causal key allowed, the sparse-stage loss with ``S_t``).

    Args:
        p: ``[B, L, L]`` target distribution over ``allowed`` (rows sum to 1; detached).
        logits: ``[B, L, L]`` indexer logits (autograd); entries outside ``allowed`` are ignored.
        allowed: ``[B, L, L]`` bool, the keys both distributions live on (causal, or ``S_t``).

    Returns:
        ``[B, L]`` fp32 KL in nats (0 for a row with one allowed key).
    """
    logq = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    keep = allowed & (p > 0)
    logp = torch.log(torch.where(keep, p, torch.ones_like(p)))
    terms = torch.where(keep, p * (logp - torch.where(keep, logq, torch.zeros_like(logq))), torch.zeros_like(p))
    return terms.sum(-1)


def dsa_attention_forward(attn: nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor, mode: str,
                          record: Optional[DsaRecord] = None, reduce_output: bool = True,
                          kl_row_stride: int = 1) -> torch.Tensor:
    """``DeepseekV32Attention.forward`` for training (module docstring), dense or sparse.

    Args:
        attn: a :class:`~mtpspec.models.deepseek_v32.DeepseekV32Attention` at tp 1.
        positions: ``[T]`` int64 rope positions.
        hidden_states: ``[T, hidden]``, ``T = B * L`` (:func:`sequence_rows`).
        mode: ``"dense"`` (every causal key) or ``"sparse"`` (the indexer's top ``index_topk``).
        record: where the layer reports ``L^I`` (the mean KL over ``record.valid`` rows) when its
            indexer trains (grad enabled and its parameters require grad) or ``record.measure``.
        reduce_output: as the inference forward (tp 1: nothing to reduce).
        kl_row_stride: ``L^I`` over every ``kl_row_stride``-th query row from a random offset (the
            module docstring's point 5; 1 = every row; ``record.measure`` always takes every row).

    Returns:
        ``[T, hidden]``; in ``"sparse"`` mode equal (up to rounding) to the inference forward.

    Raises:
        ValueError: an unknown mode or a row layout :func:`sequence_rows` refuses.
        RuntimeError: a shared layer in sparse mode with no selection from an earlier full layer.
    """
    if mode not in MODES:
        raise ValueError(f"DSA training mode must be one of {MODES}, got {mode!r}")
    t, nh = hidden_states.shape[0], attn.num_local_heads
    b, length = sequence_rows(t)
    dev = hidden_states.device
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q = attn.q_b_proj(q_resid).view(t, nh, attn.qk_head_dim)
    q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(hidden_states).split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv.contiguous())
    q_pe, k_pe = attn.rotary_emb(positions, q_pe.reshape(t, nh * attn.rope_dim), k_pe.contiguous())
    k_nope, v = attn.kv_b_proj(c_kv).view(t, nh, attn.nope_dim + attn.v_dim).split([attn.nope_dim, attn.v_dim], -1)
    qh = torch.cat([q_nope, q_pe.view(t, nh, attn.rope_dim)], -1).view(b, length, nh, -1).transpose(1, 2)
    kh = torch.cat([k_nope, k_pe[:, None, :].expand(t, nh, attn.rope_dim)], -1).view(b, length, nh, -1).transpose(1, 2)
    vh = v.reshape(b, length, nh, attn.v_dim).transpose(1, 2)
    scale = attn.mla_attn.scale
    causal = causal_mask(length, dev)

    indexer: Optional[Indexer] = attn.indexer
    trains = indexer is not None and torch.is_grad_enabled() and indexer.wq_b.weight.requires_grad
    report = record is not None and indexer is not None and (trains or record.measure)
    logits = topk_pos = sub = None
    if report and not record.measure and kl_row_stride > 1:
        off = int(torch.randint(min(kl_row_stride, length), (1,)))
        sub = torch.arange(off, length, kl_row_stride, device=dev)
    if indexer is not None and (mode == "sparse" or report):
        args = (indexer, hidden_states.detach(), q_resid.detach(), positions, attn.rotary_emb.cos_sin_cache, b, length)
        if sub is None:
            logits = indexer_scores(*args)
            if mode == "sparse" or record.measure:
                topk_pos = indexer_topk(logits.detach().reshape(t, length), indexer.index_topk)
        else:  # L^I on the rows `sub` only; the selection of every row without autograd
            logits = indexer_scores(*args, rows=sub)
            if mode == "sparse":
                with torch.no_grad():
                    topk_pos = indexer_topk(indexer_scores(*args).reshape(t, length), indexer.index_topk)
    if mode == "sparse":
        if indexer is not None:
            attn.index_selection.topk_pos = topk_pos
        else:
            topk_pos = attn.index_selection.topk_pos
            if topk_pos is None or topk_pos.shape[0] != t:
                raise RuntimeError(f"layer {attn.layer_idx} shares the DSA selection of an earlier 'full' layer, but "
                                   "no full layer ran before it in this forward")
        allowed = causal[None] & selection_mask(topk_pos, b, length)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None], scale=scale)
    else:
        allowed = causal[None].expand(b, length, length)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)

    if report:
        valid = record.valid
        if valid is not None and valid.shape != (t,):
            raise ValueError(f"DsaRecord.valid must be [T={t}] bool, got {list(valid.shape)}")
        q_kl, allowed_kl = qh.detach(), allowed
        if sub is not None:
            q_kl, allowed_kl = q_kl[:, :, sub], allowed[:, sub]
            valid = None if valid is None else valid.view(b, length)[:, sub]
        p = head_mean_probs(q_kl, kh.detach(), allowed_kl, scale)
        kl_rows = indexer_kl(p, logits, allowed_kl).reshape(-1)
        if valid is None:
            kl = kl_rows.mean()
        else:
            valid = valid.reshape(-1)
            kl = (kl_rows * valid).sum() / valid.sum().clamp(min=1)
        record.kl.append(kl if trains else kl.detach())
        if record.measure:
            dense_p = p if mode == "dense" else head_mean_probs(qh.detach(), kh.detach(),
                                                                causal[None].expand(b, length, length), scale)
            with torch.no_grad():
                mass = (dense_p * selection_mask(topk_pos, b, length)).sum(-1).reshape(t)
                long_rows = (torch.arange(length, device=dev) + 1 > indexer.index_topk).repeat(b)
                if valid is not None:
                    long_rows = long_rows & valid
                record.recall_mass += float(mass[long_rows].sum())
                record.recall_rows += int(long_rows.sum())
    out = attn.o_proj(o.transpose(1, 2).reshape(t, nh * attn.v_dim))
    return tensor_model_parallel_all_reduce(out) if reduce_output else out


def dsa_attention_layers(models: Sequence[nn.Module]) -> List[nn.Module]:
    """Every :class:`~mtpspec.models.deepseek_v32.DeepseekV32Attention` in ``models`` (each once, in
    module order)."""
    from mtpspec.models.deepseek_v32 import DeepseekV32Attention
    seen, out = set(), []
    for model in models:
        for m in model.modules():
            if isinstance(m, DeepseekV32Attention) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


class DsaTraining:
    """Switches the DSA layers of a target and its MTP model to the training forward (module docstring).

    Args:
        models: the models to train (e.g. ``[target, mtp]``), built at tp 1.
        mode: ``"dense"`` (warm-up) or ``"sparse"``.
        kl_weight: weight of ``L^I`` in the training loss (:func:`mtpspec.training.step.forward_loss`).
        kl_row_stride: ``L^I`` over every ``kl_row_stride``-th query row (module docstring, point 5).

    Attributes:
        mode: the current mode (:meth:`set_mode`).
        layers: the patched attention layers.

    Raises:
        ValueError: no DSA layer in ``models``, a bad mode, a negative weight or a stride < 1.
        RuntimeError: tensor parallelism > 1.
    """

    def __init__(self, models: Sequence[nn.Module], mode: str = "dense", kl_weight: float = 1.0,
                 kl_row_stride: int = 1) -> None:
        if get_tensor_model_parallel_world_size() != 1:
            raise RuntimeError("DSA training runs at tensor-parallel size 1")
        self.layers = dsa_attention_layers(models)
        if not self.layers:
            raise ValueError("no DSA attention layer (DeepseekV32Attention) in the given models")
        if not kl_weight >= 0:
            raise ValueError(f"the indexer's KL weight must be >= 0, got {kl_weight!r}")
        self.kl_weight = float(kl_weight)
        if not (isinstance(kl_row_stride, int) and kl_row_stride >= 1):
            raise ValueError(f"the indexer's KL row stride must be an int >= 1, got {kl_row_stride!r}")
        self.kl_row_stride = kl_row_stride
        self.mode = "dense"
        self.set_mode(mode)
        self._record: Optional[DsaRecord] = None
        self._enabled = True
        for attn in self.layers:
            attn.forward = self._make_forward(attn)

    def _make_forward(self, attn: nn.Module):
        original = type(attn).forward.__get__(attn)

        def forward(positions: torch.Tensor, hidden_states: torch.Tensor, reduce_output: bool = True) -> torch.Tensor:
            if not self._enabled:
                return original(positions, hidden_states, reduce_output)
            return dsa_attention_forward(attn, positions, hidden_states, self.mode, self._record, reduce_output,
                                         self.kl_row_stride)

        return forward

    def set_mode(self, mode: str) -> None:
        """``"dense"`` or ``"sparse"`` from the next forward on.

        Raises:
            ValueError: another mode.
        """
        if mode not in MODES:
            raise ValueError(f"DSA training mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    @contextlib.contextmanager
    def collect(self, valid: Optional[torch.Tensor] = None, measure: bool = False) -> Iterator[DsaRecord]:
        """Inside the block the DSA layers report to the yielded :class:`DsaRecord`.

        Raises:
            RuntimeError: nested ``collect`` blocks.
        """
        if self._record is not None:
            raise RuntimeError("DsaTraining.collect blocks do not nest")
        self._record = DsaRecord(valid=valid, measure=measure)
        try:
            yield self._record
        finally:
            self._record = None

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """Inside the block the layers run their own (engine) forward: the indexer's ops and sparse
        MLA, as the exported checkpoint will run in mtpspec."""
        was = self._enabled
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = was

    def remove(self) -> None:
        """Give every layer its own forward back."""
        for attn in self.layers:
            attn.__dict__.pop("forward", None)


__all__ = ["DsaRecord", "DsaTraining", "MODES", "causal_mask", "dsa_attention_forward", "dsa_attention_layers",
           "head_mean_probs", "indexer_kl", "indexer_scores", "selection_mask", "sequence_rows"]
