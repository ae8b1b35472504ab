"""Training loss of a target model with D MTP layers (DeepSeek-V3 report, section 2.2).

Layout: one flattened batch of ``N`` tokens made of documents laid end to end (the engine's
varlen layout). ``doc_end[i]`` is the exclusive end index of the document holding token ``i``;
positions restart at 0 in every document.

Target (next-token) loss: row ``i`` predicts ``t[i + 1]`` (rows with ``i + 1 >= doc_end[i]`` are
ignored).

MTP depth ``k`` (1..D), eqs. 21-25: row ``i`` combines the previous depth's hidden state at ``i``
(depth 0 = the target's final *post-norm* hidden state ``h_i``, mtpspec's inference convention)
with the embedding of ``t[i + k]``::

    h'_i^k = M_k [ RMSNorm(h_i^{k-1}) ; RMSNorm(Emb(t_{i+k})) ]      (eq. 21, enorm/hnorm/eh_proj)
    h_{1:T-k}^k = TRM_k(h'_{1:T-k}^k)                                 (eq. 22, mtp_block)
    P_{i+k+1}^k = OutHead(h_i^k)                                      (eq. 23, shared_head)
    L_MTP^k = mean over valid i of CE(P_{i+k+1}^k, t[i + k + 1])      (eq. 24)
    L = L_main + lambda / D * sum_k L_MTP^k                           (eq. 25)

Row ``i`` is valid at depth ``k`` when ``i + k + 1 < doc_end[i]``. Depth ``k`` runs at positions
``positions + (k - 1)``: depth 1 at the target's positions, so the embedding is zeroed exactly at
rows whose position is 0 (the inference rule of ``fused_eh_norm``, applied inside the model's MTP
forward); deeper depths one position further per step, as the engine's draft step ``k`` runs
(its new row sits one position after the previous step's). Rotary attention only sees position
differences, so the shift changes nothing else. Each depth's output hidden state (as the model
returns it: the post-norm state the inference path recycles) feeds the next depth.

Optional self-distillation (``mtp_distill = alpha > 0``, off by default): the label term of
depth ``k`` becomes ``(1 - alpha) * CE(P^k_i, t[i+k+1]) + alpha * H(stopgrad(softmax(z_{i+k})),
P^k_i)``, where ``z_{i+k}`` are the target's logits at row ``i + k``, i.e. the target's own
prediction of the same token ``t[i+k+1]``. Greedy verification accepts a draft when it equals the
*target's* argmax, not the reference text, so this pulls the draft distribution towards the one
it is verified against (DistillSpec, Zhou et al. 2024, section 3: training the draft on the
target's distribution raises acceptance; Medusa-2's self-distillation, Cai et al. 2024, section
2.3.2). The target term is unchanged and gets no gradient from the distillation term.

``D`` may exceed the model's number of MTP layers: depth ``k`` then uses layer
``(k - 1) % num_mtp_layers`` (``spec_step_idx = k - 1``), i.e. the same layer applied recursively
to its own outputs, which is how the engine drafts ``k`` tokens with one MTP layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# mtp_forward(input_ids [N], positions [N], previous_hidden_states [N, H], spec_step_idx) -> [N, H]
MtpForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# logits_fn(hidden [N, H], spec_step_idx or None for the target) -> logits [N, V]
LogitsFn = Callable[[torch.Tensor, "int | None"], torch.Tensor]


@dataclass
class MtpLossOutput:
    """``loss`` (scalar to backprop), ``target_loss`` and per-depth ``mtp_losses`` (detached floats
    are taken by the caller), and per-depth valid-row counts ``counts`` (index 0 = target).

    DSA models (:mod:`mtpspec.training.dsa`, set by :func:`mtpspec.training.step.forward_loss`):
    ``indexer_loss`` is the lightning indexers' ``L^I`` of the forward (already in ``loss`` with
    its weight), ``dsa_stats`` its detached figures; ``None`` / empty otherwise."""

    loss: torch.Tensor
    target_loss: torch.Tensor
    mtp_losses: List[torch.Tensor]
    counts: List[int]
    indexer_loss: Optional[torch.Tensor] = None
    dsa_stats: Dict[str, object] = field(default_factory=dict)


def doc_end_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[S + 1]`` int cumulative lengths -> ``[N]`` exclusive document end of each token.

    Raises:
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, or decreasing.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must be a 1-D tensor starting at 0, got {cu_seqlens.tolist()}")
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if (lens < 0).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return torch.repeat_interleave(cu_seqlens[1:], lens)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]`` positions restarting at 0 at every document start."""
    doc_end = doc_end_from_cu_seqlens(cu_seqlens)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lens)
    return torch.arange(doc_end.numel(), device=cu_seqlens.device) - starts


