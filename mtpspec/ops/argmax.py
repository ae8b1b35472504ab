"""Vocab-parallel greedy tokens: a shard's ``(max, first arg-max)`` pairs and the cross-rank pick.

Used by ``LogitsProcessor.get_top_tokens`` (mtpspec/layers/logits_processor.py explains why the
local reductions give the global ``torch.argmax``). The contract of every function here is
``torch.argmax``'s: the first maximum wins ties, NaN counts as larger than everything (the first
NaN wins), a row of all ``-inf`` gives its first id. Values and ids travel as float64, exact for
every fp32/bf16/fp16 value and every id below ``2**53``.

Kernels (Triton) and launch counts, all without a host sync and CUDA-graph capturable (the launch
shape depends only on shapes and the device's SM count):

* :func:`local_top_pairs` / :func:`local_argmax`: 1 launch when one program per row already
  fills the GPU (many tokens or a short shard), else 2. A row of ``num_real`` columns is cut
  into ``C`` column chunks; stage 1 (grid ``(num_tokens, C)``) writes each chunk's maximum and
  first arg-max to a ``[num_tokens, C]`` scratch (fp32 value, int32 column); stage 2 (grid over
  blocks of rows) combines the ``C`` partials in chunk order (first NaN chunk, else the first
  chunk holding the largest value; chunks are id-ordered, so the first qualifying chunk holds
  the first qualifying id) and writes the float64 pair (or the int64 id). ``C`` is chosen so
  that about ``TARGET_PROGRAMS_PER_SM`` programs run per SM, and no chunk is shorter than
  ``MIN_CHUNK_COLS`` columns. Why split: at 1 token and a 151552-column shard, one program per
  row would stream 300 KB through one SM while 131 idle; split, ~74 programs read 4 KB each.
  Why two launches rather than one: a one-launch version needs cross-program communication
  (a packed 64-bit ``atomic_max`` on a pre-zeroed output, or a "last program combines" counter
  that must start zeroed and be reset), i.e. persistent per-device state or a memset launch,
  and its output would still need converting to the float64 pair; the second launch reads
  ``num_tokens * C * 8`` bytes and costs a few microseconds inside a CUDA graph.
  With ``num_real == 0`` a single stage-2 launch writes the sentinels. Rows may have any stride;
  logits whose column stride is not 1 are first copied (one more launch).
* :func:`pick_top_tokens`: 1 launch, one lane per token, a loop over the ranks in rank order.

Dispatch (docs/structures.md, "Dispatch of ops"): the kernels run on CUDA tensors (and on CPU
tensors under ``TRITON_INTERPRET=1``) by :func:`~mtpspec.ops.triton_utils.use_triton`; the torch
references (``*_ref``) run otherwise, and for logits of other dtypes (e.g. float64).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mtpspec.ops.triton_utils import (FLOAT_DTYPES, HAS_TRITON, LazyKernel, cdiv, interpreting,
                                      next_power_of_2, tl, use_triton)

#: Largest id (exclusive) a float64 represents exactly along with every smaller integer.
MAX_EXACT_ID = 2**53
#: Columns a stage-1 program loads per loop iteration (fewer when the row is shorter).
BLOCK_COLS = 2048
#: Shortest column chunk worth its own program.
MIN_CHUNK_COLS = 2048
#: Programs per SM the split aims at (two resident programs hide each other's load latency).
TARGET_PROGRAMS_PER_SM = 2
#: Most chunks per row (bounds the stage-2 tile).
MAX_CHUNKS = 512
#: SM count assumed under the Triton interpreter (CPU tensors), so tests exercise the split.
INTERPRETER_SMS = 4
#: Under the interpreter, load bf16 logits as int16 bits and widen them exactly (bf16 loads were
#: seen to misbehave in some Triton interpreters); compiled kernels always load bf16 natively.
BF16_BITS_IN_INTERPRETER = True
#: Stage-1 / pick warps.
NUM_WARPS = 4
#: Elements of a stage-2 tile (rows x chunks).
COMBINE_TILE = 4096
#: Tokens per program of the pick kernel.
PICK_BLOCK_T = 256

_MODE_PARTIAL, _MODE_PAIR, _MODE_ID = 0, 1, 2


# ---------------------------------------------------------------- torch references

def _check_local(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> None:
    if not isinstance(local_logits, torch.Tensor):
        raise TypeError(f"local_top_pairs: local_logits must be a torch.Tensor, got {type(local_logits).__name__}")
    if local_logits.dim() != 2:
        raise ValueError(f"local_top_pairs: expected [num_tokens, per_rank] logits, got {list(local_logits.shape)}")
    for name, v in (("vocab_start", vocab_start), ("num_real", num_real)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"local_top_pairs: {name} must be an int, got {type(v).__name__}")
    if not 0 <= num_real <= local_logits.shape[1]:
        raise ValueError(f"local_top_pairs: num_real={num_real} outside [0, {local_logits.shape[1]}]")
    if vocab_start < 0 or vocab_start + num_real > MAX_EXACT_ID:
        raise ValueError(f"local_top_pairs: ids [{vocab_start}, {vocab_start + num_real}) must lie in "
                         f"[0, 2**53] (float64 holds them exactly)")


def _check_pairs(pairs: torch.Tensor) -> None:
    if not isinstance(pairs, torch.Tensor):
        raise TypeError(f"pick_top_tokens: pairs must be a torch.Tensor, got {type(pairs).__name__}")
    if pairs.dim() != 3 or pairs.shape[-1] != 2 or pairs.dtype != torch.float64:
        raise ValueError(f"pick_top_tokens: expected [tp, num_tokens, 2] float64, got "
                         f"{list(pairs.shape)} {pairs.dtype}")
    if pairs.shape[0] == 0:
        raise ValueError("pick_top_tokens: expected at least one rank (tp >= 1), got pairs of shape "
                         f"{list(pairs.shape)}")


def local_top_pairs_ref(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """Torch reference of :func:`local_top_pairs` (same arguments, result and errors):
    ``torch.argmax`` over the real columns, a gather, a float64 stack."""
    _check_local(local_logits, vocab_start, num_real)
    num_tokens = local_logits.shape[0]
    if num_real == 0:
        pairs = torch.empty(num_tokens, 2, dtype=torch.float64, device=local_logits.device)
        pairs[:, 0] = float("-inf")
        pairs[:, 1] = -1.0
        return pairs
    real = local_logits[:, :num_real]
    idx = torch.argmax(real, dim=-1)
    val = real.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return torch.stack([val.to(torch.float64), (idx + vocab_start).to(torch.float64)], dim=-1)


def local_argmax_ref(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """Torch reference of :func:`local_argmax`: ``argmax(local_logits[:, :num_real]) + vocab_start``
    as int64 (``-1`` per row when ``num_real == 0``)."""
    _check_local(local_logits, vocab_start, num_real)
    if num_real == 0:
        return torch.full((local_logits.shape[0],), -1, dtype=torch.int64, device=local_logits.device)
    return torch.argmax(local_logits[:, :num_real], dim=-1) + vocab_start


def pick_top_tokens_ref(pairs: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`pick_top_tokens` (same argument, result and errors): a masked
    maximum over ranks, then the first hit in rank order."""
    _check_pairs(pairs)
    vals, ids = pairs[..., 0], pairs[..., 1]
    valid = ids >= 0
    is_nan = torch.isnan(vals) & valid
    vmax = vals.masked_fill(~valid, float("-inf")).amax(dim=0, keepdim=True)
    hit = torch.where(is_nan.any(dim=0, keepdim=True), is_nan, valid & (vals == vmax))
    first = torch.argmax(hit.to(torch.uint8), dim=0, keepdim=True)  # first True in rank order
    return ids.gather(0, first).squeeze(0).to(torch.int64)


