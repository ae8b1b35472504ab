"""Python-level pieces shared by the paged attention ops (:mod:`mtpspec.ops.paged_attention`,
:mod:`mtpspec.ops.mla_attention`): the torch references' padding to ``max_query_len`` /
``max_seq_len`` and the split-K launch helpers. No Triton kernels live here."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mtpspec.ops.triton_utils import cdiv


# ---------------------------------------------------------------- torch-reference padding

def padded_queries(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                   device: torch.device) -> Tuple[torch.Tensor, ...]:
    """``(q_lens, s_lens, j, rows, row_ok)``: every sequence padded to ``max_query_len`` query
    rows; ``rows [B, Q]`` are token indices, valid where ``row_ok``."""
    qsl = query_start_loc.long()
    starts, q_lens, s_lens = qsl[:-1], qsl[1:] - qsl[:-1], seq_lens.long()
    j = torch.arange(max_query_len, device=device)
    rows = starts[:, None] + j[None, :]  # [B, Q]
    row_ok = j[None, :] < q_lens[:, None]
    return q_lens, s_lens, j, rows, row_ok


def padded_slots(block_tables: torch.Tensor, s_lens: torch.Tensor, max_seq_len: int, block_size: int,
                 num_blocks: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pos, key_ok, slots)``: every sequence padded to ``max_seq_len`` keys; ``slots [B, S]``
    are cache slots, valid where ``key_ok`` (clamped into the cache elsewhere)."""
    pos = torch.arange(max_seq_len, device=device)
    width = block_tables.shape[1]
    blocks = block_tables.long().index_select(1, (pos // block_size).clamp(max=max(width - 1, 0)))
    key_ok = pos[None, :] < s_lens[:, None]  # [B, S]
    slots = torch.where(key_ok, blocks * block_size + pos % block_size, 0).clamp(0, num_blocks * block_size - 1)
    return pos, key_ok, slots


def causal_probs(s: torch.Tensor, q_lens: torch.Tensor, s_lens: torch.Tensor, j: torch.Tensor, pos: torch.Tensor,
                 key_ok: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """Causal softmax of scores ``s [B, H, Q, S]`` over valid keys; fully masked rows give zeros."""
    q_abs = (s_lens - q_lens)[:, None] + j[None, :]  # [B, Q]
    mask = (pos[None, None, :] <= q_abs[:, :, None]) & key_ok[:, None, :] & row_ok[:, :, None]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    l = p.sum(dim=-1, keepdim=True)
    return p / torch.where(l > 0, l, torch.ones_like(l))


def scatter_padded_rows(o: torch.Tensor, rows: torch.Tensor, row_ok: torch.Tensor, num_tokens: int,
                        acc_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Padded ``o [B, Q, H, D]`` back to ``[num_tokens, H, D]`` in ``out_dtype`` (unused rows zero)."""
    nh, d = o.shape[-2], o.shape[-1]
    dst = torch.where(row_ok, rows, num_tokens).reshape(-1)  # rows past a sequence go to a dropped extra row
    full = torch.zeros(num_tokens + 1, nh, d, dtype=acc_dtype, device=o.device)
    full.index_copy_(0, dst, o.reshape(-1, nh, d))  # duplicates only on the dropped row
    return full[:num_tokens].to(out_dtype)


# ---------------------------------------------------------------- split-K launch helpers

def choose_num_splits(num_splits: Optional[int], work: int, sms: int, max_seq_len: int, target_programs_per_sm: int,
                      min_keys_per_split: int, max_splits: int) -> int:
    """``num_splits`` if given (checked), else ``min(ceil(target * sms / work), ceil(max_seq_len /
    min_keys), max_splits)``, at least 1."""
    if num_splits is None:
        return max(1, min(cdiv(target_programs_per_sm * sms, max(1, work)),
                          cdiv(max(1, max_seq_len), min_keys_per_split), max_splits))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    return num_splits


def split_outputs(like: torch.Tensor, num_splits: int, block_d: int) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """``(out, part_acc, part_ml)`` for a ``[t, nh, d]`` op: one split writes zero-filled ``out``
    directly (padding rows stay zero; the partial buffers are unused aliases), several write fp32
    partials ``[t, nh, s, block_d]`` / ``[t, nh, s, 2]`` that the combine kernel merges."""
    t, nh = like.shape[0], like.shape[1]
    if num_splits == 1:
        out = torch.zeros_like(like)
        return out, out, out
    out = torch.empty_like(like)
    part_acc = torch.empty(t, nh, num_splits, block_d, dtype=torch.float32, device=like.device)
    part_ml = torch.empty(t, nh, num_splits, 2, dtype=torch.float32, device=like.device)
    return out, part_acc, part_ml


def launchable_block_tables(block_tables: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``block_tables``, or a ``[num_seqs, 1]`` zero table when it has no columns (a valid pointer)."""
    if block_tables.shape[1] == 0:
        return torch.zeros(num_seqs, 1, dtype=block_tables.dtype, device=block_tables.device)
    return block_tables
