"""Forced acceptance (SYNTHETIC): the verifier accepts drafts at a set rate or a fixed length.

For kernel A/B runs on random-weight models of production shape, whose MTP drafts are almost
never right: forcing the accepted count gives each step the token mix (rows per sequence,
accepted lengths, draft positions reached) of a trained model, although the emitted tokens are
not the model's. Everything measured this way is synthetic and must be marked so.

Per decode row the verifier's result is replaced: ``a`` drafts are "accepted" (emitted as
they are) and the next token is the target's argmax at row ``a`` (its logits score the token
after draft ``a``), so the KV caches and the MTP first pass stay consistent with the tokens
emitted. ``a`` is

* ``mode="length"``: ``min(value, k)`` for every row;
* ``mode="rate"``: the number of leading successes of independent Bernoulli(``value``) draws
  per draft position (so position ``j`` is reached with probability ``value ** j``).

The draws come from a CPU ``torch.Generator`` seeded identically on every rank and consumed
in the same order, so all ranks agree on every ``a`` (same shapes, same collectives).

Installed into a running engine with :func:`enable_forced_acceptance` (``collective_rpc``
replaces each rank runner's ``rejection_sampler``), so no engine file changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mtpspec.sample.rejection_sampler import RejectionOutput, RejectionSampler, assemble_output_tokens


@dataclass(frozen=True)
class ForcedAcceptance:
    """A forced-acceptance setting.

    Attributes:
        mode: ``"rate"`` (per-position acceptance probability) or ``"length"`` (accepted drafts).
        value: the rate in ``[0, 1]`` or the length, an int >= 0.
        seed: seed of the rate draws.
    """

    mode: str
    value: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(float(self.value)):
            raise ValueError(f"forced acceptance {self.mode} must be a finite number, got {self.value!r}")
        if self.mode == "rate":
            if not 0.0 <= float(self.value) <= 1.0:
                raise ValueError(f"forced acceptance rate must be in [0, 1], got {self.value!r}")
        elif self.mode == "length":
            if float(self.value) != int(self.value) or int(self.value) < 0:
                raise ValueError(f"forced accepted length must be an int >= 0, got {self.value!r}")
        else:
            raise ValueError(f"forced acceptance mode must be 'rate' or 'length', got {self.mode!r}")

    @classmethod
    def parse(cls, text: str) -> "ForcedAcceptance":
        """``"rate:0.7"`` or ``"length:2"`` (optionally ``",seed:N"``).

        Raises:
            ValueError: any other form.
        """
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        kv = {}
        for p in parts:
            key, sep, val = p.partition(":")
            if not sep:
                raise ValueError(f"forced acceptance must look like 'rate:0.7' or 'length:2', got {text!r}")
            kv[key.strip()] = val.strip()
        seed = int(kv.pop("seed", 0))
        if len(kv) != 1 or next(iter(kv)) not in ("rate", "length"):
            raise ValueError(f"forced acceptance must look like 'rate:0.7' or 'length:2', got {text!r}")
        mode, val = next(iter(kv.items()))
        try:
            value = float(val)
        except ValueError:
            raise ValueError(f"forced acceptance {mode} must be a number, got {val!r}") from None
        return cls(mode, value, seed)

    def describe(self) -> str:
        v = f"{self.value:g}" if self.mode == "rate" else str(int(self.value))
        return f"{self.mode}:{v}"

    def expected_acceptance_length(self, k: int) -> float:
        """``1 + E[a]`` for ``k`` drafts (ignoring stops)."""
        if self.mode == "length":
            return 1.0 + min(int(self.value), k)
        p = float(self.value)
        return 1.0 + sum(p ** j for j in range(1, k + 1))


class ForcedAcceptanceSampler(RejectionSampler):
    """A :class:`RejectionSampler` whose accepted counts follow a :class:`ForcedAcceptance`."""

    def __init__(self, setting: ForcedAcceptance):
        super().__init__()
        self.setting = setting
        self._gen = torch.Generator().manual_seed(int(setting.seed))

    def forced_counts(self, b: int, k: int) -> torch.Tensor:
        """``[b]`` int64 accepted counts (CPU)."""
        s = self.setting
        if s.mode == "length":
            return torch.full((b,), min(int(s.value), k), dtype=torch.int64)
        ok = torch.rand((b, k), generator=self._gen, dtype=torch.float64) < float(s.value)
        return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)

    def forward(self, draft_token_ids: torch.Tensor, target_logits: torch.Tensor, meta: Any,
                accept_uniforms: Optional[torch.Tensor] = None, sample_uniforms: Optional[torch.Tensor] = None,
                draft_probs: Optional[torch.Tensor] = None, sampled: Optional[Any] = None) -> RejectionOutput:
        """:class:`~mtpspec.sample.rejection_sampler.RejectionSampler`'s signature; ``draft_probs`` and
        ``sampled`` (sampled drafts' q) are ignored: acceptance is forced."""
        b, k = draft_token_ids.shape
        if target_logits.shape[:2] != (b, k + 1):
            raise ValueError(f"target_logits must be [B={b}, k + 1={k + 1}, V], got {tuple(target_logits.shape)}")
        a = self.forced_counts(b, k).to(draft_token_ids.device, non_blocking=True)
        final = target_logits.argmax(dim=-1)
        return RejectionOutput(assemble_output_tokens(draft_token_ids, final, a), a)


def _install_on_rank(runner: Any, setting: Optional[ForcedAcceptance]) -> str:
    runner.rejection_sampler = RejectionSampler() if setting is None else ForcedAcceptanceSampler(setting)
    return type(runner.rejection_sampler).__name__


def enable_forced_acceptance(llm_or_engine: Any, setting: Optional[ForcedAcceptance]) -> None:
    """Install (or, with ``None``, remove) forced acceptance on every rank of a running engine.

    Args:
        llm_or_engine: an ``LLM`` or ``LLMEngine`` (anything with ``collective_rpc`` or an
            ``executor``); call it between steps (before serving, or via ``AsyncLLM.call_in_engine``).
        setting: the :class:`ForcedAcceptance`, or ``None`` for the real verifier.

    Raises:
        ValueError: the engine does plain decoding (no drafts to accept).
    """
    eng = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    if setting is not None and eng.scheduler_config.num_speculative_tokens == 0:
        raise ValueError("forced acceptance needs speculative decoding (num_speculative_tokens >= 1)")
    eng.executor.collective_rpc(_install_on_rank, setting)
