"""The proposer interface: what the model runner needs from a way of drafting tokens.

``SpeculativeConfig.method`` picks the proposer class from :data:`PROPOSERS`
(:func:`build_proposer`). Per step the runner calls :meth:`Proposer.propose` once, after
verification; when it captures CUDA graphs it asks :meth:`Proposer.graph_units` which
draft-model calls to capture.

Lifecycle hooks (no-ops by default; a proposer whose attention keeps state across its draft
steps, e.g. sparse-attention indices shared by every step, overrides them). A step's proposing
has two phases, and each is bracketed by a pair of hooks:

* *prefill*: the first pass over the step's flattened target layout (prompts or prompt chunks
  of prefills, the ``1 + k`` rows of decodes; it fills the draft model's KV cache).
  ``on_prefill_begin(attn_metadata)`` / ``on_prefill_end(attn_metadata)``, with the layout
  of that pass.
* *multi-step decode*: the ``k - 1`` single-token draft steps (one row per sequence).
  ``on_multi_step_decode_begin(num_seqs, num_steps)`` /
  ``on_multi_step_decode_end(num_seqs, num_steps)``, with ``num_steps = k - 1`` (also for
  ``k = 1``, where ``num_steps`` is 0).

Who calls them: at run time :meth:`Proposer.propose` (part of its contract, in the order
prefill begin, first pass, prefill end, decode begin, draft steps, decode end); during CUDA-graph
capture the runner's graphed forward (``mtpspec.engine.forward.GraphedForward.capture``), per
padded batch size ``Bp``: ``on_prefill_begin/end`` around capturing the first-pass units (with the
captured static-buffer layout: device tensors only, no host lists) and
``on_multi_step_decode_begin/end(Bp, k - 1)`` around capturing the draft-step units. Hooks run on
the host outside any graph, before a replay as before a capture; they must not synchronise
with the device.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Type

import torch
from torch import nn

from mtpspec.config import SpeculativeConfig
from mtpspec.layers.attention import AttentionMetadata
from mtpspec.spec_decode.draft_forward import DraftForward, DraftTokenFn
from mtpspec.step_io import PreparedStep


@dataclass(frozen=True)
class GraphUnits:
    """The draft-model calls of a pure-decode step, captured once per padded batch size.

    Attributes:
        first_pass_layers: ``spec_step_idx`` of every first-pass call, in call order (the MTP
            layers of the first pass); the first of them is a :meth:`DraftForward.mtp_first_top`
            call applying ``draft_fn`` (when there is one), the others :meth:`DraftForward.mtp_first`.
        step_units: ``(spec_step_idx, with_draft)`` of every distinct
            :meth:`DraftForward.mtp_step` call: ``with_draft`` when the step applies
            ``draft_fn`` (``top``), else a cache-filling call (``top=None``).
        draft_fn: the draft-token function the ``with_draft`` steps apply, or ``None``.
    """

    first_pass_layers: Tuple[int, ...] = ()
    step_units: Tuple[Tuple[int, bool], ...] = ()
    draft_fn: Optional[DraftTokenFn] = None


class Proposer(ABC):
    """Drafts ``k`` tokens per sequence after each verification (see the module docstring)."""

    k: int

    @classmethod
    @abstractmethod
    def from_config(cls, spec: SpeculativeConfig, draft_model: nn.Module, *, block_size: int,
                    max_position: int, max_num_seqs: int = 256) -> "Proposer":
        """Build from the speculative config, the loaded draft model, the KV block size, the
        models' position limit and the most requests per step. Raises ``ValueError`` /
        ``TypeError`` on an unusable combination."""

    @abstractmethod
    def propose(self, inp: PreparedStep, target_hidden: torch.Tensor, new_token_ids: torch.Tensor,
                last_row_offsets: torch.Tensor, host_last_row_offsets: Optional[list] = None,
                fwd: Optional[DraftForward] = None, k: Optional[int] = None) -> torch.Tensor:
        """Draft ``k`` tokens per sequence (``k``: ``1 ..`` the configured ``k``; ``None``: that one).

        Args:
            inp: the step's prepared inputs (target layout, block tables, positions); ``B``
                sequences, ``T`` rows.
            target_hidden: ``[T, H]`` the target's post-norm hidden states of this step.
            new_token_ids: ``[B]`` int64, each sequence's newest token (sampled / recovered / bonus;
                the next prompt token for a partial prefill chunk, whose drafts are dropped).
            last_row_offsets: ``[B]`` int64, the row of each sequence's last valid hidden state
                inside its segment (accepted drafts for a decode, ``q - 1`` for a prefill).
            host_last_row_offsets: the same as a python list when it is free to have (CPU), else ``None``.
            fwd: how to call the draft model (default: eagerly).

        Returns:
            ``[B, k]`` int64 draft tokens, on the device; no host synchronisation.
        """

    def write_kv_only(self, inp: PreparedStep, target_hidden: torch.Tensor, new_token_ids: torch.Tensor,
                      last_row_offsets: Optional[torch.Tensor], fwd: Optional[DraftForward] = None) -> None:
        """A step that proposes no drafts (adaptive speculation length, ``k = 0``): only what the
        draft model must keep up to date (its KV caches at the step's positions); arguments as
        :meth:`propose`, except that ``last_row_offsets`` is ``None`` when every sequence has one
        row (then ``new_token_ids`` is one per row). Default: nothing."""

    def write_kv_rows(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                      meta: AttentionMetadata, fwd: Optional[DraftForward] = None) -> None:
        """The draft model's KV entries of given rows (position, target hidden state, next token;
        the catch-up of deferred entries, :mod:`mtpspec.spec_decode.deferred_mtp`). Default:
        nothing (a proposer without caches)."""

    @abstractmethod
    def graph_units(self) -> GraphUnits:
        """The draft-model calls :meth:`propose` makes in a pure-decode step (for graph capture)."""

    def on_prefill_begin(self, attn_metadata: AttentionMetadata) -> None:
        """Before the first pass (see the module docstring for when, and with which layout)."""

    def on_prefill_end(self, attn_metadata: AttentionMetadata) -> None:
        """After the first pass (every layer's), before the draft steps."""

    def on_multi_step_decode_begin(self, num_seqs: int, num_steps: int) -> None:
        """Before the ``num_steps = k - 1`` single-token draft steps of ``num_seqs`` sequences."""

    def on_multi_step_decode_end(self, num_seqs: int, num_steps: int) -> None:
        """After the draft steps."""


PROPOSERS: Dict[str, str] = {
    "mtp": "mtpspec.spec_decode.mtp_proposer:MTPProposer",
}
"""``SpeculativeConfig.method`` -> ``"module:Class"`` of its :class:`Proposer` (imported on use).
Adding a proposer: a module with a :class:`Proposer` subclass, and one line here."""


def get_proposer_cls(method: str) -> Type[Proposer]:
    """The :class:`Proposer` class of ``method``. Raises ``ValueError`` for an unknown method."""
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; known: {sorted(PROPOSERS)}")
    module, _, name = PROPOSERS[method].partition(":")
    return getattr(importlib.import_module(module), name)


def build_proposer(spec: SpeculativeConfig, draft_model: nn.Module, *, block_size: int,
                   max_position: int, max_num_seqs: int = 256) -> Proposer:
    """The proposer of ``spec.method`` over ``draft_model``. Raises what
    :func:`get_proposer_cls` and the class's ``from_config`` raise."""
    return get_proposer_cls(spec.method).from_config(spec, draft_model, block_size=block_size,
                                                     max_position=max_position, max_num_seqs=max_num_seqs)
