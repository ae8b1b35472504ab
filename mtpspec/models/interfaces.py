"""Typed capabilities a model may offer to the engine (callers check them explicitly), and
:class:`WeightSpec`, the contract between a model's weight-spec functions and the loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Protocol, Tuple, runtime_checkable

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


@dataclass(frozen=True)
class WeightSpec:
    """Where one checkpoint tensor goes (one value of a weight-spec function's result).

    Attributes:
        param: dotted parameter name inside the module being loaded.
        shape: the full (unsharded) shape the checkpoint tensor must have.
        shard_id: ``weight_loader``'s shard id (``"q"/"k"/"v"``, ``0/1``, ``"w1"/"w3"/"w2"/"w13"``).
        expert_id: the expert for per-expert MoE tensors (``None`` otherwise).
        layout: ``None``, or ``"{experts prefix}:per_expert"`` / ``"{experts prefix}:fused"`` for
            the two alternative expert layouts (exactly one must be present).
        optional: may be absent (``shared_head.head``, MTP ``embed_tokens``, tied ``lm_head``).
        ignored: recognised but not loaded (MTP ``embed_tokens``, a tied ``lm_head``).
        rows: for export, the rows ``[start, stop)`` of the tp-1 parameter (of its
            ``expert_id`` slice for per-expert tensors) that hold this tensor; ``None``: the
            whole parameter, or its first ``shape[0]`` rows when it is padded (the vocab).
        tied_head: an MTP layer's own LM head (one such spec per MTP layer, in layer order):
            when it is absent from the checkpoint the layer uses the target's ``lm_head``.
        tied_to: for an ``ignored`` tensor that a tied config replaces by another (``lm_head.weight``
            under ``tie_word_embeddings``: ``"model.embed_tokens.weight"``), that tensor's key: the
            loader warns when the checkpoint stores a copy that differs from it.
    """

    param: str
    shape: Tuple[int, ...]
    shard_id: Any = None
    expert_id: Optional[int] = None
    layout: Optional[str] = None
    optional: bool = False
    ignored: bool = False
    rows: Optional[Tuple[int, int]] = None
    tied_head: bool = False
    tied_to: Optional[str] = None
