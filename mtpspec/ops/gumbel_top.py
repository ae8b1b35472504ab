"""Triton kernels of :func:`mtpspec.sample.gumbel.local_gumbel_top`: one pass over a logits shard.

The torch reference (``local_gumbel_top_ref`` in :mod:`mtpspec.sample.gumbel`) makes about thirty
passes over ``[N, per_rank]`` (the 64-bit hash, the noise, the score, the arg-max, the
log-sum-exp). Here each program (row, column chunk) reads its columns once and keeps, per lane,
the running (score, first arg-max, ``l / T`` there) and an online log-sum-exp (max, sum of
exponentials) of ``l / T``; it writes one partial per chunk (score, chosen, chunk LSE; column).
The noise bits are the reference's (``splitmix64(h_row + id * GOLDEN)``, logical shifts on
uint64, the uniform from the top 53 bits, ``-log(-log(u))`` in float64, then float32), and
``l / T`` is the same IEEE division, so scores match the reference wherever the two ``log``
implementations agree (on one device: always in practice; the interpreter against torch's CPU
``log``: tested equal ids). Given :class:`~mtpspec.sample.gumbel.NoiseRows`, the chunk programs
also compute the row hash ``h_row`` (:func:`~mtpspec.sample.gumbel.row_hash`, same uint64 bits).

Combining the ``C`` chunks of a row (one program per row): the first chunk with the largest score
(NaN read as ``+inf``, as the ``torch.argmax`` it replaced), its id and chosen logit, and
``torch.logsumexp`` of the chunk LSEs, split so that its float steps stay torch's: a shift kernel
(max with NaN propagating, ``|max| == inf -> 0``, ``lse - max``), then torch's ``exp_``, ``sum``
(its reduction order) and ``log_``, then the combine kernel adds the max back and writes the packed
``[N, 4]`` row, or at tp 1 the single rank's :func:`~mtpspec.sample.gumbel.pick_gumbel` (ids,
``log q``, LSE into the caller's buffers). Six launches in all, the same bits as the torch combine.

Launch shapes depend only on shapes and the SM count (CUDA-graph capturable, no host sync); the
column split is :func:`mtpspec.ops.argmax.split_plan`'s.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from mtpspec.ops.argmax import BF16_BITS_IN_INTERPRETER, NUM_WARPS, num_sms, split_plan
from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, interpreting, next_power_of_2, tl
from mtpspec.sample.gumbel import GumbelPick, NoiseRows

if HAS_TRITON:
    def _gumbel_chunk_kernel(x_ptr, t_ptr, rows_ptr, keys_ptr, pos_ptr, pos_add, part_ptr, part_idx_ptr, n_real,
                             chunk, n_chunks, stride_row, vocab_start, BLOCK: tl.constexpr,
                             BF16_BY_BITS: tl.constexpr, HASH_ROWS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        start = c * chunk
        end = tl.minimum(start + chunk, n_real)
        lanes = tl.arange(0, BLOCK)
        base = x_ptr + row * stride_row + start
        temp = tl.load(t_ptr + row)
        sampled = temp > 0
        t = tl.where(sampled, temp, 1.0)
        if HASH_ROWS:  # row_hash(key, pos + off, stream) = splitmix64(key ^ splitmix64(4 * pos + pos_add))
            z = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True) * 4 + pos_add  # pos_add >= 0: uint64
            z = z + 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = (z ^ (z >> 31)) ^ tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
            z = z + 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            h_row = z ^ (z >> 31)
        else:
            h_row = tl.load(rows_ptr + row).to(tl.uint64, bitcast=True)
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        acc_idx = start + lanes
        acc_x = tl.full([BLOCK], float("-inf"), tl.float32)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        n_blocks = tl.cdiv(end - start, BLOCK)
        for i in range(0, n_blocks):
            cols = i * BLOCK + lanes
            valid = start + cols < end
            if BF16_BY_BITS:
                bits = tl.load(base + cols, mask=valid, other=-128)  # int16 0xff80: bf16 -inf
                raw = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                raw = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
            x = raw / t
            gid = (vocab_start + start + cols).to(tl.uint64)
            # (a name of its own: compiled Triton refuses a scalar `z` above re-typed as a block here)
            zc = h_row + gid * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15
            zc = (zc ^ (zc >> 30)) * 0xBF58476D1CE4E5B9
            zc = (zc ^ (zc >> 27)) * 0x94D049BB133111EB
            zc = zc ^ (zc >> 31)
            u = ((zc >> 11).to(tl.float64) + 0.5) * (2.0 ** -53)
            g = (-tl.log(-tl.log(u))).to(tl.float32)
            score = tl.where(sampled, x + g, x)
            score = tl.where(valid, score, float("-inf"))
            take = (score > acc) | ((score != score) & (acc == acc))
            acc = tl.where(take, score, acc)
            acc_idx = tl.where(take, start + cols, acc_idx)
            acc_x = tl.where(take, x, acc_x)
            m_new = tl.maximum(m, x)  # invalid lanes: x = -inf, nothing changes
            finite = m_new > float("-inf")
            ref = tl.where(finite, m_new, 0.0)
            s = tl.where(finite, s * tl.exp(m - ref) + tl.exp(x - ref), s)
            m = m_new
        is_nan = acc != acc
        has_nan = tl.max(is_nan.to(tl.int32), axis=0)
        top = tl.max(tl.where(is_nan, float("-inf"), acc), axis=0)
        cand = tl.where(is_nan, has_nan, (acc == top).to(tl.int32) * (1 - has_nan)) != 0
        best = tl.min(tl.where(cand, acc_idx, 2147483647), axis=0)
        at_best = cand & (acc_idx == best)
        val = tl.max(tl.where(at_best, acc, float("-inf")), axis=0)
        val = tl.where(has_nan != 0, float("nan"), val)
        chosen = tl.sum(tl.where(at_best, acc_x, 0.0), axis=0)
        mm = tl.max(m, axis=0)
        mm_ref = tl.where(mm > float("-inf"), mm, 0.0)
        ss = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - mm_ref), 0.0), axis=0)
        lse = tl.where(mm > float("-inf"), mm + tl.log(tl.where(ss > 0, ss, 1.0)), float("-inf"))
        out = part_ptr + (row * n_chunks + c) * 3
        tl.store(out, val)
        tl.store(out + 1, chosen)
        tl.store(out + 2, lse)
        tl.store(part_idx_ptr + row * n_chunks + c, best)

    def _lse_shift_kernel(part_ptr, max_ptr, shifted_ptr, n_chunks, BLOCK_C: tl.constexpr):
        # Row program: torch.logsumexp's first steps over the chunk LSEs (amax, NaN propagating;
        # |max| == inf -> 0; lse - max), so exp / sum / log run as torch ops in torch's order.
        row = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, BLOCK_C)
        mask = cs < n_chunks
        v = tl.load(part_ptr + (row * n_chunks + cs) * 3 + 2, mask=mask, other=float("-inf"))
        is_nan = (v != v) & mask
        top = tl.max(tl.where(is_nan, float("-inf"), v), axis=0)
        top = tl.where(tl.max(is_nan.to(tl.int32), axis=0) != 0, float("nan"), top)
        top = tl.where(tl.abs(top) == float("inf"), 0.0, top)
        tl.store(max_ptr + row, top)
        tl.store(shifted_ptr + row * n_chunks + cs, v - top, mask=mask)

    def _gumbel_combine_kernel(part_ptr, part_idx_ptr, logsum_ptr, max_ptr, packed_ptr, packed_i32_ptr,
                               ids_ptr, log_q_ptr, lse_ptr, n_chunks, vocab_start, stride_log_q, stride_lse,
                               FINAL: tl.constexpr, BLOCK_C: tl.constexpr):
        # Row program: the first chunk with the largest score (NaN read as +inf, as the torch
        # argmax it replaces), its id and chosen logit; LSE = log(sum) + max. FINAL (tp 1):
        # pick_gumbel of the single rank instead of the packed row (its log-sum-exp over one
        # value is lse with -0.0 -> +0.0; log q = chosen - lse).
        row = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, BLOCK_C)
        mask = cs < n_chunks
        score = tl.load(part_ptr + (row * n_chunks + cs) * 3, mask=mask, other=float("-inf"))
        score = tl.where(score != score, float("inf"), score)
        top = tl.max(score, axis=0)
        first = tl.min(tl.where(mask & (score == top), cs, BLOCK_C), axis=0)
        at = part_ptr + (row * n_chunks + first) * 3
        val = tl.load(at)
        chosen = tl.load(at + 1)
        gid = tl.load(part_idx_ptr + row * n_chunks + first) + vocab_start
        lse = tl.load(logsum_ptr + row) + tl.load(max_ptr + row)
        if FINAL:
            lse = tl.where(lse == 0.0, 0.0, lse)
            tl.store(ids_ptr + row, gid.to(tl.int64))
            tl.store(log_q_ptr + row * stride_log_q, chosen - lse)
            tl.store(lse_ptr + row * stride_lse, lse)
        else:
            tl.store(packed_ptr + row * 4, val)
            tl.store(packed_i32_ptr + row * 4 + 1, gid)
            tl.store(packed_ptr + row * 4 + 2, lse)
            tl.store(packed_ptr + row * 4 + 3, chosen)

    _gumbel_chunk = LazyKernel(_gumbel_chunk_kernel)
    _lse_shift = LazyKernel(_lse_shift_kernel)
    _gumbel_combine = LazyKernel(_gumbel_combine_kernel)


def gumbel_chunk_partials(x: torch.Tensor, vocab_start: int, num_real: int, temperature: torch.Tensor,
                          rows: Union[torch.Tensor, NoiseRows]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk kernel's partials: ``[N, C, 3]`` float32 (score, chosen ``l / T``, chunk LSE) and
    ``[N, C]`` int32 column of each chunk's pick (``x``: unit column stride, ``num_real >= 1``)."""
    n, dev = x.shape[0], x.device
    plan = split_plan(n, num_real, num_sms(dev))
    bf16_bits = BF16_BITS_IN_INTERPRETER and interpreting() and x.dtype == torch.bfloat16
    src = x.view(torch.int16) if bf16_bits else x
    part = torch.empty(n, plan.n_chunks, 3, dtype=torch.float32, device=dev)
    part_idx = torch.empty(n, plan.n_chunks, dtype=torch.int32, device=dev)
    hashed = isinstance(rows, NoiseRows)
    keys, pos, pos_add = (rows.seed_keys, rows.positions, rows.offset * 4 + rows.stream) if hashed else (rows, rows, 0)
    _gumbel_chunk[(n, plan.n_chunks)](src, temperature.float().contiguous(), keys.contiguous(), keys.contiguous(),
                                      pos.contiguous(), pos_add, part, part_idx, num_real, plan.chunk,
                                      plan.n_chunks, x.stride(0), vocab_start, BLOCK=plan.block,
                                      BF16_BY_BITS=bf16_bits, HASH_ROWS=hashed, num_warps=NUM_WARPS)
    return part, part_idx


