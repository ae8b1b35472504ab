"""Turn a :class:`~mtpspec.step_io.StepInput` into a :class:`~mtpspec.step_io.PreparedStep`: device tensors
and attention metadata."""

from __future__ import annotations

import itertools
from typing import List, Optional

import numpy as np
import torch

from mtpspec.layers.attention import AttentionMetadata
from mtpspec.sample.counter_rng import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniforms
from mtpspec.sample.logits_processors import LogitsProcessorMetadata
from mtpspec.sample.logprobs import LogprobsMetadata
from mtpspec.sample.sampler import SamplingMetadata
from mtpspec.engine.staging import Staging
from mtpspec.step_io import PreparedStep, SeqInput, StepInput


def _meta(seqs: List[SeqInput], device: torch.device) -> Optional[SamplingMetadata]:
    if not seqs:
        return None
    return SamplingMetadata.build([s.temperature for s in seqs], [s.top_k for s in seqs],
                                  [s.top_p for s in seqs], device)


def _row_layout(seqs: List[SeqInput], num_dec: int, k: int) -> List[List[int]]:
    """Rows of the step's logits per sequence: ``1 + k`` per decode, then one per other sequence
    that samples (none for a partial prefill chunk)."""
    out = [list(range(i * (k + 1), (i + 1) * (k + 1))) for i in range(num_dec)]
    row = num_dec * (k + 1)
    for s in seqs[num_dec:]:
        out.append([] if s.is_partial_prefill else [row])
        row += 0 if s.is_partial_prefill else 1
    return out


def _logits_meta(seqs: List[SeqInput], layout: List[List[int]], num_dec: int,
                 device: torch.device) -> Optional[LogitsProcessorMetadata]:
    items = [(layout[i], s.input_token_ids[1:] if i < num_dec else [], s.logits_params)
             for i, s in enumerate(seqs) if s.logits_params is not None and layout[i]]
    return LogitsProcessorMetadata.build(items, device) if items else None


def _logprobs_meta(seqs: List[SeqInput], layout: List[List[int]], k: int, seg: np.ndarray,
                   device: torch.device) -> Optional[LogprobsMetadata]:
    sample, prompt = [], []
    for i, s in enumerate(seqs):
        rows = layout[i]
        sample.append(None if s.logprobs is None or not rows else
                      (rows, [i * (k + 1) + j for j in range(len(rows))], s.logprobs))
        n = s.prompt_logprob_rows
        if s.prompt_logprobs is None or n <= 0:
            prompt.append(None)
            continue
        targets = s.input_token_ids[1:] + ([s.next_token_id] if s.is_partial_prefill else [])
        if n > len(targets):
            raise ValueError(f"sequence {i}: prompt_logprob_rows={n}, but its input holds the next token of "
                             f"{len(targets)} rows")
        prompt.append((list(range(int(seg[i]), int(seg[i]) + n)), targets[:n], s.prompt_logprobs))
    return LogprobsMetadata.build(sample, prompt, device)


