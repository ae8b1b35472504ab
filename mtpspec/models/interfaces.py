"""Typed capabilities a model may offer to the engine; callers check them explicitly."""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch


@runtime_checkable
class SupportsLocalArgmax(Protocol):
    """A model whose greedy tokens come from a vocab-parallel local argmax.

    ``get_top_tokens(hidden_states [num_tokens, H], spec_step_idx=0) -> [num_tokens] int64``
    equals ``compute_logits(hidden_states, spec_step_idx).argmax(-1)`` but all-gathers one
    ``[num_tokens, 2]`` float64 (value, id) pair per rank instead of the ``[num_tokens, V]``
    logits (:meth:`mtpspec.layers.logits_processor.LogitsProcessor.get_top_tokens`).
    ``spec_step_idx`` picks the MTP layer (``spec_step_idx % num_mtp_layers``); a target model
    ignores it. Check with ``isinstance(model, SupportsLocalArgmax)`` or
    :func:`supports_local_argmax`.
    """

    supports_local_argmax: ClassVar[Literal[True]]

    def get_top_tokens(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        ...


def supports_local_argmax(model: object) -> bool:
    """Whether ``model`` implements :class:`SupportsLocalArgmax` (and says so)."""
    return isinstance(model, SupportsLocalArgmax) and getattr(model, "supports_local_argmax", False) is True
