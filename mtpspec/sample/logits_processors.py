"""Per-request edits of the target's logits before sampling and verification: ``logit_bias``,
``min_tokens`` and the presence / frequency / repetition penalties (vLLM's definitions).

For the rows of a step's logits that belong to sequences with any of these set, in this order
(vLLM's sampler order):

1. ``logit_bias``: ``x[t] += bias[t]``;
2. ``min_tokens``: while fewer than ``min_tokens`` tokens precede the row's position, the EOS
   ids and ``stop_token_ids`` get ``x[t] = -inf``;
3. repetition penalty ``r``: for every token in the prompt or in the output so far,
   ``x[t] = x[t] / r`` if ``x[t] > 0`` else ``x[t] * r``;
4. frequency penalty ``f`` and presence penalty ``p``: ``x[t] -= f * count[t] + p * (count[t] > 0)``,
   ``count`` = occurrences in the output so far (not the prompt).

The result is the distribution the sampler (greedy argmax or temperature / top-k / top-p) and
the rejection sampler read, so speculative rejection sampling stays exact for the edited
distribution and greedy verification compares drafts with its argmax.

**"So far" inside a verification block.** Row ``j`` of a decode's ``1 + k`` rows scores the
position after draft ``j - 1``; it is only used (its token emitted) when drafts ``0 .. j - 1``
were accepted, and then those drafts are output tokens that precede it. So row ``j`` counts the
output tokens before the step plus drafts ``0 .. j - 1``, and ``min_tokens`` masks it while
``num_output_tokens + j < min_tokens``. Each row is then exactly the row plain decoding would
see at that position, which makes greedy speculative decoding equal greedy plain decoding and
seeded samples equal across ``k`` (:mod:`mtpspec.sample.counter_rng`).

Cost and graph-safety: everything here runs eagerly on the logits the (possibly graphed) verify
forward returned, after the captured region; the index tensors are built on the host in
:func:`~mtpspec.engine.input_prep.prepare_step` and copied with the step's other inputs, so
applying the edits adds no host sync. Only rows of sequences that use a parameter are touched;
the count / prompt tensors are ``[num_sequences, V]`` and ``[num_rows, V]`` over those only, and
a step without any such sequence skips this module entirely. Host side, the engine is stateless
across steps: a penalised sequence's :class:`SeqLogitsParams` carries its output token ids (and,
with a repetition penalty, its distinct prompt ids) to every rank in every step, O(length) per
step for those sequences only; persistent per-rank counts updated with each step's new tokens
(vLLM's ``output_bin_counts``) would make that O(new tokens) and are not built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch


@dataclass
class SeqLogitsParams:
    """What one sequence asks of its logits in a step (host data, part of a ``SeqInput``).

    Attributes:
        presence_penalty, frequency_penalty, repetition_penalty: as in
            :class:`~mtpspec.sampling_params.SamplingParams` (0, 0, 1 = off).
        output_token_ids: the sequence's output tokens before this step (what the penalties
            count); empty when no penalty is set.
        prompt_token_ids: the prompt's distinct ids (the repetition penalty's prompt mask);
            empty unless ``repetition_penalty != 1``.
        logit_bias: ``(token id, bias)`` pairs, distinct ids.
        min_tokens_remaining: ``max(0, min_tokens - len(output_token_ids))``: rows
            ``j < min_tokens_remaining`` of the sequence have ``suppressed_token_ids`` masked.
        suppressed_token_ids: the EOS ids and stop token ids (distinct, inside the vocabulary).
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_token_ids: List[int] = field(default_factory=list)
    prompt_token_ids: List[int] = field(default_factory=list)
    logit_bias: List[Tuple[int, float]] = field(default_factory=list)
    min_tokens_remaining: int = 0
    suppressed_token_ids: List[int] = field(default_factory=list)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_noop(self) -> bool:
        """True when nothing would change the logits."""
        return not (self.uses_penalties or self.logit_bias
                    or (self.min_tokens_remaining > 0 and self.suppressed_token_ids))


