"""Token sampling from target logits: temperature, top-k, top-p, greedy, seeded inverse-CDF draws.

Random rows draw by inverse transform sampling (one uniform per row from
:mod:`mtpspec.sample.counter_rng`): the token is the first index whose cumulative probability
exceeds ``u * total``. This needs one uniform per decision instead of one per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as device tensors, plus host flags that pick the code path.

    Attributes:
        temperature: ``[N]`` float32; ``0`` marks a greedy row.
        top_k: ``[N]`` int64, ``0`` = off; or ``None`` when no row uses top-k.
        top_p: ``[N]`` float32, ``1`` = off; or ``None`` when no row uses top-p.
        all_greedy / all_random: host booleans (no device sync needed to branch on them).
    """

    temperature: torch.Tensor
    top_k: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool

    @property
    def is_greedy(self) -> torch.Tensor:
        """``[N]`` bool."""
        return self.temperature == 0

    def repeat_interleave(self, n: int) -> "SamplingMetadata":
        """Each row repeated ``n`` times in place (row i -> rows i*n .. i*n+n-1)."""
        rep = lambda t: None if t is None else t.repeat_interleave(n, dim=0)  # noqa: E731
        return SamplingMetadata(rep(self.temperature), rep(self.top_k), rep(self.top_p),
                                self.all_greedy, self.all_random)

    @classmethod
    def build(cls, temperatures: list, top_ks: list, top_ps: list, device: torch.device) -> "SamplingMetadata":
        """From host lists (one entry per row)."""
        t = torch.tensor(temperatures, dtype=torch.float32)
        use_k = any(k > 0 for k in top_ks)
        use_p = any(p < 1.0 for p in top_ps)
        greedy = [x == 0.0 for x in temperatures]
        return cls(
            temperature=t.to(device, non_blocking=True),
            top_k=torch.tensor(top_ks, dtype=torch.int64).to(device, non_blocking=True) if use_k else None,
            top_p=torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True) if use_p else None,
            all_greedy=all(greedy), all_random=not any(greedy))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask logits outside top-k, then outside top-p (of the renormalised top-k survivors), to -inf.

    Args:
        logits: ``[N, V]`` float32 (already divided by the temperature).
        top_k: ``[N]`` int64, values <= 0 or >= V mean "off"; or ``None``.
        top_p: ``[N]`` float32 in (0, 1]; or ``None``.

    Returns:
        A new ``[N, V]`` tensor; the most likely token of each row always survives.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k).clamp(max=vocab)
        drop |= ranks >= k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        drop |= (before >= top_p.unsqueeze(1)) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Target distribution per row: softmax(top_k_top_p((logits - max) / T)) in float32.

    Greedy rows (``T == 0``) are computed with ``T = 1``; callers ignore them.
    ``logits``: ``[N, V]`` any float dtype. Returns ``[N, V]`` float32.
    """
    x = logits.float()
    t = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    x = (x - x.max(dim=-1, keepdim=True).values) / t.unsqueeze(1)
    x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
    return x.softmax(dim=-1)


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to ``weights``.

    Args:
        weights: ``[N, V]`` non-negative, each row with a positive sum (need not be normalised).
        uniforms: ``[N]`` in ``[0, 1)``.

    Returns:
        ``[N]`` int64: the first index ``i`` with ``cumsum(weights)[i] > u * sum(weights)``
        (computed in float64), clamped to the last index with positive weight.
    """
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    vocab = weights.shape[-1]
    last_pos = vocab - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(idx, last_pos)


class Sampler(torch.nn.Module):
    """Plain (non-speculative) sampling: one token per row of logits."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[N, V]`` (padding vocab columns already removed).
            meta: per-row parameters.
            uniforms: ``[N]`` float64 in ``[0, 1)`` (:data:`~mtpspec.sample.counter_rng.STREAM_SAMPLE`).

        Returns:
            ``[N]`` int64 token ids: argmax (first maximum) for greedy rows, a draw from
            :func:`compute_probs` for the others.
        """
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        sampled = sample_inverse_cdf(compute_probs(logits, meta), uniforms)
        if meta.all_random:
            return sampled
        return torch.where(meta.is_greedy, greedy, sampled)
