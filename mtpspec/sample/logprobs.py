"""Log-probabilities of emitted and prompt tokens from logits the step already computed.

vLLM's ``logprobs`` semantics with its default ``logprobs_mode`` (``raw_logprobs``): the
distribution is ``log_softmax`` of the raw logits in float32, before ``logit_bias``,
``min_tokens``, penalties, temperature, top-k and top-p. For each scored row: the chosen token's
log-probability, its rank (how many entries are ``>=`` it, vLLM's definition) and the top-``N``
entries (``torch.topk``, most likely first).

Where the rows come from (no extra forward):

* a decode's ``1 + k`` verification rows: row ``j`` is the distribution of the token emitted at
  slot ``j`` (accepted draft, recovered or bonus token), so a token's value does not depend on
  ``k`` or on how many drafts were accepted;
* a prefill's (or a plain decode's) sampled row;
* ``prompt_logprobs``: the prefill's own hidden states, through the LM head in chunks of
  :data:`PROMPT_CHUNK_ROWS` rows (the prefill's logits are otherwise computed for its last row
  only).

Only rows of requests that asked are scored: ``log_softmax`` over ``[rows, V]`` of those rows
and one ``topk`` with the largest ``N`` among them; everything is packed into one float64 block
that leaves the device with the step's tokens (one copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import torch

# Rows of prompt logits materialised at once ([rows, V] float32) for prompt_logprobs.
PROMPT_CHUNK_ROWS = 256


class TokenLogprobs(NamedTuple):
    """Scores at one position (host data, travels in :class:`~mtpspec.step_io.StepOutput`).

    Attributes:
        logprob: the chosen (emitted or prompt) token's log-probability.
        rank: its 1-based rank.
        top_token_ids, top_logprobs: the ``N`` most likely tokens, most likely first.
    """

    logprob: float
    rank: int
    top_token_ids: List[int]
    top_logprobs: List[float]


@dataclass
class LogprobsMetadata:
    """Which rows of a step to score (device index tensors + host sizes).

    Attributes:
        rows: ``[Rs]`` int64 rows of the step's logits (emitted tokens).
        token_index: ``[Rs]`` int64 flat index into the step's ``[B, k + 1]`` token block: the
            token emitted from each row (a placeholder where the row emitted nothing).
        num_top: largest ``N`` over those rows.
        row_counts: host list: scored rows per sequence in batch order (0 for sequences that
            did not ask).
        prompt_rows: ``[Rp]`` int64 rows of the step's hidden states (prompt positions), or ``None``.
        prompt_tokens: ``[Rp]`` int64: the prompt token each of them predicts.
        prompt_num_top: largest ``N`` over the prompt rows.
        prompt_row_counts: host list: prompt rows per sequence in batch order.
    """

    rows: Optional[torch.Tensor]
    token_index: Optional[torch.Tensor]
    num_top: int
    row_counts: List[int]
    prompt_rows: Optional[torch.Tensor]
    prompt_tokens: Optional[torch.Tensor]
    prompt_num_top: int
    prompt_row_counts: List[int]

    @classmethod
    def build(cls, sample: Sequence[Optional[tuple]], prompt: Sequence[Optional[tuple]],
              device: torch.device) -> Optional["LogprobsMetadata"]:
        """From per-sequence requests; ``None`` when no sequence asked.

        Args:
            sample: per sequence ``None`` or ``(rows, token_index, N)``: its rows of the
                step's logits and the matching slots of the token block.
            prompt: per sequence ``None`` or ``(hidden_rows, tokens, N)``.
        """
        if all(s is None for s in sample) and all(p is None for p in prompt):
            return None

        def dev(a: List[int]) -> torch.Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device=device, non_blocking=True)

        rows: List[int] = []
        idx: List[int] = []
        p_rows: List[int] = []
        p_tok: List[int] = []
        for s in sample:
            if s is not None:
                rows.extend(s[0])
                idx.extend(s[1])
        for p in prompt:
            if p is not None:
                p_rows.extend(p[0])
                p_tok.extend(p[1])
        return cls(rows=dev(rows) if rows else None, token_index=dev(idx) if rows else None,
                   num_top=max((s[2] for s in sample if s is not None), default=0),
                   row_counts=[0 if s is None else len(s[0]) for s in sample],
                   prompt_rows=dev(p_rows) if p_rows else None, prompt_tokens=dev(p_tok) if p_rows else None,
                   prompt_num_top=max((p[2] for p in prompt if p is not None), default=0),
                   prompt_row_counts=[0 if p is None else len(p[0]) for p in prompt])


def score_rows(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
    """Pack ``[R, 2 + 2 * N]`` float64: chosen log-probability, rank, top values, top ids, with
    ``N = min(num_top, V)``.

    Args:
        logits: ``[R, V]`` raw logits (any float dtype).
        token_ids: ``[R]`` int64 chosen tokens (negative ids are scored as id 0; callers drop them).
        num_top: alternatives per row, ``>= 0``.

    Float64 holds every float32 value and every id below ``2**53`` exactly. No host sync.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.clamp_min(0).unsqueeze(1))
    rank = (logp >= chosen).sum(dim=-1, keepdim=True)
    parts = [chosen.double(), rank.double()]
    if num_top > 0:
        vals, ids = logp.topk(min(num_top, logp.shape[-1]), dim=-1)
        parts += [vals.double(), ids.double()]
    return torch.cat(parts, dim=1)


def unpack_rows(block: np.ndarray, wanted: int) -> List[TokenLogprobs]:
    """Host side of :func:`score_rows` (``block``: ``[R, 2 + 2 * N]``): one :class:`TokenLogprobs`
    per row, the top lists cut to ``wanted`` entries."""
    out = []
    num_top = (block.shape[1] - 2) // 2
    n = min(wanted, num_top)
    for row in block:
        vals = row[2:2 + n].tolist()
        ids = row[2 + num_top:2 + num_top + n].astype(np.int64).tolist()
        out.append(TokenLogprobs(float(row[0]), int(row[1]), ids, vals))
    return out