@dataclass
class LogitsProcessorMetadata:
    """Device tensors of one step's logits edits (build with :meth:`build`).

    ``P`` = processed rows (rows of the step's logits), ``S`` = their sequences. Index tensors
    address ``x = logits[rows]`` (local row ``0 .. P - 1``) or the ``S`` sequences.

    Attributes:
        rows: ``[P]`` int64 rows of the step's logits.
        bias_rows, bias_tokens, bias_values: ``logit_bias`` entries (or ``None``).
        mask_rows, mask_tokens: ``min_tokens`` entries set to ``-inf`` (or ``None``).
        has_penalties: host flag; the fields below are ``None`` without it.
        row_seq: ``[P]`` int64 sequence of each row.
        out_seq, out_tokens: one entry per output token before the step (sequence, token).
        draft_rows, draft_tokens: one entry per draft ``i < j`` of each row ``j`` (or ``None``).
        prompt_seq, prompt_tokens: distinct prompt ids of sequences with a repetition penalty.
        presence, frequency, repetition: ``[P]`` float32 per row.
        any_repetition: host flag.
    """

    rows: torch.Tensor
    bias_rows: Optional[torch.Tensor] = None
    bias_tokens: Optional[torch.Tensor] = None
    bias_values: Optional[torch.Tensor] = None
    mask_rows: Optional[torch.Tensor] = None
    mask_tokens: Optional[torch.Tensor] = None
    has_penalties: bool = False
    num_seqs: int = 0
    row_seq: Optional[torch.Tensor] = None
    out_seq: Optional[torch.Tensor] = None
    out_tokens: Optional[torch.Tensor] = None
    draft_rows: Optional[torch.Tensor] = None
    draft_tokens: Optional[torch.Tensor] = None
    prompt_seq: Optional[torch.Tensor] = None
    prompt_tokens: Optional[torch.Tensor] = None
    presence: Optional[torch.Tensor] = None
    frequency: Optional[torch.Tensor] = None
    repetition: Optional[torch.Tensor] = None
    any_repetition: bool = False

    @classmethod
    def build(cls, seqs: Sequence[Tuple[Sequence[int], Sequence[int], SeqLogitsParams]],
              device: torch.device) -> Optional["LogitsProcessorMetadata"]:
        """From ``(rows, drafts, params)`` per sequence; ``None`` when nothing changes the logits.

        Args:
            seqs: for each sequence, the rows of the step's logits it owns in position order
                (``1 + k`` for a decode, 1 for a prefill or a plain decode), the drafts those
                rows are conditioned on (row ``j`` follows ``drafts[:j]``; empty for one row),
                and its :class:`SeqLogitsParams`.
            device: where the tensors go (one non-blocking host-to-device copy each).
        """
        seqs = [s for s in seqs if not s[2].is_noop]
        if not seqs:
            return None
        rows: List[int] = []
        bias_r: List[int] = []
        bias_t: List[int] = []
        bias_v: List[float] = []
        mask_r: List[int] = []
        mask_t: List[int] = []
        row_seq: List[int] = []
        pres: List[float] = []
        freq: List[float] = []
        rep: List[float] = []
        out_s: List[np.ndarray] = []
        out_t: List[np.ndarray] = []
        draft_r: List[int] = []
        draft_t: List[int] = []
        prompt_s: List[np.ndarray] = []
        prompt_t: List[np.ndarray] = []
        has_pen = any(p.uses_penalties for _, _, p in seqs)
        for si, (seq_rows, drafts, p) in enumerate(seqs):
            if len(drafts) < len(seq_rows) - 1:
                raise ValueError(f"{len(seq_rows)} rows need {len(seq_rows) - 1} drafts, got {len(drafts)}")
            bias = list(p.logit_bias)
            for j, _ in enumerate(seq_rows):
                r = len(rows) + j
                for t, b in bias:
                    bias_r.append(r)
                    bias_t.append(t)
                    bias_v.append(b)
                if j < p.min_tokens_remaining:
                    mask_r.extend([r] * len(p.suppressed_token_ids))
                    mask_t.extend(p.suppressed_token_ids)
                if has_pen:
                    row_seq.append(si)
                    pres.append(p.presence_penalty)
                    freq.append(p.frequency_penalty)
                    rep.append(p.repetition_penalty)
                    if p.uses_penalties:
                        draft_r.extend([r] * j)
                        draft_t.extend(drafts[:j])
            if has_pen and p.uses_penalties:
                if p.output_token_ids:
                    t = np.asarray(p.output_token_ids, dtype=np.int64)
                    out_s.append(np.full(t.shape, si, dtype=np.int64))
                    out_t.append(t)
                if p.repetition_penalty != 1.0 and p.prompt_token_ids:
                    t = np.asarray(p.prompt_token_ids, dtype=np.int64)
                    prompt_s.append(np.full(t.shape, si, dtype=np.int64))
                    prompt_t.append(t)
            rows.extend(seq_rows)

        def dev(a, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            arr = np.concatenate(a) if a and isinstance(a[0], np.ndarray) else np.asarray(a)
            return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=dtype, non_blocking=True)

        meta = cls(rows=dev(rows))
        if bias_r:
            meta.bias_rows, meta.bias_tokens, meta.bias_values = dev(bias_r), dev(bias_t), dev(bias_v, torch.float32)
        if mask_r:
            meta.mask_rows, meta.mask_tokens = dev(mask_r), dev(mask_t)
        if has_pen:
            meta.has_penalties, meta.num_seqs = True, len(seqs)
            meta.row_seq = dev(row_seq)
            meta.presence, meta.frequency, meta.repetition = (dev(pres, torch.float32), dev(freq, torch.float32),
                                                              dev(rep, torch.float32))
            if out_t:
                meta.out_seq, meta.out_tokens = dev(out_s), dev(out_t)
            if draft_r:
                meta.draft_rows, meta.draft_tokens = dev(draft_r), dev(draft_t)
            if prompt_t:
                meta.any_repetition = True
                meta.prompt_seq, meta.prompt_tokens = dev(prompt_s), dev(prompt_t)
            elif any(r != 1.0 for r in rep):
                meta.any_repetition = True  # repetition over output tokens only (empty prompt set)
        return meta