def shifted(input_ids: torch.Tensor, doc_end: torch.Tensor, shift: int, fill: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``out[i] = input_ids[i + shift]`` where ``i + shift < doc_end[i]``, else ``fill``.

    Returns:
        ``(out [N], valid [N] bool)``.
    """
    n = input_ids.numel()
    idx = torch.arange(n, device=input_ids.device) + shift
    valid = idx < doc_end
    out = torch.full_like(input_ids, fill)
    out[valid] = input_ids[idx[valid]]
    return out, valid


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, int]:
    count = int((labels != IGNORE_INDEX).sum())
    if count == 0:
        return logits.sum() * 0.0, 0
    return F.cross_entropy(_upcast(logits), labels, ignore_index=IGNORE_INDEX, reduction="mean"), count


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 -> fp32 for softmax statistics; fp32 / fp64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _soft_ce(logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, shift: int) -> torch.Tensor:
    """Mean over valid rows ``i`` of ``-sum_v teacher[i + shift, v] * log_softmax(logits[i])_v``."""
    rows = valid.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits.sum() * 0.0
    logp = torch.log_softmax(_upcast(logits[rows]), dim=-1)
    return -(teacher[rows + shift] * logp).sum(-1).mean()


def mtp_training_loss(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    doc_end: torch.Tensor,
    target_hidden: torch.Tensor,
    logits_fn: LogitsFn,
    mtp_forward: MtpForward,
    num_mtp_layers: int,
    mtp_lambda: float,
    mtp_distill: float = 0.0,
    loss_from: Optional[torch.Tensor] = None,
) -> MtpLossOutput:
    """``L_main + mtp_lambda / D * sum_k L_MTP^k`` (DeepSeek-V3 eq. 25) for one flattened batch.

    Args:
        input_ids: ``[N]`` int64 token ids.
        positions: ``[N]`` int64, 0 at each document start.
        doc_end: ``[N]`` int64 exclusive end of each token's document (``doc_end_from_cu_seqlens``).
        target_hidden: ``[N, H]`` the target's final post-norm hidden states.
        logits_fn: ``(hidden, None)`` -> target logits ``[N, V]``; ``(hidden, k - 1)`` -> depth-k
            MTP logits.
        mtp_forward: ``(ids_k, positions + k - 1, previous_hidden, spec_step_idx=k - 1)`` -> depth-k
            hidden.
        num_mtp_layers: training depth D >= 0 (0 trains the target alone).
        mtp_lambda: weight lambda of the MTP term.
        mtp_distill: weight alpha in [0, 1] of the self-distillation term (module docstring);
            0 is the plain eq. 24 loss.
        loss_from: ``[N]`` int64 (optional): position ``i`` counts in every loss only when
            ``i >= loss_from[i]`` (e.g. a prompt's own positions left out); ``None``: all count.

    Returns:
        :class:`MtpLossOutput`.

    Raises:
        ValueError: shapes that disagree, D < 0, or ``mtp_distill`` outside [0, 1].
    """
    n = input_ids.numel()
    if input_ids.dim() != 1 or positions.shape != (n,) or doc_end.shape != (n,):
        raise ValueError(f"input_ids, positions, doc_end must all be [N]; got {tuple(input_ids.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(doc_end.shape)}")
    if target_hidden.dim() != 2 or target_hidden.shape[0] != n:
        raise ValueError(f"target_hidden must be [N={n}, H], got {tuple(target_hidden.shape)}")
    if num_mtp_layers < 0:
        raise ValueError(f"num_mtp_layers must be >= 0, got {num_mtp_layers}")
    if not 0.0 <= mtp_distill <= 1.0:
        raise ValueError(f"mtp_distill must be in [0, 1], got {mtp_distill}")

    keep = None if loss_from is None else torch.arange(n, device=input_ids.device) >= loss_from

    def masked(labels: torch.Tensor) -> torch.Tensor:
        return labels if keep is None else torch.where(keep, labels, torch.full_like(labels, IGNORE_INDEX))

    labels0 = masked(shifted(input_ids, doc_end, 1, IGNORE_INDEX)[0])
    target_logits = logits_fn(target_hidden, None)
    target_loss, c0 = _ce(target_logits, labels0)
    teacher = None
    if mtp_distill > 0 and num_mtp_layers > 0:
        teacher = torch.softmax(_upcast(target_logits.detach()), dim=-1)
    counts, mtp_losses = [c0], []
    prev = target_hidden
    for k in range(1, num_mtp_layers + 1):
        ids_k, _ = shifted(input_ids, doc_end, k, 0)
        labels_k = masked(shifted(input_ids, doc_end, k + 1, IGNORE_INDEX)[0])
        prev = mtp_forward(ids_k, positions + (k - 1), prev, k - 1)
        logits_k = logits_fn(prev, k - 1)
        lk, ck = _ce(logits_k, labels_k)
        if teacher is not None:
            lk = (1.0 - mtp_distill) * lk + mtp_distill * _soft_ce(logits_k, teacher, labels_k != IGNORE_INDEX, k)
        mtp_losses.append(lk)
        counts.append(ck)
    loss = target_loss
    if mtp_losses:
        loss = loss + mtp_lambda / num_mtp_layers * torch.stack(mtp_losses).sum()
    return MtpLossOutput(loss=loss, target_loss=target_loss, mtp_losses=mtp_losses, counts=counts)
