"""What the scheduler (rank 0) sends every rank for one step, and what rank 0 sends back.

Plain picklable host data: every rank receives the same :class:`StepInput`, runs the same
forwards and therefore issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class SeqInput:
    """One sequence of the flattened batch.

    Attributes:
        input_token_ids: the target's new tokens: the whole prompt (+ earlier outputs after a
            preemption) for a prefill, ``[last token] + k drafts`` for a decode.
        start_position: absolute position of ``input_token_ids[0]`` (= KV entries already valid).
        block_table: the sequence's KV blocks (covering every slot the step writes).
        is_prefill: prefill (sample from the last row) or decode (verify ``k`` drafts).
        temperature, top_k, top_p: sampling parameters (``temperature == 0``: greedy).
        seed_key: 64-bit key of the counter-based draws.
    """

    input_token_ids: List[int]
    start_position: int
    block_table: List[int]
    is_prefill: bool
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed_key: int = 0

    @property
    def query_len(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.input_token_ids)


@dataclass
class StepInput:
    """One engine step: decodes first, then prefills (batch order = output order)."""

    seqs: List[SeqInput]
    step_id: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.query_len for s in self.seqs)

    @property
    def is_pure_decode(self) -> bool:
        return all(not s.is_prefill for s in self.seqs)


@dataclass
class StepOutput:
    """Rank 0's results, per sequence in batch order.

    Attributes:
        new_token_ids: emitted tokens (1 for a prefill, ``1 + accepted`` for a decode).
        draft_token_ids: the ``k`` drafts for the next step (empty lists when ``k == 0``).
        num_eager_fallbacks: steps that would have used a CUDA graph but ran eagerly.
        comm_bytes: bytes this rank's collectives sent during the step, per op
            (host counters, no device sync).
        execute_time_s: host wall time of the step on rank 0, seconds.
    """

    new_token_ids: List[List[int]]
    draft_token_ids: List[List[int]]
    num_eager_fallbacks: int = 0
    comm_bytes: Dict[str, int] = field(default_factory=dict)
    execute_time_s: float = 0.0
