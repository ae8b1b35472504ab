"""Triton kernel of :func:`mtpspec.sample.gumbel.local_gumbel_top`: one pass over a logits shard.

The torch reference (``local_gumbel_top_ref`` in :mod:`mtpspec.sample.gumbel`) makes about thirty
passes over ``[N, per_rank]`` (the 64-bit hash, the noise, the score, the arg-max, the
log-sum-exp). Here each program (row, column chunk) reads its columns once and keeps, per lane,
the running (score, first arg-max, ``l / T`` there) and an online log-sum-exp (max, sum of
exponentials) of ``l / T``; it writes one partial per chunk (score, column, chosen, chunk LSE),
which :func:`local_gumbel_top_triton` combines in torch over the ``C`` chunks (first chunk with the
largest score, NaN counting as largest; ``logsumexp`` of the chunk LSEs). The noise bits are the
reference's (``splitmix64(h_row + id * GOLDEN)``, logical shifts on uint64, the uniform from the
top 53 bits, ``-log(-log(u))`` in float64, then float32), and ``l / T`` is the same IEEE
division, so scores match the reference wherever the two ``log`` implementations agree (on one
device: always in practice; the interpreter against torch's CPU ``log``: tested equal ids).

Launch shape depends only on shapes and the SM count (CUDA-graph capturable, no host sync); the
column split is :func:`mtpspec.ops.argmax.split_plan`'s.
"""

from __future__ import annotations

import torch

from mtpspec.ops.argmax import BF16_BITS_IN_INTERPRETER, NUM_WARPS, num_sms, split_plan
from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, interpreting, tl

if HAS_TRITON:
    def _gumbel_chunk_kernel(x_ptr, t_ptr, rows_ptr, part_ptr, part_idx_ptr, n_real, chunk, n_chunks,
                             stride_row, vocab_start, BLOCK: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        start = c * chunk
        end = tl.minimum(start + chunk, n_real)
        lanes = tl.arange(0, BLOCK)
        base = x_ptr + row * stride_row + start
        temp = tl.load(t_ptr + row)
        sampled = temp > 0
        t = tl.where(sampled, temp, 1.0)
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
            z = h_row + gid * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            u = ((z >> 11).to(tl.float64) + 0.5) * (2.0 ** -53)
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

    _gumbel_chunk = LazyKernel(_gumbel_chunk_kernel)


def local_gumbel_top_triton(local_logits: torch.Tensor, vocab_start: int, num_real: int, temperature: torch.Tensor,
                            rows: torch.Tensor) -> torch.Tensor:
    """The packed ``[N, 4]`` float32 rows of ``local_gumbel_top`` (``num_real >= 1``, ``N >= 1``)."""
    x = local_logits
    if x.stride(1) != 1:
        x = x[:, :num_real].contiguous()
    n = x.shape[0]
    plan = split_plan(n, num_real, num_sms(x.device))
    bf16_bits = BF16_BITS_IN_INTERPRETER and interpreting() and x.dtype == torch.bfloat16
    src = x.view(torch.int16) if bf16_bits else x
    part = torch.empty(n, plan.n_chunks, 3, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(n, plan.n_chunks, dtype=torch.int32, device=x.device)
    _gumbel_chunk[(n, plan.n_chunks)](src, temperature.float().contiguous(), rows.contiguous(), part, part_idx,
                                      num_real, plan.chunk, plan.n_chunks, x.stride(0), vocab_start,
                                      BLOCK=plan.block, BF16_BY_BITS=bf16_bits, num_warps=NUM_WARPS)
    score = part[..., 0]
    first = torch.where(torch.isnan(score), torch.full_like(score, float("inf")), score).argmax(dim=1, keepdim=True)
    top = part.gather(1, first.unsqueeze(-1).expand(-1, 1, 3)).squeeze(1)
    gid = (part_idx.gather(1, first).squeeze(1) + vocab_start).view(torch.float32)
    lse = torch.logsumexp(part[..., 2], dim=1)
    return torch.stack([top[:, 0], gid, lse, top[:, 1]], dim=1)