def local_gumbel_top_triton(local_logits: torch.Tensor, vocab_start: int, num_real: int, temperature: torch.Tensor,
                            rows: Union[torch.Tensor, NoiseRows], out: Optional[GumbelPick] = None
                            ) -> Optional[torch.Tensor]:
    """The packed ``[N, 4]`` float32 rows of ``local_gumbel_top`` (``num_real >= 1``, ``N >= 1``);
    with ``out`` (tp 1) instead the single rank's :func:`~mtpspec.sample.gumbel.pick_gumbel`
    written into ``out`` (``token_ids [N]`` int64, ``log_q`` / ``lse`` ``[N]`` float32, any
    stride), returning ``None``.

    ``rows``: ``[N]`` int64 row hashes, or :class:`~mtpspec.sample.gumbel.NoiseRows` hashed in the
    chunk kernel. Six launches: chunk, shift, torch ``exp_`` / ``sum`` / ``log_``, combine.
    """
    x = local_logits
    if x.stride(1) != 1:
        x = x[:, :num_real].contiguous()
    part, part_idx = gumbel_chunk_partials(x, vocab_start, num_real, temperature, rows)
    n, n_chunks = part_idx.shape
    dev = x.device
    # torch.logsumexp(part[..., 2], dim=1), step by step: the same ops in the same order (same bits)
    top = torch.empty(n, dtype=torch.float32, device=dev)
    shifted = torch.empty(n, n_chunks, dtype=torch.float32, device=dev)
    block_c = next_power_of_2(n_chunks)
    _lse_shift[(n,)](part, top, shifted, n_chunks, BLOCK_C=block_c, num_warps=1)
    logsum = shifted.exp_().sum(dim=1).log_()
    packed = torch.empty(n, 4, dtype=torch.float32, device=dev) if out is None else top
    ids, log_q, lse = (packed, packed, packed) if out is None else out
    _gumbel_combine[(n,)](part, part_idx, logsum, top, packed, packed.view(torch.int32), ids, log_q, lse,
                          n_chunks, vocab_start, log_q.stride(0), lse.stride(0), FINAL=out is not None,
                          BLOCK_C=block_c, num_warps=1)
    return packed if out is None else None
