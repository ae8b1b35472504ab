"""Vocab-parallel sampling by the Gumbel-max trick, with counter-based noise per global token id.

``argmax_i (l_i / T + G_i)`` with i.i.d. standard Gumbel ``G_i`` is a draw from
``softmax(l / T)`` (Gumbel 1954; e.g. Maddison, Tarlow and Minka, "A* Sampling", NeurIPS 2014,
section 2). An argmax splits over vocab shards exactly as the greedy local argmax does
(:mod:`mtpspec.ops.argmax`), so a tensor-parallel rank samples from its ``[N, per_rank]`` logits
shard without the full logits: each rank reduces its shard to one packed row of four float32
values (16 bytes per row per rank, the size of the greedy path's float64 ``(max, id)`` pair)

``(max score, arg-max id (int32 bits), local log-sum-exp of l / T, l / T at the arg-max)``,

all-gathers them as ``[tp, N, 4]`` and picks the first rank with the largest score. The draw's
probability ``q(x) = exp(l_x / T - LSE)`` needs only the global log-sum-exp (combined from the
per-rank ones) and the chosen logit, both in the gathered row.

Noise: ``G = -log(-log(u))``, ``u`` from the 64-bit hash ``splitmix64(h_row + id * GOLDEN)``
with ``h_row = splitmix64(seed_key ^ splitmix64(position * 4 + stream))`` (the row hash of
:func:`~mtpspec.sample.counter_rng.counter_uniforms`, then the SplitMix64 sequence indexed by the
*global* token id). Computed on the device in wrapping int64 arithmetic, so every rank draws the
noise of its own ids, and the noise of a token does not depend on the tp size: with bit-equal
logits the drawn token is bit-identical at every tp size, for any batch position, per
``(seed, position)``.

Rows with ``T == 0`` take no noise and their ``l`` as score: the pick is then ``torch.argmax``'s
(first maximum; NaN counts as the maximum).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from mtpspec.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from mtpspec.ops.triton_utils import FLOAT_DTYPES, use_triton

STREAM_DRAFT = 2
"""Counter stream of a draft token's Gumbel noise (0 and 1: :mod:`~mtpspec.sample.counter_rng`)."""
STREAM_RESIDUAL = 3
"""Counter stream of the recovered token's Gumbel noise (a rejection with sampled drafts)."""

#: Bytes per row and rank of the packed gather.
PACKED_BYTES_PER_ROW = 16