# ---------------------------------------------------------------- kernels

if HAS_TRITON:
    def _chunk_kernel(x_ptr, part_val_ptr, part_idx_ptr, pair_ptr, id_ptr, n_real, chunk,
                      n_chunks, stride_row, vocab_start,
                      MODE: tl.constexpr, BLOCK: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        # Program (row, c) reduces columns [c * chunk, min((c + 1) * chunk, n_real)) of its row
        # (unit column stride). Each lane keeps its own running (value, column); lanes see
        # increasing columns, so a strict "beats" (larger, or the first NaN) keeps each lane's
        # first maximum / first NaN. A lane starts at (-inf, its first column): if every real
        # value is -inf, the lane holding the chunk's first column wins the final tie (the other
        # lanes hold larger columns, real or not). Whole blocks load unmasked (16-byte vectors
        # when the row start and chunk are aligned); the last, partial block is masked with
        # -inf, which never updates a lane.
        # BF16_BY_BITS: bf16 loaded as int16 bits and widened by a shift (exact; the interpreter
        # path, where bf16 loads are not trusted).
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        start = c * chunk
        end = tl.minimum(start + chunk, n_real)
        n_full = (end - start) // BLOCK
        lanes = tl.arange(0, BLOCK)
        base = x_ptr + row * stride_row + start
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        acc_idx = start + lanes
        for i in range(0, n_full):
            cols = i * BLOCK + lanes
            if BF16_BY_BITS:
                x = (tl.load(base + cols).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                x = tl.load(base + cols).to(tl.float32)
            take = (x > acc) | ((x != x) & (acc == acc))
            acc = tl.where(take, x, acc)
            acc_idx = tl.where(take, start + cols, acc_idx)
        cols = n_full * BLOCK + lanes
        tail = start + cols < end
        if BF16_BY_BITS:
            bits = tl.load(base + cols, mask=tail, other=-128)  # int16 0xff80: bf16 -inf
            x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(base + cols, mask=tail, other=float("-inf")).to(tl.float32)
        take = (x > acc) | ((x != x) & (acc == acc))
        acc = tl.where(take, x, acc)
        acc_idx = tl.where(take, start + cols, acc_idx)
        is_nan = acc != acc
        has_nan = tl.max(is_nan.to(tl.int32), axis=0)
        top = tl.max(tl.where(is_nan, float("-inf"), acc), axis=0)
        cand = tl.where(is_nan, has_nan, (acc == top).to(tl.int32) * (1 - has_nan)) != 0
        best = tl.min(tl.where(cand, acc_idx, 2147483647), axis=0)
        val = tl.max(tl.where(cand & (acc_idx == best), acc, float("-inf")), axis=0)
        val = tl.where(has_nan != 0, float("nan"), val)
        if MODE == 0:
            tl.store(part_val_ptr + row * n_chunks + c, val)
            tl.store(part_idx_ptr + row * n_chunks + c, best)
        elif MODE == 1:
            tl.store(pair_ptr + row * 2, val.to(tl.float64))
            tl.store(pair_ptr + row * 2 + 1, (best.to(tl.int64) + vocab_start).to(tl.float64))
        else:
            tl.store(id_ptr + row, best.to(tl.int64) + vocab_start)

    def _combine_kernel(part_val_ptr, part_idx_ptr, pair_ptr, id_ptr, n_rows, n_chunks, vocab_start,
                        MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        # Rows x chunks tile; chunk c holds smaller columns than chunk c + 1, so the smallest
        # column among the qualifying chunks (NaN ones if any, else those holding the maximum)
        # is the row's first NaN / first maximum. No chunk at all (n_chunks == 0): sentinel.
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        chunks = tl.arange(0, BLOCK_C)
        rmask = rows < n_rows
        mask = rmask[:, None] & (chunks < n_chunks)[None, :]
        offs = rows.to(tl.int64)[:, None] * n_chunks + chunks[None, :]
        v = tl.load(part_val_ptr + offs, mask=mask, other=float("-inf"))
        idx = tl.load(part_idx_ptr + offs, mask=mask, other=2147483647)
        is_nan = v != v
        has_nan = tl.max(is_nan.to(tl.int32), axis=1)
        top = tl.max(tl.where(is_nan, float("-inf"), v), axis=1)
        cand = tl.where(is_nan, has_nan[:, None], (v == top[:, None]).to(tl.int32) * (1 - has_nan[:, None]))
        cand = (cand != 0) & mask
        best = tl.min(tl.where(cand, idx, 2147483647), axis=1)
        val = tl.max(tl.where(cand & (idx == best[:, None]), v, float("-inf")), axis=1)
        val = tl.where(has_nan != 0, float("nan"), val)
        gid = tl.where(best == 2147483647, -1, best.to(tl.int64) + vocab_start)
        rows = rows.to(tl.int64)
        if MODE == 1:
            tl.store(pair_ptr + rows * 2, val.to(tl.float64), mask=rmask)
            tl.store(pair_ptr + rows * 2 + 1, gid.to(tl.float64), mask=rmask)
        else:
            tl.store(id_ptr + rows, gid, mask=rmask)

    def _pick_kernel(pairs_ptr, out_ptr, n_ranks, n_tokens, stride_r, stride_t, stride_c,
                     BLOCK_T: tl.constexpr):
        # One lane per token, ranks in order: keep the first valid NaN, and the first valid
        # strictly largest non-NaN value; with neither, rank 0's (sentinel) id, as the reference.
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = toks < n_tokens
        base = pairs_ptr + toks.to(tl.int64) * stride_t
        first_id = tl.load(base + stride_c, mask=mask, other=-1.0)
        nan_id = first_id
        best_id = first_id
        best_v = tl.full([BLOCK_T], float("-inf"), tl.float64)
        has_nan = tl.zeros([BLOCK_T], tl.int32)
        has_valid = tl.zeros([BLOCK_T], tl.int32)
        for r in range(0, n_ranks):
            v = tl.load(base + r * stride_r, mask=mask, other=float("-inf"))
            i = tl.load(base + r * stride_r + stride_c, mask=mask, other=-1.0)
            valid = i >= 0
            v_nan = v != v
            new_nan = valid & v_nan & (has_nan == 0)
            nan_id = tl.where(new_nan, i, nan_id)
            has_nan = tl.where(new_nan, 1, has_nan)
            take = valid & (v == v) & ((has_valid == 0) | (v > best_v))
            best_v = tl.where(take, v, best_v)
            best_id = tl.where(take, i, best_id)
            has_valid = tl.where(take, 1, has_valid)
        out = tl.where(has_nan != 0, nan_id, best_id)
        tl.store(out_ptr + toks, out.to(tl.int64), mask=mask)

    _chunk = LazyKernel(_chunk_kernel)
    _combine = LazyKernel(_combine_kernel)
    _pick = LazyKernel(_pick_kernel)


# ---------------------------------------------------------------- launch planning

class SplitPlan(NamedTuple):
    """Stage-1 shape: ``n_chunks`` chunks of ``chunk`` columns per row, ``block`` columns per loop
    iteration; ``n_chunks == 1`` means one launch (stage 1 writes the result)."""
    chunk: int
    n_chunks: int
    block: int


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``INTERPRETER_SMS`` for a CPU device)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def split_plan(num_tokens: int, num_real: int, sms: int) -> SplitPlan:
    """Column split of ``num_tokens`` rows of ``num_real >= 1`` columns over ``sms`` SMs (see the
    module docstring): ``C = min(ceil(target / num_tokens), ceil(num_real / MIN_CHUNK_COLS),
    MAX_CHUNKS)`` with ``target = TARGET_PROGRAMS_PER_SM * sms``, chunks rounded up to whole
    ``block``s. Every chunk holds at least one real column."""
    block = min(BLOCK_COLS, next_power_of_2(num_real))
    want = cdiv(TARGET_PROGRAMS_PER_SM * sms, max(1, num_tokens))
    n = max(1, min(want, cdiv(num_real, MIN_CHUNK_COLS), MAX_CHUNKS))
    chunk = cdiv(cdiv(num_real, n), block) * block
    return SplitPlan(chunk, cdiv(num_real, chunk), block)


def _launch_local(x: torch.Tensor, vocab_start: int, num_real: int, mode: int) -> torch.Tensor:
    num_tokens = x.shape[0]
    if num_real > 1 and x.stride(1) != 1:  # the kernel reads unit-stride rows
        x = x[:, :num_real].contiguous()
    if mode == _MODE_PAIR:
        out = torch.empty(num_tokens, 2, dtype=torch.float64, device=x.device)
    else:
        out = torch.empty(num_tokens, dtype=torch.int64, device=x.device)
    pair = ids = out  # the unused one of the two outputs is never written
    if num_tokens == 0:
        return out
    if num_real == 0:
        dummy_val = torch.empty(1, dtype=torch.float32, device=x.device)
        dummy_idx = torch.empty(1, dtype=torch.int32, device=x.device)
        _combine[(cdiv(num_tokens, 64),)](dummy_val, dummy_idx, pair, ids, num_tokens, 0, vocab_start,
                                         MODE=mode, BLOCK_T=64, BLOCK_C=1, num_warps=1)
        return out
    plan = split_plan(num_tokens, num_real, num_sms(x.device))
    bf16_bits = BF16_BITS_IN_INTERPRETER and interpreting() and x.dtype == torch.bfloat16
    src = x.view(torch.int16) if bf16_bits else x
    if plan.n_chunks == 1:
        _chunk[(num_tokens, 1)](src, out, out, pair, ids, num_real, plan.chunk, 1, x.stride(0),
                                vocab_start, MODE=mode, BLOCK=plan.block,
                                BF16_BY_BITS=bf16_bits, num_warps=NUM_WARPS)
        return out
    part_val = torch.empty(num_tokens, plan.n_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(num_tokens, plan.n_chunks, dtype=torch.int32, device=x.device)
    _chunk[(num_tokens, plan.n_chunks)](src, part_val, part_idx, pair, ids, num_real, plan.chunk,
                                        plan.n_chunks, x.stride(0), vocab_start,
                                        MODE=_MODE_PARTIAL, BLOCK=plan.block,
                                        BF16_BY_BITS=bf16_bits, num_warps=NUM_WARPS)
    block_c = next_power_of_2(plan.n_chunks)
    block_t = max(1, min(next_power_of_2(num_tokens), COMBINE_TILE // block_c))
    _combine[(cdiv(num_tokens, block_t),)](part_val, part_idx, pair, ids, num_tokens, plan.n_chunks,
                                           vocab_start, MODE=mode, BLOCK_T=block_t, BLOCK_C=block_c,
                                           num_warps=NUM_WARPS)
    return out


# ---------------------------------------------------------------- public dispatchers

def _kernel_ok(x: torch.Tensor) -> bool:
    return x.dtype in FLOAT_DTYPES and x.shape[1] < 2**31 - 1 and use_triton(x)  # int32 columns


def local_top_pairs(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """Each row's maximum and first arg-max over a shard's real columns, as float64 pairs.

    Args:
        local_logits: ``[num_tokens, per_rank]`` logits (fp32/bf16/fp16 for the kernel; other
            float dtypes run the reference) of the shard whose column 0 is global id
            ``vocab_start``; only the first ``num_real`` columns are real (the rest is padding
            and is never read by the kernel). Rows may have any stride; a column stride other than 1
            costs one copy.
        vocab_start: global id of column 0, ``>= 0``.
        num_real: number of real columns, ``0 <= num_real <= per_rank``, with
            ``vocab_start + num_real <= 2**53``.

    Returns:
        ``[num_tokens, 2]`` float64 ``(value, global id)``: the value (exact) and id of the
        row's first maximum, or of its first NaN if it has one (value NaN); an all ``-inf`` row
        gives ``(-inf, vocab_start)``. With ``num_real == 0`` every row is the sentinel
        ``(-inf, -1)``, which :func:`pick_top_tokens` never selects. 1 or 2 kernel launches
        (module docstring), else :func:`local_top_pairs_ref`.

    Raises:
        ValueError: ``local_logits`` is not 2-D, ``num_real`` is out of range, or the ids are
            negative or above ``2**53``. TypeError: a non-tensor or non-int argument.
    """
    _check_local(local_logits, vocab_start, num_real)
    if not _kernel_ok(local_logits):
        return local_top_pairs_ref(local_logits, vocab_start, num_real)
    return _launch_local(local_logits, vocab_start, num_real, _MODE_PAIR)


def local_argmax(local_logits: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """The global id of each row's first maximum (first NaN if any) over the real columns.

    ``== local_top_pairs(...)[:, 1].long()`` without the values: the tp == 1 greedy token
    (``== torch.argmax(local_logits[:, :num_real], -1) + vocab_start``). Arguments, launches and
    errors as :func:`local_top_pairs`.

    Returns:
        ``[num_tokens]`` int64 ids in ``[vocab_start, vocab_start + num_real)``; ``-1`` per row
        when ``num_real == 0``.
    """
    _check_local(local_logits, vocab_start, num_real)
    if not _kernel_ok(local_logits):
        return local_argmax_ref(local_logits, vocab_start, num_real)
    return _launch_local(local_logits, vocab_start, num_real, _MODE_ID)


def pick_top_tokens(pairs: torch.Tensor) -> torch.Tensor:
    """Global greedy tokens from every rank's ``(value, id)`` pairs.

    Args:
        pairs: ``[tp, num_tokens, 2]`` float64 (any strides), rank-major (``pairs[r, t]`` is rank
            ``r``'s pair for token ``t``), as produced by :func:`local_top_pairs` on ranks with
            increasing id ranges. Entries with a negative id are sentinels and never win.

    Returns:
        ``[num_tokens]`` int64: per token, the id of the first rank (in rank order) holding a
        NaN if any rank does, else of the first rank whose value equals the largest value: the id
        ``torch.argmax`` returns on the concatenated logits. A token with no non-sentinel entry
        gets rank 0's (negative) id; this cannot happen when rank 0 has real columns.
        One kernel launch, else :func:`pick_top_tokens_ref`.

    Raises:
        ValueError: ``pairs`` is not ``[tp >= 1, num_tokens, 2]`` float64. TypeError: not a tensor.
    """
    _check_pairs(pairs)
    if not use_triton(pairs):
        return pick_top_tokens_ref(pairs)
    tp, num_tokens, _ = pairs.shape
    out = torch.empty(num_tokens, dtype=torch.int64, device=pairs.device)
    if num_tokens == 0:
        return out
    block_t = min(PICK_BLOCK_T, next_power_of_2(num_tokens))
    _pick[(cdiv(num_tokens, block_t),)](pairs, out, tp, num_tokens, pairs.stride(0), pairs.stride(1),
                                        pairs.stride(2), BLOCK_T=block_t, num_warps=NUM_WARPS)
    return out
