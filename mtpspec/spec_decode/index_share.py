"""MTP index sharing (``index_share_for_mtp_iteration``): one indexer selection per draft round.

In DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5) every MTP layer has its own lightning
indexer. Without sharing, each of the ``k`` draft passes of a round runs it. With sharing, the
MTP layer's indexer runs only in the round's first draft pass (the proposer's *prefill*: the
step's ``1 + k`` target rows per request, or a prefill's prompt), and draft steps ``2 .. k`` reuse
the selection of each request's LAST ACCEPTED row of that pass (the anchor, at position ``p``)
plus the positions drafted since (``p + 1 .. p + j`` at step ``j``, so a step always sees its own
recent tokens)::

    selection(step j of request i) = anchor_sel[i] (index_topk positions <= p_i)  ++  [p_i + 1 .. p_i + j]

With ``context + k <= index_topk`` the anchor selection is every position up to ``p_i``, so
sharing selects exactly what each step's own indexer would (the whole causal context).

How it runs (graph-safe: persistent buffers, modes fixed at capture by the proposer hooks):

* Before the first pass the proposer writes each request's anchor row (its segment start + the
  number of accepted drafts) into ``anchor_rows``; padded batch rows point at row 0.
* ``on_prefill_begin`` sets the ``"record"`` mode: every MTP indexer computes its selection as
  usual and also copies the anchor rows' selection and positions into ``anchor_sel`` /
  ``anchor_pos`` (rows compacted per request: row ``i`` of the buffers is request ``i``'s, never a
  rejected-branch row, never another request's).
* ``on_multi_step_decode_begin`` sets ``"reuse"``: the indexers skip their scoring and return the
  shared selection built from the buffers and the step's positions (keys are still written);
  ``*_end`` hooks return to ``"off"``.

Each MTP layer keeps its own :class:`IndexShareState` (its own anchor selection). The four
public bugs in this path (the known-faults list of the project, item 12) each have a test in
``tests/test_index_share.py``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

MODES = ("off", "record", "reuse")


class IndexShareState:
    """The shared selection of one MTP layer's indexer (module docstring).

    Args:
        index_topk: the indexer's selection width.
        num_speculative_tokens: ``k``; the reuse selection is ``index_topk + k - 1`` wide.
        max_num_seqs: requests per step (buffer rows).
        device: of the buffers.

    Attributes:
        mode: ``"off"`` (the indexer selects), ``"record"`` (selects and records the anchor
            rows), ``"reuse"`` (returns the shared selection).
        anchor_rows: ``[max_num_seqs]`` int64, the first pass's row of each request's anchor.
        anchor_sel: ``[max_num_seqs, index_topk]`` int32 recorded positions (``-1`` = none).
        anchor_pos: ``[max_num_seqs]`` int64 recorded anchor positions.
        num_scoring_calls: eager forwards in which the indexer ran its scoring (a counter for
            tests and metrics; graph replays do not count).
    """

    def __init__(self, index_topk: int, num_speculative_tokens: int, max_num_seqs: int,
                 device: torch.device) -> None:
        if index_topk < 1 or num_speculative_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"IndexShareState: index_topk={index_topk}, k={num_speculative_tokens} and "
                             f"max_num_seqs={max_num_seqs} must be >= 1")
        self.index_topk, self.k, self.max_num_seqs = index_topk, num_speculative_tokens, max_num_seqs
        self.mode = "off"
        self.anchor_rows = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.anchor_sel = torch.full((max_num_seqs, index_topk), -1, dtype=torch.int32, device=device)
        self.anchor_pos = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._extra = torch.arange(1, num_speculative_tokens, dtype=torch.int64, device=device)
        self.num_scoring_calls = 0

    def set_mode(self, mode: str) -> None:
        """Switch mode (the proposer's hooks). Raises ValueError for an unknown mode."""
        if mode not in MODES:
            raise ValueError(f"index share mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def set_anchor_rows(self, rows: torch.Tensor) -> None:
        """``rows [B]``: the first pass's row of each request's last accepted token (``B <=
        max_num_seqs``); the buffer's other rows point at row 0. No host sync.

        Raises:
            ValueError: more requests than ``max_num_seqs``.
        """
        b = rows.shape[0]
        if b > self.max_num_seqs:
            raise ValueError(f"index sharing: {b} requests exceed max_num_seqs={self.max_num_seqs}")
        self.anchor_rows[:b].copy_(rows)
        self.anchor_rows[b:].zero_()

    def record(self, topk_pos: torch.Tensor, positions: torch.Tensor, num_seqs: int) -> None:
        """In the first pass: keep rows ``anchor_rows[:num_seqs]`` of this forward's selection
        ``topk_pos [T, index_topk]`` and positions ``[T]``."""
        rows = self.anchor_rows[:num_seqs]
        self.anchor_sel[:num_seqs].copy_(topk_pos.index_select(0, rows))
        self.anchor_pos[:num_seqs].copy_(positions.index_select(0, rows))

    def shared_selection(self, positions: torch.Tensor) -> torch.Tensor:
        """In a draft step (one row per request, ``positions [n]``): ``[n, index_topk + k - 1]``
        int32, the anchor selection then ``anchor_pos + 1 .. anchor_pos + k - 1`` kept where
        ``<=`` the row's position (else ``-1``)."""
        n = positions.shape[0]
        extra = self.anchor_pos[:n, None] + self._extra[None, :]
        extra = torch.where(extra <= positions[:, None].long(), extra, torch.full_like(extra, -1))
        return torch.cat([self.anchor_sel[:n], extra.to(torch.int32)], dim=1)


def attach_index_share(draft_model: nn.Module, num_speculative_tokens: int, max_num_seqs: int) -> List[IndexShareState]:
    """Give every indexer of ``draft_model`` (its MTP layers') its own :class:`IndexShareState`.

    Returns:
        The states, in module order.

    Raises:
        ValueError: the draft model has no indexer (index sharing needs a DSA model).
    """
    from mtpspec.layers.indexer import Indexer
    states = []
    for m in draft_model.modules():
        if isinstance(m, Indexer):
            device = next(m.parameters()).device
            m.share = IndexShareState(m.index_topk, num_speculative_tokens, max_num_seqs, device)
            states.append(m.share)
    if not states:
        raise ValueError(f"index_share_for_mtp_iteration=True but the draft model {type(draft_model).__name__} "
                         "has no indexer (sparse-attention models only: DeepSeek-V3.2, GLM-5)")
    return states


def share_state(module: nn.Module) -> Optional[IndexShareState]:
    """The :class:`IndexShareState` attached to an indexer, or ``None``."""
    return getattr(module, "share", None)


__all__ = ["IndexShareState", "MODES", "attach_index_share", "share_state"]