def _s64(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`~mtpspec.sample.counter_rng.splitmix64` on an int64 tensor (same bits, wrapping)."""
    z = x + _GOLDEN
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


def row_hash(seed_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """``[N]`` int64 row hashes; ``seed_keys`` ``[N]`` int64 (the uint64 keys' bits), ``positions`` ``[N]``."""
    return splitmix64_t(seed_keys ^ splitmix64_t(positions.long() * 4 + stream))


class NoiseRows(NamedTuple):
    """Row hashes left for the Gumbel kernel to compute (no torch ops):
    ``row_hash(seed_keys, positions + offset, stream)``.

    Attributes:
        seed_keys: ``[N]`` int64; positions: ``[N]`` int64; offset, stream: python ints ``>= 0``.
    """

    seed_keys: torch.Tensor
    positions: torch.Tensor
    offset: int
    stream: int

    def hashes(self) -> torch.Tensor:
        """The ``[N]`` int64 row hashes (torch ops)."""
        return row_hash(self.seed_keys, self.positions + self.offset, self.stream)


def gumbel_noise(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` float32 standard Gumbel noise of global token ids ``ids`` ``[C]`` for ``rows`` ``[N]``."""
    h = splitmix64_t(rows.unsqueeze(1) + ids.long().unsqueeze(0) * _GOLDEN)
    u = (_lsr(h, 11).double() + 0.5) * (2.0 ** -53)  # in (0, 1)
    return (-torch.log(-torch.log(u))).float()


class GumbelPick(NamedTuple):
    """Result of a vocab-parallel Gumbel-max draw.

    Attributes:
        token_ids: ``[N]`` int64.
        log_q: ``[N]`` float32, ``log q(x) = l_x / T - LSE`` (0 for greedy rows).
        lse: ``[N]`` float32, the global log-sum-exp of ``l / T`` (greedy rows: of ``l``).
    """

    token_ids: torch.Tensor
    log_q: torch.Tensor
    lse: torch.Tensor


def scaled_logits(local_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``l / T`` in float32 (``T == 0`` rows: ``l``); the one form both the draw and the residual use."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return local_logits.float() / t.unsqueeze(1)


def _use_kernel(local_logits: torch.Tensor, num_real: int) -> bool:
    return (num_real > 0 and local_logits.shape[0] > 0 and local_logits.dtype in FLOAT_DTYPES
            and use_triton(local_logits))


def local_gumbel_top(local_logits: torch.Tensor, vocab_start: int, num_real: int, temperature: torch.Tensor,
                     rows: Union[torch.Tensor, NoiseRows]) -> torch.Tensor:
    """One rank's packed ``[N, 4]`` float32 rows (see the module docstring): the Triton kernels
    (:mod:`mtpspec.ops.gumbel_top`) on CUDA / under ``TRITON_INTERPRET=1``, else
    :func:`local_gumbel_top_ref` (arguments there).
    """
    if _use_kernel(local_logits, num_real):
        from mtpspec.ops.gumbel_top import local_gumbel_top_triton
        return local_gumbel_top_triton(local_logits, vocab_start, num_real, temperature, rows)
    return local_gumbel_top_ref(local_logits, vocab_start, num_real, temperature, rows)


def local_gumbel_top_ref(local_logits: torch.Tensor, vocab_start: int, num_real: int, temperature: torch.Tensor,
                         rows: Union[torch.Tensor, NoiseRows]) -> torch.Tensor:
    """Torch reference of :func:`local_gumbel_top`.

    Args:
        local_logits: ``[N, per_rank]`` this rank's shard (any float dtype); columns ``>= num_real``
            are vocab padding and never win.
        vocab_start: global id of column 0.
        num_real: real columns of this shard (may be 0).
        temperature: ``[N]`` float32; 0 = greedy row (no noise).
        rows: ``[N]`` int64 row hashes (:func:`row_hash`), or :class:`NoiseRows`.
    """
    if isinstance(rows, NoiseRows):
        rows = rows.hashes()
    n = local_logits.shape[0]
    if num_real <= 0:
        out = torch.full((n, 4), float("-inf"), dtype=torch.float32, device=local_logits.device)
        out[:, 1] = torch.zeros(n, dtype=torch.int32, device=local_logits.device).view(torch.float32)
        return out
    x = scaled_logits(local_logits[:, :num_real], temperature)
    ids = torch.arange(vocab_start, vocab_start + num_real, device=x.device)
    g = gumbel_noise(rows, ids)
    score = torch.where((temperature > 0).unsqueeze(1), x + g, x)
    best = score.argmax(dim=-1)
    top = score.gather(1, best.unsqueeze(1)).squeeze(1)
    chosen = x.gather(1, best.unsqueeze(1)).squeeze(1)
    lse = torch.logsumexp(x, dim=-1)
    gid = (best + vocab_start).to(torch.int32).view(torch.float32)
    return torch.stack([top, gid, lse, chosen], dim=1)


def pick_gumbel(gathered: torch.Tensor) -> GumbelPick:
    """Combine ``[tp, N, 4]`` packed rows (rank order): the first rank with the largest score
    (NaN counts as the largest) gives the id and the chosen logit; the log-sum-exps combine."""
    score = gathered[..., 0]
    score = torch.where(torch.isnan(score), torch.full_like(score, float("inf")), score)
    rank = score.argmax(dim=0, keepdim=True)  # first maximum in rank order
    pick = gathered.gather(0, rank.unsqueeze(-1).expand(1, -1, 4)).squeeze(0)
    ids = pick[:, 1].contiguous().view(torch.int32).long()
    lse = torch.logsumexp(gathered[..., 2], dim=0)
    return GumbelPick(ids, pick[:, 3] - lse, lse)


def vocab_parallel_gumbel_sample(local_logits: torch.Tensor, vocab_start: int, num_real: int,
                                 temperature: torch.Tensor, rows: Union[torch.Tensor, NoiseRows],
                                 counter: str = "all_gather_draft_sample",
                                 out: Optional[GumbelPick] = None) -> GumbelPick:
    """Draw one token per row from ``softmax(l / T)`` over the real vocab (argmax where ``T == 0``).

    Arguments as :func:`local_gumbel_top_ref`. One all-gather of ``[1, N, 4]`` float32 per rank
    (:data:`PACKED_BYTES_PER_ROW` bytes per row), counted under ``counter``; at tp 1 none, and
    with the kernels the pick of the single rank is fused into their last launch (same bits as
    :func:`pick_gumbel`). ``out``: a :class:`GumbelPick` of ``[N]`` tensors (int64 ids, float32
    log q / lse, any stride) to write and return. No host sync; fixed shapes (CUDA-graph capturable).
    """
    if get_tensor_model_parallel_world_size() == 1:
        if _use_kernel(local_logits, num_real):
            from mtpspec.ops.gumbel_top import local_gumbel_top_triton
            n, dev = local_logits.shape[0], local_logits.device
            if out is None:
                out = GumbelPick(torch.empty(n, dtype=torch.int64, device=dev),
                                 torch.empty(n, dtype=torch.float32, device=dev),
                                 torch.empty(n, dtype=torch.float32, device=dev))
            local_gumbel_top_triton(local_logits, vocab_start, num_real, temperature, rows, out=out)
            return out
        pick = pick_gumbel(local_gumbel_top(local_logits, vocab_start, num_real, temperature, rows).unsqueeze(0))
    else:
        packed = local_gumbel_top(local_logits, vocab_start, num_real, temperature, rows)
        pick = pick_gumbel(tensor_model_parallel_all_gather(packed.unsqueeze(0), dim=0, counter=counter))
    if out is None:
        return pick
    for dst, src in zip(out, pick):
        dst.copy_(src)
    return out