def prepare_step(step: StepInput, k: int, block_size: int, max_position: int, device: torch.device,
                 draft_sampling: bool = False) -> PreparedStep:
    """Build :class:`PreparedStep` (one host-to-device copy for the step's arrays,
    :class:`~mtpspec.engine.staging.Staging`; no device sync).

    ``k`` is the number of draft tokens (0: plain decoding, where decodes are sampled from
    their single row like prefills). Rows of the step's logits: ``1 + k`` per decode, then one
    per other sequence that samples (not partial chunks); the logits edits (``logits_meta``) and the rows to score for
    log-probabilities (``logprobs_meta``) address them in that layout.

    Partial prefill chunks (``SeqInput.next_token_id`` set) get no sample row, no sampling
    parameters and no draws; ``host_partial``, ``prefill_sample_index`` and ``next_token_ids``
    tell the runner where they are.

    ``draft_sampling`` (``SpeculativeConfig.draft_sampling == "auto"`` and the step verifies or
    proposes drafts; with adaptive speculation length ``k`` may be 0 while the step proposes):
    fill ``draft_temperature`` / ``draft_seed_keys`` when some sequence samples its drafts.

    Raises:
        ValueError: decodes after prefills, a decode with the wrong number of tokens, a
            ``next_token_id`` on a decode, a block table too short for the positions the step
            writes, or more prompt rows to score than the input (and ``next_token_id``) holds.
    """
    seqs = step.seqs
    decodes = [s for s in seqs if not s.is_prefill] if k else []
    num_dec = len(decodes)
    if any(s.is_prefill for s in seqs[:num_dec]):
        raise ValueError("a step must list its decodes before its prefills")
    for s in decodes:
        if s.query_len != k + 1:
            raise ValueError(f"a decode must feed 1 + k = {k + 1} tokens, got {s.query_len}")
    partial = [i for i, s in enumerate(seqs) if s.is_partial_prefill]
    for i in partial:
        if not seqs[i].is_prefill:
            raise ValueError(f"sequence {i}: next_token_id={seqs[i].next_token_id} is only for a partial prefill "
                             "chunk, but it is a decode")
    rest = seqs[num_dec:]
    sampled = [j for j, s in enumerate(rest) if not s.is_partial_prefill]
    rest_sampled = [rest[j] for j in sampled]
    q = np.fromiter((len(s.input_token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=len(seqs))
    seg = np.concatenate([[0], np.cumsum(q)])
    seq_of_row = np.repeat(np.arange(len(seqs)), q)
    pos = np.arange(int(seg[-1]), dtype=np.int64) - np.repeat(seg[:-1], q) + np.repeat(starts, q)
    n = len(seqs)
    lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
    need = -(-(starts + q) // block_size)
    short = np.flatnonzero(lens < need)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {i}: {int(starts[i] + q[i])} positions need {int(need[i])} blocks, its table has "
                         f"{int(lens[i])}")
    bt = np.full((n, max(1, int(lens.max()))), -1, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int64,
                       count=int(lens.sum()))
    bt[np.repeat(np.arange(n), lens), np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
    slots = bt[seq_of_row, pos // block_size] * block_size + pos % block_size
    ids = np.fromiter((t for s in seqs for t in s.input_token_ids), dtype=np.int64, count=int(seg[-1]))
    seq_lens = (starts + q).tolist()
    # every row of the decodes (they come first, k == 0: none), then the last row of each sampled prefill
    sample_rows = np.concatenate([np.arange(seg[num_dec]), seg[1:][num_dec + np.array(sampled, dtype=np.int64)] - 1])

    st = Staging(device)  # every array below reaches the device in one copy
    put = st.add
    i_qsl, i_lens, i_slots, i_bt = put(seg, torch.int32), put(seq_lens, torch.int32), put(slots), put(bt, torch.int32)
    i_acc = i_dec = i_pre = None
    if any(s.temperature > 0 for s in decodes):
        keys = [s.seed_key for s in decodes]
        decided = np.array([[s.start_position + 1 + j for j in range(k + 1)] for s in decodes], dtype=np.int64)
        i_acc = put(counter_uniforms(keys, decided[:, :k], STREAM_ACCEPT), torch.float64)
        i_dec = put(counter_uniforms(keys, decided, STREAM_SAMPLE), torch.float64)
    if any(s.temperature > 0 for s in rest_sampled):
        decided = np.array([[s.seq_len] for s in rest_sampled], dtype=np.int64)
        i_pre = put(counter_uniforms([s.seed_key for s in rest_sampled], decided, STREAM_SAMPLE)[:, 0],
                    torch.float64)
    i_sidx = i_next = None
    if partial:
        i_sidx = put(np.array(sampled, dtype=np.int64))
        nxt = np.full(len(seqs), -1, dtype=np.int64)
        nxt[partial] = [seqs[i].next_token_id for i in partial]
        i_next = put(nxt)
    i_drafts = put(np.array([s.input_token_ids[1:] for s in decodes], dtype=np.int64)) if num_dec else None
    i_dt = i_dk = None
    if draft_sampling and any(s.draft_temperature > 0 for s in seqs):
        i_dt = put(np.array([s.draft_temperature for s in seqs], dtype=np.float32), torch.float32)
        i_dk = put(np.array([s.seed_key for s in seqs], dtype=np.uint64).view(np.int64))
    i_ids, i_pos, i_starts = put(ids), put(np.minimum(pos, max_position - 1)), put(starts)
    i_seg, i_rows = put(seg[:-1]), put(sample_rows)
    t = st.flush()
    get = lambda i: None if i is None else t[i]  # noqa: E731
    meta = AttentionMetadata(
        query_start_loc=t[i_qsl], seq_lens=t[i_lens], slot_mapping=t[i_slots], block_tables=t[i_bt],
        num_seqs=len(seqs), max_query_len=int(q.max()), max_seq_len=max(seq_lens), query_lens=q.tolist(),
        seq_lens_list=seq_lens)
    layout = _row_layout(seqs, num_dec, k)
    return PreparedStep(
        input_ids=t[i_ids], positions=t[i_pos], attn_metadata=meta,
        block_tables=meta.block_tables, start_positions=t[i_starts], seg_starts=t[i_seg],
        sample_rows=t[i_rows], num_decodes=num_dec, num_prefills=len(rest), k=k,
        draft_token_ids=get(i_drafts), decode_meta=_meta(decodes, device), prefill_meta=_meta(rest_sampled, device),
        accept_uniforms=get(i_acc), decode_sample_uniforms=get(i_dec), prefill_uniforms=get(i_pre),
        host_query_lens=q.tolist(), host_start_positions=starts.tolist(), host_partial=partial,
        prefill_sample_index=get(i_sidx), next_token_ids=get(i_next),
        logits_meta=_logits_meta(seqs, layout, num_dec, device),
        logprobs_meta=_logprobs_meta(seqs, layout, k, seg, device),
        draft_temperature=get(i_dt), draft_seed_keys=get(i_dk))
