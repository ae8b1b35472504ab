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

The reductions are :func:`mtpspec.ops.argmax.local_top_pairs` and
:func:`~mtpspec.ops.argmax.pick_top_tokens` (Triton kernels on CUDA, at most 2 + 1 launches, no
host sync; torch references ``local_top_pairs_ref`` / ``pick_top_tokens_ref`` otherwise), re-exported
here. At tp 1 the pair all-gather and the pick are skipped: :func:`~mtpspec.ops.argmax.local_argmax`
writes the ids directly (the pick of a single rank's non-sentinel pair is its id).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple, Union

import torch
from torch import nn

from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from mtpspec.ops import skinny_gemm
from mtpspec.ops.argmax import local_argmax, local_top_pairs, pick_top_tokens
from mtpspec.sample.gumbel import GumbelPick, NoiseRows, vocab_parallel_gumbel_sample

__all__ = ["LogitsProcessor", "VocabShardedHead", "local_argmax", "local_top_pairs", "pick_top_tokens"]


class VocabShardedHead(Protocol):
    """What the processor needs from an LM head (``ParallelLMHead`` or a tied ``VocabParallelEmbedding``)."""

    weight: torch.Tensor
    org_vocab_size: int
    embedding_dim: int
    num_embeddings_per_partition: int
    vocab_start_index: int


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

    def _local_logits(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check(lm_head, hidden_states)
        bias: Optional[torch.Tensor] = getattr(lm_head, "bias", None)
        # up to 16 rows the few-row GEMM (H200: 0.94-0.97x cuBLAS's time at Air width), into ``out`` when
        # given (the sampled drafts' kept logits): the same values as without it
        return skinny_gemm.linear(hidden_states, lm_head.weight, bias, out=out)

    def _check(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor) -> None:
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

    def _num_real(self, lm_head: VocabShardedHead) -> int:
        return max(0, min(self.vocab_size - lm_head.vocab_start_index, lm_head.num_embeddings_per_partition))

    def compute_logits(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full logits: local matmul, all-gather along the vocab, padding columns removed.

        Args:
            lm_head: a ``ParallelLMHead`` (or tied embedding), weight ``[per_rank, H]``.
            hidden_states: ``[num_tokens, H]`` in the head's dtype.
            out: optional ``[num_tokens, tp * per_rank]`` contiguous tensor in the head's dtype
                that receives the logits, padding columns included (at tp 1 the local matmul
                writes it, at tp > 1 the all-gather; the result is a view of it): the CUDA-graph
                units of every batch size share one such buffer instead of each keeping its own
                logits in the graph pool.

        Returns:
            ``[num_tokens, vocab_size]`` logits in the head's dtype (a view of the gathered tensor).

        Raises:
            ValueError: wrong hidden shape or vocab size, or ``out`` not a contiguous tensor of that
                shape, dtype and device. TypeError: dtype mismatch.
        """
        tp = get_tensor_model_parallel_world_size()
        width = tp * lm_head.num_embeddings_per_partition
        if out is not None:
            self._check(lm_head, hidden_states)  # a bad hidden_states is named as such, not as a bad out
            if (not isinstance(out, torch.Tensor) or out.shape != (hidden_states.shape[0], width)
                    or out.dtype != lm_head.weight.dtype or not out.is_contiguous()
                    or out.device != hidden_states.device):
                got = (f"{list(out.shape)} {out.dtype} on {out.device}"
                       f"{'' if out.is_contiguous() else ' (not contiguous)'}"
                       if isinstance(out, torch.Tensor) else type(out).__name__)
                raise ValueError(f"LogitsProcessor: out must be a contiguous [{hidden_states.shape[0]}, {width}] "
                                 f"{lm_head.weight.dtype} tensor on {hidden_states.device} ({width}: the vocab "
                                 f"padded to tp x {lm_head.num_embeddings_per_partition} columns), got {got}")
        local = self._local_logits(lm_head, hidden_states, out=out if tp == 1 else None)
        return tensor_model_parallel_all_gather(local, dim=-1, out=out if tp > 1 else None)[:, :self.vocab_size]

    def get_top_tokens(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy tokens ``== torch.argmax(compute_logits(lm_head, hidden_states), -1)``, without the logits.

        One all-gather of ``[1, num_tokens, 2]`` float64 pairs per rank (``16 * num_tokens`` bytes),
        concatenated rank-major to ``[tp, num_tokens, 2]``; no host sync. Launches after the
        matmul (CUDA): local pairs 1-2, all-gather, pick 1; at tp 1 only the local ids (1-2).

        Args / Raises: as :meth:`compute_logits`.

        Returns:
            ``[num_tokens]`` int64 token ids in ``[0, vocab_size)``; ties go to the lowest id and
            NaN counts as the maximum (first NaN wins), as in ``torch.argmax``.
        """
        local = self._local_logits(lm_head, hidden_states)
        if get_tensor_model_parallel_world_size() == 1:  # rank 0 has real columns: its id is the pick
            return local_argmax(local, lm_head.vocab_start_index, self._num_real(lm_head))
        pairs = local_top_pairs(local, lm_head.vocab_start_index, self._num_real(lm_head))
        gathered = tensor_model_parallel_all_gather(pairs.unsqueeze(0), dim=0)
        return pick_top_tokens(gathered)

    def local_vocab_range(self, lm_head: VocabShardedHead) -> Tuple[int, int]:
        """``(vocab_start, num_real)``: this rank's first global id and its real (unpadded) columns."""
        return lm_head.vocab_start_index, self._num_real(lm_head)

    def get_sampled_tokens(self, lm_head: VocabShardedHead, hidden_states: torch.Tensor, temperature: torch.Tensor,
                           rows: Union[torch.Tensor, NoiseRows], out: Optional[GumbelPick] = None,
                           logits_out: Optional[torch.Tensor] = None) -> Tuple[GumbelPick, torch.Tensor]:
        """Tokens drawn from ``softmax(logits / T)`` (argmax where ``T == 0``) by vocab-parallel
        Gumbel-max (:func:`~mtpspec.sample.gumbel.vocab_parallel_gumbel_sample`), and this rank's
        local logits ``[num_tokens, per_rank]`` they were drawn from (kept for the verifier).

        ``temperature``: ``[num_tokens]`` float32; ``rows``: ``[num_tokens]`` int64 noise row hashes
        or a :class:`~mtpspec.sample.gumbel.NoiseRows`. ``out``: where to write the pick (see
        ``vocab_parallel_gumbel_sample``); ``logits_out``: a ``[num_tokens, per_rank]`` buffer
        (model dtype, unit column stride) the LM-head matmul writes into (returned as the logits).
        One all-gather of 16 bytes per token per rank (as :meth:`get_top_tokens`).
        """
        local = self._local_logits(lm_head, hidden_states, logits_out)
        pick = vocab_parallel_gumbel_sample(local, lm_head.vocab_start_index, self._num_real(lm_head),
                                            temperature, rows, out=out)
        return pick, local

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"