def apply_logits_processors(logits: torch.Tensor, meta: Optional[LogitsProcessorMetadata]) -> torch.Tensor:
    """The step's logits with every sequence's edits applied (see the module docstring).

    Args:
        logits: ``[R, V]`` rows of the step (any float dtype); never modified.
        meta: from :meth:`LogitsProcessorMetadata.build`, or ``None`` (no edits).

    Returns:
        ``logits`` itself when ``meta`` is ``None``; otherwise a new ``[R, V]`` float32 tensor
        (unprocessed rows converted unchanged). No host sync.
    """
    if meta is None:
        return logits
    x = logits.index_select(0, meta.rows).float()  # [P, V], a new tensor
    vocab = x.shape[1]
    if meta.bias_rows is not None:
        x.index_put_((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
    if meta.mask_rows is not None:
        x.index_put_((meta.mask_rows, meta.mask_tokens),
                     torch.full(meta.mask_rows.shape, float("-inf"), dtype=x.dtype, device=x.device))
    if meta.has_penalties:
        counts = torch.zeros(meta.num_seqs, vocab, dtype=torch.int32, device=x.device)
        if meta.out_tokens is not None:
            counts.index_put_((meta.out_seq, meta.out_tokens), torch.ones_like(meta.out_tokens, dtype=torch.int32),
                              accumulate=True)
        counts = counts.index_select(0, meta.row_seq)  # [P, V]
        if meta.draft_rows is not None:
            counts.index_put_((meta.draft_rows, meta.draft_tokens),
                              torch.ones_like(meta.draft_tokens, dtype=torch.int32), accumulate=True)
        occurred = counts > 0
        if meta.any_repetition:
            seen = occurred
            if meta.prompt_tokens is not None:
                prompt = torch.zeros(meta.num_seqs, vocab, dtype=torch.bool, device=x.device)
                prompt.index_put_((meta.prompt_seq, meta.prompt_tokens),
                                  torch.ones_like(meta.prompt_tokens, dtype=torch.bool))
                seen = seen | prompt.index_select(0, meta.row_seq)
            pen = torch.where(seen, meta.repetition.unsqueeze(1), torch.ones_like(x))
            x = torch.where(x > 0, x / pen, x * pen)
        x = x - meta.frequency.unsqueeze(1) * counts.to(x.dtype) - meta.presence.unsqueeze(1) * occurred.to(x.dtype)
    return logits.float().index_copy(0, meta.rows, x)
