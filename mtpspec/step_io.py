"""The data of one engine step, as it crosses module boundaries.

* :class:`StepInput` / :class:`SeqInput`: what the scheduler (rank 0) sends every rank. Plain
  picklable host data: every rank receives the same :class:`StepInput`, runs the same forwards
  and therefore issues the same collectives in the same order.
* :class:`PreparedStep`: the same step as device tensors + attention metadata, built by
  :func:`mtpspec.engine.input_prep.prepare_step` and read by the samplers and the proposer.
* :class:`StepOutput`: what rank 0's runner sends back.

The types live outside ``engine/`` (beside ``config.py`` and ``outputs.py``) so that
``spec_decode/`` and ``sample/`` read them without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mtpspec.layers.attention import AttentionMetadata
from mtpspec.sample.logits_processors import LogitsProcessorMetadata, SeqLogitsParams
from mtpspec.sample.logprobs import LogprobsMetadata, TokenLogprobs
from mtpspec.sample.sampler import SamplingMetadata


def host_to_device(arrays: Sequence, dtype: torch.dtype, device: torch.device) -> List[torch.Tensor]:
    """Host arrays (numpy or lists, any shapes) as ``dtype`` tensors of the same shapes on
    ``device``, in one copy: on CUDA from pinned memory without blocking the host (the caching host
    allocator makes the pinning cheap after the first steps); elsewhere as they are."""
    import numpy as np
    host = [np.asarray(x) for x in arrays]
    flat = torch.from_numpy(np.concatenate([h.reshape(-1) for h in host])).to(dtype)
    flat = flat.to(device) if device.type != "cuda" else flat.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for h in host:
        out.append(flat[at:at + h.size].view(h.shape))
        at += h.size
    return out


@dataclass
class SeqInput:
    """One sequence of the flattened batch.

    Attributes:
        input_token_ids: the target's new tokens: the prompt (+ earlier outputs after a
            preemption), or with chunked prefill the next chunk of it, for a prefill;
            ``[last token] + k drafts`` for a decode.
        start_position: absolute position of ``input_token_ids[0]`` (= KV entries already valid).
        block_table: the sequence's KV blocks (covering every slot the step writes).
        is_prefill: prefill (sample from the last row) or decode (verify ``k`` drafts).
        temperature, top_k, top_p: sampling parameters (``temperature == 0``: greedy).
        seed_key: 64-bit key of the counter-based draws.
        next_token_id: only on a prefill chunk that does not end the prompt (a *partial*
            prefill): the prompt token at position ``seq_len``. Such a chunk is not sampled and
            emits nothing; the MTP first pass takes this token at the chunk's last row (where a
            final chunk takes its sampled token), so the MTP KV cache equals a whole prefill's.
        logprobs: ``N``: score every emitted token and its top-``N`` alternatives (``None``: no).
        prompt_logprobs: ``N`` for the prompt rows below (``None``: no).
        prompt_logprob_rows: leading rows to score against the prompt token after them (row
            ``i``: the token at ``start_position + i + 1``, ``input_token_ids[i + 1]`` or, for the
            last row of a partial chunk, ``next_token_id``); ``0`` = none.
        logits_params: ``logit_bias`` / ``min_tokens`` / penalties of the step's rows
            (:class:`~mtpspec.sample.logits_processors.SeqLogitsParams`), ``None`` = none.
        request_id: the sequence's id (unique among live sequences); sampled drafts keep their
            draft distribution on the device under it until the next step verifies them.
        mtp_lag: positions before ``start_position`` whose MTP KV entries were deferred (adaptive
            speculation, :mod:`mtpspec.spec_decode.deferred_mtp`); a step that drafts writes them
            first. ``0``: none.
        mtp_lag_token_ids: the next tokens of the lag's positions but its last (``mtp_lag - 1``
            ids: the tokens at positions ``start_position - mtp_lag + 1 .. start_position - 1``).
        greedy_drafts: keep argmax drafts under ``draft_sampling="auto"`` (:attr:`draft_temperature`
            0). The engine sets it for a request with its own seed while the number of drafts varies
            from step to step (adaptive speculation): with argmax drafts a seeded token is a function of
            ``(seed, position, logits)`` alone, with sampled drafts it depends on which drafts each
            step proposed, i.e. on timing.
    """

    input_token_ids: List[int]
    start_position: int
    block_table: List[int]
    is_prefill: bool
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed_key: int = 0
    next_token_id: Optional[int] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    prompt_logprob_rows: int = 0
    logits_params: Optional[SeqLogitsParams] = None
    request_id: str = ""
    mtp_lag: int = 0
    mtp_lag_token_ids: List[int] = field(default_factory=list)
    greedy_drafts: bool = False

    @property
    def draft_temperature(self) -> float:
        """The temperature its drafts are sampled at under ``draft_sampling="auto"``: its own for a
        row sampled without top-k / top-p nor :attr:`greedy_drafts`, else 0 (greedy drafts)."""
        sampled = self.temperature > 0 and self.top_k <= 0 and self.top_p >= 1.0 and not self.greedy_drafts
        return self.temperature if sampled else 0.0

    @property
    def is_partial_prefill(self) -> bool:
        """A prefill chunk that does not end the prompt (see ``next_token_id``)."""
        return self.next_token_id is not None

    @property
    def query_len(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.input_token_ids)


@dataclass
class StepInput:
    """One engine step: decodes first, then prefills (batch order = output order).

    Attributes:
        seqs: the sequences.
        step_id: a counter.
        block_copies: ``(src, dst)`` KV block ids: before the step's forward, every cache of
            every layer (target, MTP, indexer keys) copies block ``src`` into block ``dst``
            (all reads before any write). Prefix caching gives a sequence a private copy of a
            shared block whose last MTP entry it recomputes.
        num_spec_tokens: drafts each decode verifies (every decode feeds ``1 +`` this many
            tokens); ``None``: the runner's ``k``.
        num_proposed_tokens: drafts the step proposes per sequence, ``0 .. k`` (adaptive
            speculation length; ``0``: no draft pass, only the MTP layers' KV-cache writes);
            ``None``: the runner's ``k``.
        defer_mtp_kv: with ``num_proposed_tokens == 0``: no MTP pass at all; the rows' target
            hidden states go to the hidden-state cache instead
            (:mod:`mtpspec.spec_decode.deferred_mtp`). ``False``: such a step writes its MTP KV
            entries itself.
    """

    seqs: List[SeqInput]
    step_id: int = 0
    block_copies: List[Tuple[int, int]] = field(default_factory=list)
    num_spec_tokens: Optional[int] = None
    num_proposed_tokens: Optional[int] = None
    defer_mtp_kv: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.query_len for s in self.seqs)

    @property
    def is_pure_decode(self) -> bool:
        return all(not s.is_prefill for s in self.seqs)


@dataclass
class PreparedStep:
    """Device tensors of one step (``T`` target rows, ``B`` sequences, decodes first).

    Attributes:
        input_ids: ``[T]`` int64.
        positions: ``[T]`` int64, clamped to ``max_position - 1`` (rows past the model's
            positions only exist beyond ``max_model_len``; their outputs are never emitted).
        attn_metadata: the varlen layout (shared by the target and the MTP first pass).
        block_tables: ``[B, max_blocks]`` int32 (-1 padded).
        start_positions: ``[B]`` int64, position of each sequence's first row.
        seg_starts: ``[B]`` int64, first row of each sequence.
        sample_rows: ``[R]`` int64 rows whose logits are needed: all ``1 + k`` rows of each
            decode, the last row of each prefill that ends its prompt (plain decoding: the last
            row of every sequence but partial prefill chunks).
        num_decodes, num_prefills, k: host ints; ``num_prefills`` counts every sequence after
            the decodes (partial chunks included).
        draft_token_ids: ``[num_decodes, k]`` int64 drafts to verify (``None`` if none).
        decode_meta / prefill_meta: sampling parameters per decode / per sampled prefill row.
        accept_uniforms ``[num_decodes, k]``, decode_sample_uniforms ``[num_decodes, k + 1]``,
        prefill_uniforms ``[S]`` (``S`` sampled prefill rows): float64 draws, ``None`` when all
            rows are greedy.
        host_query_lens / host_start_positions: python lists.
        host_partial: batch indices of the partial prefill chunks (empty in most steps).
        prefill_sample_index: ``[S]`` int64, index among the ``num_prefills`` sequences of each
            sampled prefill row; ``None`` when every one is sampled (no partial chunk).
        next_token_ids: ``[B]`` int64, ``SeqInput.next_token_id`` of partial chunks, -1
            elsewhere; ``None`` without partial chunks.
        logits_meta: the rows' ``logit_bias`` / ``min_tokens`` / penalty edits (``None``: none).
        logprobs_meta: rows to score for ``logprobs`` / ``prompt_logprobs`` (``None``: none).
        draft_temperature / draft_seed_keys: ``[B]`` float32 / int64 (the uint64 keys' bits):
            per sequence, the temperature its next drafts are sampled at (0: greedy drafts) and
            its counter key; ``None`` unless ``draft_sampling="auto"`` and a row samples drafts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    block_tables: torch.Tensor
    start_positions: torch.Tensor
    seg_starts: torch.Tensor
    sample_rows: torch.Tensor
    num_decodes: int
    num_prefills: int
    k: int
    draft_token_ids: Optional[torch.Tensor]
    decode_meta: Optional[SamplingMetadata]
    prefill_meta: Optional[SamplingMetadata]
    accept_uniforms: Optional[torch.Tensor]
    decode_sample_uniforms: Optional[torch.Tensor]
    prefill_uniforms: Optional[torch.Tensor]
    host_query_lens: List[int]
    host_start_positions: List[int]
    host_partial: List[int] = field(default_factory=list)
    prefill_sample_index: Optional[torch.Tensor] = None
    next_token_ids: Optional[torch.Tensor] = None
    logits_meta: Optional[LogitsProcessorMetadata] = None
    logprobs_meta: Optional[LogprobsMetadata] = None
    draft_temperature: Optional[torch.Tensor] = None
    draft_seed_keys: Optional[torch.Tensor] = None


@dataclass
class StepOutput:
    """Rank 0's results, per sequence in batch order.

    Attributes:
        new_token_ids: emitted tokens (1 for a prefill that ends its prompt, none for a partial
            prefill chunk, ``1 + accepted`` for a decode).
        draft_token_ids: the ``k`` drafts for the next step (empty lists when ``k == 0`` and
            for partial prefill chunks); ``None`` in a step handle's ``output()``, whose drafts
            come later from its ``drafts()`` (:class:`~mtpspec.engine.model_runner.PendingStep`).
        num_eager_fallbacks: steps that would have used a CUDA graph but ran eagerly.
        comm_bytes: bytes this rank's collectives sent during the step, per op
            (host counters, no device sync).
        execute_time_s: host wall time of the step on rank 0, seconds.
        logprobs: per sequence, ``None`` or one :class:`~mtpspec.sample.logprobs.TokenLogprobs`
            per emitted token (``None`` for the whole field when no sequence asked).
        prompt_logprobs: per sequence, ``None`` or one per scored prompt row (the token at
            ``start_position + 1 + i`` for row ``i``).
        catch_up_ms: device milliseconds of the step's catch-up pass (deferred MTP entries
            written before its first pass), ``None`` without one (or not reported).
    """

    new_token_ids: List[List[int]]
    draft_token_ids: Optional[List[List[int]]]
    num_eager_fallbacks: int = 0
    comm_bytes: Dict[str, int] = field(default_factory=dict)
    execute_time_s: float = 0.0
    logprobs: Optional[List[Optional[List[TokenLogprobs]]]] = None
    prompt_logprobs: Optional[List[Optional[List[TokenLogprobs]]]] = None
    catch_up_ms: Optional[float] = None
