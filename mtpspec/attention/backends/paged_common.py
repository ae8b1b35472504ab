"""Pieces shared by the paged backends' impls (:mod:`~mtpspec.attention.backends.paged_gqa`,
:mod:`~mtpspec.attention.backends.mla`): metadata checks, cache key slots and the padded
``[B + 1, max_q]`` batch layout of their torch (SDPA) paths. Sync-free, static shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from mtpspec.layers.attention import AttentionMetadata


#: SDPA backends the torch paths may use on CUDA: every one but cuDNN's (see :func:`sdpa`).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (same shapes, dtypes and errors),
    on CUDA without the cuDNN backend.

    PyTorch prefers cuDNN's attention on Hopper, and cuDNN builds an execution graph for every new
    shape: prefill steps, whose lengths change with every prompt, paid it again and again (an
    H200 profile of a 78-token prefix-cache hit on a 16-layer model: about 30 to 90 ms of graph
    building in steps whose kernels take 14 ms). Flash / memory-efficient attention have no
    per-shape setup.
    """
    if q.is_cuda:
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def check_metadata_rows(meta: "AttentionMetadata", num_rows: int) -> None:
    """The metadata's host ``query_lens`` (when present) must not cover more than ``num_rows``.

    Raises:
        ValueError: they cover more tokens than the batch has rows.
    """
    q_lens = meta.query_lens
    if q_lens and sum(q_lens) > num_rows:
        raise ValueError(f"attention metadata covers {sum(q_lens)} tokens but the batch has {num_rows} rows")


def check_cache_metadata(meta: "AttentionMetadata", num_rows: int) -> None:
    """With a cache attached: block tables present and a slot for every one of ``num_rows`` rows.

    Raises:
        ValueError: no ``block_tables``, or ``slot_mapping`` shorter than ``num_rows``.
    """
    if meta.block_tables is None:
        raise ValueError("a KV cache is attached but the attention metadata has no block_tables")
    if meta.slot_mapping.shape[0] < num_rows:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {num_rows} rows; give every "
                         "row a slot (-1 for padding rows)")


def cache_key_slots(meta: "AttentionMetadata", block_size: int, num_slots: int,
                    device: torch.device) -> torch.Tensor:
    """``[B, max_seq_len]`` cache slots of every key position through ``meta.block_tables``,
    clamped into ``[0, num_slots)`` (positions past a sequence are masked by the caller)."""
    b = meta.num_seqs
    pos = torch.arange(meta.max_seq_len, device=device)
    blocks = meta.block_tables.long()[:b].index_select(1, (pos // block_size).clamp(max=meta.block_tables.shape[1] - 1))
    return (blocks * block_size + pos % block_size).clamp(0, num_slots - 1)  # [B, max_s]; masked below


class PaddedBatch(NamedTuple):
    """Placement of ``t`` rows into ``[B + 1, max_q]`` (sequence ``B`` = padding rows)."""
    tok_seq: torch.Tensor  # [t] sequence of each row (B for padding rows)
    tok_off: torch.Tensor  # [t] query slot of each row
    real: torch.Tensor  # [t] row belongs to a real sequence
    key_ok: torch.Tensor  # [B + 1, max_s] key position < key_len
    mask: torch.Tensor  # [B + 1, max_q, max_s] causal & key_ok, key 0 always kept


def padded_batch(qsl: torch.Tensor, q_len_t: torch.Tensor, key_len_t: torch.Tensor, num_rows: int, max_q: int,
                 max_s: int, device: torch.device) -> PaddedBatch:
    """Rows placed by ``searchsorted`` over ``query_start_loc``; query ``j`` of sequence ``i`` may
    attend key positions ``<= key_len_i - q_len_i + j`` and ``< key_len_i``; padded query slots
    always see key 0 (no all-masked row, hence no NaN; their output is dropped)."""
    b = q_len_t.shape[0]
    rows = torch.arange(num_rows, device=device)
    # b for padding rows; over the whole qsl (qsl[0] = 0 <= every row) minus 1 = over qsl[1:]: Inductor
    # (torch 2.11, CUDA) fails on searchsorted over a slice (NotImplementedError: SliceView)
    tok_seq = torch.searchsorted(qsl, rows, right=True) - 1
    real = tok_seq < b
    tok_off = (rows - qsl.index_select(0, tok_seq)).clamp(0, max(max_q - 1, 0))
    q_len_x = torch.cat([q_len_t, q_len_t.new_zeros(1)])
    key_len_x = torch.cat([key_len_t, key_len_t.new_zeros(1)])
    key_pos = torch.arange(max_s, device=device)
    key_ok = key_pos[None, :] < key_len_x[:, None]  # [B + 1, max_s]
    q_abs = (key_len_x - q_len_x)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B + 1, max_q]
    mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & key_ok[:, None, :]
    mask[:, :, 0] = True  # padded query slots: keep one key (their output is dropped)
    return PaddedBatch(tok_seq, tok_off, real, key_ok, mask)
