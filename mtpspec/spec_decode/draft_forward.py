"""How a proposer calls its draft model: the :class:`DraftForward` protocol and its eager form.

A proposer never calls the draft model directly: it goes through a :class:`DraftForward`
passed in by the model runner, so the runner decides how each call runs (eagerly, or for a
pure-decode step through padded static buffers replayed as CUDA graphs;
``mtpspec.engine.forward`` implements both). Defined here, outside ``engine/``, so that
``spec_decode/`` does not import the engine. :class:`EagerDraftForward` is the plain form (the
runner's ``EagerForward`` extends it with the target's calls).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple

import torch

from mtpspec.layers.attention import AttentionMetadata, set_forward_context

DraftTokenFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``(hidden [N, H], spec_step_idx) -> [N]`` int64 greedy draft token ids (the proposer's
``graph_units().draft_fn``; called inside a draft step, so graph capture records it too)."""


class DraftForward(Protocol):
    """The draft-model calls a proposer may make (implemented by the model runner's forward)."""

    def mtp_first(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                  spec_step_idx: int) -> torch.Tensor:
        """First pass over the step's flattened target layout.

        Args:
            ids: ``[T]`` int64 input ids; pos: ``[T]`` int64 positions.
            hidden: ``[T, H]`` the target's post-norm hidden states (model dtype).
            meta: the target's attention layout (``PreparedStep.attn_metadata``).
            spec_step_idx: picks the MTP layer (``spec_step_idx % num_mtp_layers``).

        Returns:
            ``[T, H]`` post-norm hidden states of the draft model.
        """
        ...

    def mtp_first_top(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                      spec_step_idx: int, last_rows: torch.Tensor, top: DraftTokenFn
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`mtp_first`, then each sequence's last valid row and its draft token, in one call
        (so a graphed forward replays the row pick and ``top`` inside the first pass's graph).

        Args:
            ids, pos, hidden, meta, spec_step_idx: as in :meth:`mtp_first`.
            last_rows: ``[B]`` int64 row of each sequence's last valid hidden state in the layout.
            top: the draft-token function.

        Returns:
            ``([B, H]`` the draft model's hidden states of those rows, ``[B]`` int64 draft tokens``)``.
        """
        ...

    def mtp_step(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                 spec_step_idx: int, top: Optional[DraftTokenFn]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One single-token draft step: one row per sequence.

        Args:
            ids: ``[B]`` int64; pos: ``[B]`` int64; hidden: ``[B, H]`` the previous output.
            meta: one query row per sequence.
            spec_step_idx: as in :meth:`mtp_first`.
            top: the draft-token function, or ``None`` (a cache-filling pass, no tokens).

        Returns:
            ``([B, H]`` hidden states, ``[B]`` int64 draft tokens or ``None)``.
        """
        ...

    def mtp_kv_only(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    spec_step_idx: int) -> None:
        """The first pass's KV-cache writes only (a step without drafts, k = 0): the draft model's
        ``forward_kv_only``. Arguments as :meth:`mtp_first`; returns ``None``."""
        ...


class EagerDraftForward:
    """Calls the draft model directly under :func:`set_forward_context` (a :class:`DraftForward`).

    Args:
        mtp: the draft model (``forward(input_ids, positions, previous_hidden_states,
            spec_step_idx)``) or ``None`` (plain decoding; then never called).
    """

    def __init__(self, mtp: Optional[torch.nn.Module]):
        self.mtp_model = mtp

    def mtp_first(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                  spec_step_idx: int) -> torch.Tensor:
        with set_forward_context(meta):
            return self.mtp_model(ids, pos, hidden, spec_step_idx=spec_step_idx)

    def mtp_first_top(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                      spec_step_idx: int, last_rows: torch.Tensor, top: DraftTokenFn
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.mtp_first(ids, pos, hidden, meta, spec_step_idx).index_select(0, last_rows)
        return out, top(out, spec_step_idx)

    def mtp_step(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                 spec_step_idx: int, top: Optional[DraftTokenFn]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        with set_forward_context(meta):
            out = self.mtp_model(ids, pos, hidden, spec_step_idx=spec_step_idx)
        return out, (top(out, spec_step_idx) if top is not None else None)

    def mtp_kv_only(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    spec_step_idx: int) -> None:
        with set_forward_context(meta):
            self.mtp_model.forward_kv_only(ids, pos, hidden, spec_step_idx=spec_step_idx)
