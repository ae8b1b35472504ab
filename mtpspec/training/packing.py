"""Length-bucketed batches of whole documents (no cross-document attention).

Packing choice: every document is its own sequence, with positions from 0 and causal attention
inside it only, exactly as the engine runs a prompt (so the MTP position-0 rule and rotary
positions match inference). Documents are sorted by length and grouped so that a batch holds
documents of similar length, each right-padded to the batch's common length ``L`` (a multiple of
``pad_multiple``, at most ``max_len``), with at most ``tokens_per_batch`` rows x ``L`` tokens. Right
padding never influences real tokens (causal attention) and padded rows carry no loss, so the
cost is only the padded compute (reported as ``pad_fraction``). Equal-length rows let attention
run as one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch

from mtpspec.training.corpus import TokenDocs


@dataclass
class Batch:
    """``input_ids [B, L]`` int64 (pad = ``pad_id``), ``lengths [B]`` int64 real lengths,
    ``loss_start [B]`` int64 (optional): each row's first position whose predictions count."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    loss_start: Optional[torch.Tensor] = None

    @property
    def num_real_tokens(self) -> int:
        return int(self.lengths.sum())

    def flat(self, device: torch.device):
        """Flattened views for the model: ``(input_ids [B*L], positions [B*L], doc_end [B*L])``
        where ``doc_end[i]`` is the exclusive end of row ``i``'s real tokens in flat indexing."""
        b, length = self.input_ids.shape
        ids = self.input_ids.to(device, non_blocking=True).reshape(-1)
        pos = torch.arange(length, device=device).repeat(b)
        row_start = torch.arange(b, device=device) * length
        doc_end = (row_start + self.lengths.to(device)).repeat_interleave(length)
        return ids, pos, doc_end

    def loss_from(self, device: torch.device) -> Optional[torch.Tensor]:
        """``[B*L]`` int64: the flat index from which row ``i``'s positions count in the loss
        (``None`` when every position counts)."""
        if self.loss_start is None:
            return None
        b, length = self.input_ids.shape
        start = torch.arange(b, device=device) * length + self.loss_start.to(device)
        return start.repeat_interleave(length)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def bucket_batches(lengths: np.ndarray, tokens_per_batch: int, max_len: int, rng: np.random.Generator,
                   pad_multiple: int = 16) -> List[np.ndarray]:
    """Group document indices into batches (shuffled order; see the module docstring).

    Args:
        lengths: ``[num_docs]`` token counts (each 1..max_len).
        tokens_per_batch: budget of ``rows x L`` per batch (>= max_len).
        max_len: longest allowed document.
        rng: shuffles ties and the batch order.
        pad_multiple: ``L`` is rounded up to a multiple of this (capped at ``max_len``).

    Raises:
        ValueError: a document longer than ``max_len`` or a budget below ``max_len``.
    """
    if tokens_per_batch < max_len:
        raise ValueError(f"tokens_per_batch={tokens_per_batch} must be >= max_len={max_len}")
    if len(lengths) and (lengths.max() > max_len or lengths.min() < 1):
        raise ValueError(f"document lengths must lie in [1, {max_len}], got [{lengths.min()}, {lengths.max()}]")
    perm = rng.permutation(len(lengths))
    order = perm[np.argsort(lengths[perm], kind="stable")]
    batches: List[np.ndarray] = []
    start = 0
    for i in range(len(order) + 1):
        if i == len(order):
            if i > start:
                batches.append(order[start:i])
            break
        width = min(round_up(int(lengths[order[i]]), pad_multiple), max_len)
        if (i + 1 - start) * width > tokens_per_batch:
            batches.append(order[start:i])
            start = i
    rng.shuffle(batches)
    return batches


def make_batch(docs: TokenDocs, idx: np.ndarray, pad_id: int, max_len: int, pad_multiple: int = 16) -> Batch:
    """Right-padded ``[len(idx), L]`` batch of documents ``idx``."""
    lens = docs.lengths[idx]
    width = min(round_up(int(lens.max()), pad_multiple), max_len)
    out = np.full((len(idx), width), pad_id, dtype=np.int64)
    for r, d in enumerate(idx):
        seq = docs.doc(int(d))
        out[r, :len(seq)] = seq
    start = None if docs.loss_start is None else torch.from_numpy(docs.loss_start[idx].astype(np.int64))
    return Batch(torch.from_numpy(out), torch.from_numpy(lens.astype(np.int64)), start)


def iterate_batches(docs: TokenDocs, tokens_per_batch: int, max_len: int, pad_id: int, seed: int,
                    pad_multiple: int = 16) -> Iterator[Batch]:
    """Endless batches: pass after pass over ``docs``, re-bucketed with a new shuffle each pass."""
    rng = np.random.default_rng(seed)
    if len(docs) == 0:
        raise ValueError("no training documents")
    while True:
        for idx in bucket_batches(docs.lengths, tokens_per_batch, max_len, rng, pad_multiple):
            yield make_batch(docs, idx, pad_id, max_len, pad_multiple)


def pad_fraction(docs: TokenDocs, tokens_per_batch: int, max_len: int, seed: int = 0, pad_multiple: int = 16) -> float:
    """Fraction of padded token slots over one pass (diagnostic)."""
    rng = np.random.default_rng(seed)
    real = padded = 0
    for idx in bucket_batches(docs.lengths, tokens_per_batch, max_len, rng, pad_multiple):
        lens = docs.lengths[idx]
        real += int(lens.sum())
        padded += len(idx) * min(round_up(int(lens.max()), pad_multiple), max_len)
    return 1.0 - real / max(padded, 1)
