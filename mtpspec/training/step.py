"""One training forward: target + MTP layers on a length-bucketed batch, through mtpspec's modules."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from mtpspec.layers.attention import build_attention_metadata, set_forward_context
from mtpspec.training.mtp_loss import MtpLossOutput, mtp_training_loss
from mtpspec.training.packing import Batch

if TYPE_CHECKING:
    from mtpspec.training.dsa import DsaTraining


def forward_loss(target: nn.Module, mtp: nn.Module, batch: Batch, device: torch.device,
                 mtp_lambda: float, return_hidden: bool = False, mtp_depth: Optional[int] = None, mtp_distill: float = 0.0,
                 dsa: Optional["DsaTraining"] = None, measure_dsa: bool = False):
    """``mtp_training_loss`` of ``batch`` (DeepSeek-V3 eq. 25) with ``mtp_depth`` MTP depths
    (default: the model's MTP layers; more than that reuses layer ``(k - 1) % num_mtp_layers``
    recursively, like the engine's drafts) and self-distillation weight ``mtp_distill``.

    DSA models: ``dsa`` (:class:`~mtpspec.training.dsa.DsaTraining` installed on ``target`` and
    ``mtp``) collects the lightning indexers' ``L^I`` over the real rows of the batch (target
    layers and every MTP depth); ``loss`` then includes ``dsa.kl_weight * L^I`` (its gradient
    reaches only the indexers) and ``indexer_loss`` / ``dsa_stats`` report it; ``measure_dsa``
    adds the indexers' recall to ``dsa_stats`` (:class:`~mtpspec.training.dsa.DsaRecord`).

    Each row of ``batch`` is one sequence of the flattened varlen layout (``query_lens = seq_lens
    = [L] * B``, no KV cache), so attention is causal within a row only, exactly the engine's
    prefill of one prompt per row; positions restart at 0 in every row. A batch with ``loss_start``
    leaves each row's positions before it out of the language-modelling and MTP losses
    (``Batch.loss_from``); the indexers' KL still covers every position.

    Returns:
        :class:`~mtpspec.training.mtp_loss.MtpLossOutput` (and the target hidden states
        ``[B*L, H]`` and the flat ids / positions / doc_end when ``return_hidden``).
    """
    b, length = batch.input_ids.shape
    ids, pos, doc_end = batch.flat(device)
    meta = build_attention_metadata([length] * b, [length] * b, None, device=device)
    d = mtp.num_mtp_layers if mtp_depth is None else mtp_depth

    def logits_fn(h: torch.Tensor, k):
        return target.compute_logits(h) if k is None else mtp.compute_logits(h, k)

    def mtp_forward(ids_k: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor, k: int) -> torch.Tensor:
        return mtp(ids_k, positions, prev, spec_step_idx=k)

    if dsa is not None:
        valid = torch.arange(ids.numel(), device=device) < doc_end
        collect = dsa.collect(valid=valid, measure=measure_dsa)
    else:
        collect = contextlib.nullcontext()
    with set_forward_context(meta), collect as record:
        hidden = target(ids, pos)
        out: MtpLossOutput = mtp_training_loss(ids, pos, doc_end, hidden, logits_fn, mtp_forward, d, mtp_lambda,
                                               mtp_distill=mtp_distill, loss_from=batch.loss_from(device))
    if record is not None:
        out.indexer_loss = record.loss()
        out.dsa_stats = record.stats()
        if out.indexer_loss is not None and dsa.kl_weight > 0:
            out.loss = out.loss + dsa.kl_weight * out.indexer_loss
    if return_hidden:
        return out, hidden, (ids, pos, doc_end)
    return out
