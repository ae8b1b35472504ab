"""Logits from a vocab-parallel LM head, and greedy tokens without gathering the logits.

``compute_logits`` all-gathers every rank's ``[num_tokens, per_rank]`` logits shard.
``get_top_tokens`` instead reduces each shard locally to one ``(max value, global id)`` pair per
token and all-gathers those ``[num_tokens, 2]`` float64 pairs (16 bytes per token per rank, vs
``per_rank * itemsize`` bytes for the logits). Both use the same local matmul, so their local
logits are bit-identical and ``get_top_tokens == compute_logits(...).argmax(-1)``.

Why the local reduction gives the global ``torch.argmax``: rank ``r`` holds the contiguous id
range ``[r * per_rank, (r + 1) * per_rank)``, so ranks are ordered by id. ``torch.argmax`` returns
the first maximum, treating NaN as larger than everything (the first NaN wins). Each rank's local
``argmax`` gives its first maximum (or first NaN); the global first maximum is the local pick of
the first rank, in rank order, whose value is a NaN if any rank has one, else equals the largest
value. Values are exact in float64 (every fp32/bf16/fp16 value is), and so are ids below ``2**53``
(a float32 id would round ids above ``2**24``).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mtpspec.distributed import tensor_model_parallel_all_gather


class VocabShardedHead(Protocol):
    """What the processor needs from an LM head (``ParallelLMHead`` or a tied ``VocabParallelEmbedding``)."""

    weight: torch.Tensor
    org_vocab_size: int
    embedding_dim: int
    num_embeddings_per_partition: int
    vocab_start_index: int


def local_top_pairs(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """Each row's maximum and first arg-max over a shard's real columns.

    Args:
        local_logits: ``[num_tokens, per_rank]`` logits of the shard whose column 0 is global id
            ``vocab_start``; only the first ``num_real`` columns are real (the rest is padding).
        vocab_start: global id of column 0.
        num_real: number of real columns, ``0 <= num_real <= per_rank``.

    Returns:
        ``[num_tokens, 2]`` float64: ``(value, global id)``. With ``num_real == 0`` every row is
        the sentinel ``(-inf, -1)``, which :func:`pick_top_tokens` never selects.

    Raises:
        ValueError: ``local_logits`` is not 2-D or ``num_real`` is out of range.
    """
    if local_logits.dim() != 2:
        raise ValueError(f"local_top_pairs: expected [num_tokens, per_rank] logits, got {list(local_logits.shape)}")
    if not 0 <= num_real <= local_logits.shape[1]:
        raise ValueError(f"local_top_pairs: num_real={num_real} outside [0, {local_logits.shape[1]}]")
    num_tokens = local_logits.shape[0]
    if num_real == 0:
        pairs = torch.empty(num_tokens, 2, dtype=torch.float64, device=local_logits.device)
        pairs[:, 0] = float("-inf")
        pairs[:, 1] = -1.0
        return pairs
    real = local_logits[:, :num_real]
    idx = torch.argmax(real, dim=-1)
    val = real.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return torch.stack([val.to(torch.float64), (idx + vocab_start).to(torch.float64)], dim=-1)


def pick_top_tokens(pairs: torch.Tensor) -> torch.Tensor:
    """Global greedy tokens from every rank's ``(value, id)`` pairs.

    Args:
        pairs: ``[tp, num_tokens, 2]`` float64, rank-major (``pairs[r, t]`` is rank ``r``'s pair
            for token ``t``), as produced by :func:`local_top_pairs` on ranks with increasing id
            ranges. Entries with a negative id are sentinels and never win.

    Returns:
        ``[num_tokens]`` int64: per token, the id of the first rank (in rank order) holding a
        NaN if any rank does, else the first rank whose value equals the largest value — the id
        ``torch.argmax`` returns on the concatenated logits. (A token with no non-sentinel entry
        returns -1; this cannot happen when rank 0 has real columns.)

    Raises:
        ValueError: ``pairs`` is not ``[tp, num_tokens, 2]`` float64.
    """
    if pairs.dim() != 3 or pairs.shape[-1] != 2 or pairs.dtype != torch.float64:
        raise ValueError(f"pick_top_tokens: expected [tp, num_tokens, 2] float64, got {list(pairs.shape)} {pairs.dtype}")
    vals, ids = pairs[..., 0], pairs[..., 1]
    valid = ids >= 0
    is_nan = torch.isnan(vals) & valid
    vmax = vals.masked_fill(~valid, float("-inf")).amax(dim=0, keepdim=True)
    hit = torch.where(is_nan.any(dim=0, keepdim=True), is_nan, valid & (vals == vmax))
    first = torch.argmax(hit.to(torch.uint8), dim=0, keepdim=True)  # first True in rank order
    return ids.gather(0, first).squeeze(0).to(torch.int64)


class LogitsProcessor(nn.Module):
    """Turns final hidden states into logits or greedy token ids through a vocab-parallel LM head.

    Args:
        vocab_size: number of real vocab entries ``V`` (``1 <= V <= lm_head.org_vocab_size``);
            columns ``>= V`` are dropped from logits and never picked.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"LogitsProcessor: vocab_size must be an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def _local_logits(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.vocab_size > lm_head.org_vocab_size:
            raise ValueError(f"LogitsProcessor: vocab_size {self.vocab_size} exceeds the lm head's "
                             f"{lm_head.org_vocab_size} rows")
        h = lm_head.embedding_dim
        if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
            raise ValueError(f"LogitsProcessor: expected hidden_states [num_tokens, {h}], "
                             f"got {list(hidden_states.shape)}")
        if hidden_states.dtype != lm_head.weight.dtype:
            raise TypeError(f"LogitsProcessor: hidden_states dtype {hidden_states.dtype} != "
                            f"lm head dtype {lm_head.weight.dtype}")
        bias: Optional[torch.Tensor] = getattr(lm_head, "bias", None)
        return F.linear(hidden_states, lm_head.weight, bias)

    def _num_real(self, lm_head: VocabShardedHead) -> int:
        return max(0, min(self.vocab_size - lm_head.vocab_start_index, lm_head.num_embeddings_per_partition))

    def compute_logits(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full logits: local matmul, all-gather along the vocab, padding columns removed.

        Args:
            lm_head: a ``ParallelLMHead`` (or tied embedding), weight ``[per_rank, H]``.
            hidden_states: ``[num_tokens, H]`` in the head's dtype.

        Returns:
            ``[num_tokens, vocab_size]`` logits in the head's dtype (a view of the gathered tensor).

        Raises:
            ValueError: wrong hidden shape or vocab size. TypeError: dtype mismatch.
        """
        local = self._local_logits(lm_head, hidden_states)
        return tensor_model_parallel_all_gather(local, dim=-1)[:, :self.vocab_size]

    def get_top_tokens(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy tokens ``== torch.argmax(compute_logits(lm_head, hidden_states), -1)``, without the logits.

        One all-gather of ``[1, num_tokens, 2]`` float64 pairs per rank (``16 * num_tokens`` bytes),
        concatenated rank-major to ``[tp, num_tokens, 2]``; no host sync.

        Args / Raises: as :meth:`compute_logits`.

        Returns:
            ``[num_tokens]`` int64 token ids in ``[0, vocab_size)``; ties go to the lowest id and
            NaN counts as the maximum (first NaN wins), as in ``torch.argmax``.
        """
        local = self._local_logits(lm_head, hidden_states)
        pairs = local_top_pairs(local, lm_head.vocab_start_index, self._num_real(lm_head))
        gathered = tensor_model_parallel_all_gather(pairs.unsqueeze(0), dim=0)
        return pick_top_tokens(gathered)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"
