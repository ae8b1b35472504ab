"""Rotary position embedding of queries and keys in one launch: Triton kernel and torch reference.

RoPE: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", eq. 34:
the channel pair ``(a, b)`` of a head at position ``p`` becomes ``(a cos - b sin, b cos + a sin)``
with ``cos, sin`` of ``p * w_i`` (:class:`~mtpspec.layers.rotary_embedding.RotaryEmbedding` builds
the ``[max_position, rotary_dim]`` fp32 table ``cat(cos, sin)``). Pairs: neox style, channel ``i``
with ``i + rotary_dim / 2``; interleaved, ``2 i`` with ``2 i + 1``. Channels past ``rotary_dim``
pass through.

Rounding (Hugging Face's, in the activation dtype): ``cos`` and ``sin`` are rounded to the dtype,
then every product and the sum / difference are each rounded to the dtype, as ``a * cos - b * sin``
evaluates on bf16 tensors. The kernel (bf16 only) rounds at the same points, to nearest even by
integer ops on the fp32 bits (and widens bf16 inputs by their bits: Triton's interpreter converts
bf16 subnormals wrongly), so its result equals :func:`rotary_embedding_ref` bit for bit. With the
native conversions it did not on the H200 (2026-12-03; cause not isolated: a dropped bf16 -> fp32
round trip, which would let the multiply and subtraction contract into an FMA, is the likely one).

Why a kernel: the torch form is about ten elementwise launches per tensor (slices, four
multiplies, add, subtract, two concatenations); at a prefix-cache hit's few dozen rows each
costs a launch's latency, not bytes (2026-12-03 profile, BENCHMARKS.md issue 17). The kernel is
one launch for the query and the key together: program ``(t, j)`` rotates ``BLOCK_H`` heads of
row ``t``, the query's head blocks first, then the key's.
"""

from __future__ import annotations

from typing import Tuple

import torch

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, cdiv, next_power_of_2, tl, use_triton

#: Heads per program (one row's query heads come in blocks of this many; the key's likewise).
BLOCK_H = 16
#: Dtypes the kernel takes (fp16 / fp32 keep the torch path: no integer-op rounding for them here).
KERNEL_DTYPES = (torch.bfloat16,)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                is_neox_style: bool) -> torch.Tensor:
    # x: [T, heads, head_size]; cos / sin: [T, 1, rotary_dim / 2] in x's dtype.
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox_style:
        half = rotary_dim // 2
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                         is_neox_style: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch RoPE (:func:`rotary_embedding`'s arguments and results; differentiable)."""
    half = rotary_dim // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    t = query.shape[0]
    out = []
    for x in (query, key):
        cos, sin = cs[:, None, :half].to(x.dtype), cs[:, None, half:].to(x.dtype)
        heads = x.view(t, x.shape[1] // head_size, head_size)
        out.append(_rotate_ref(heads, cos, sin, rotary_dim, is_neox_style).reshape(x.shape))
    return out[0], out[1]


if HAS_TRITON:
    from mtpspec.ops.triton_helpers import pdl_begin, round_to_dtype
    from mtpspec.ops.triton_utils import device_function

    @device_function
    def _widen(x):
        """A bf16 block as exact fp32, by its bits (Triton's interpreter converts bf16 subnormals
        wrongly; compiled, the same two integer ops)."""
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @device_function
    def _round(x):
        """fp32 ``x`` rounded to the nearest-even bf16 value (``round_to_dtype`` by integer ops),
        widened back to fp32 exactly."""
        return _widen(round_to_dtype(x, tl.bfloat16, True))

    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, num_heads, num_kv_heads, q_blocks,
                     stride_qt, stride_kt, stride_qot, stride_kot, stride_cs,
                     HEAD: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                     BLOCK_H: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        # bf16 only; every value in fp32 holds a bf16 (each product, sum and difference rounded)
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        if j < q_blocks:
            src = q_ptr + t * stride_qt
            dst = qo_ptr + t * stride_qot
            h0 = j * BLOCK_H
            n_heads = num_heads
        else:
            src = k_ptr + t * stride_kt
            dst = ko_ptr + t * stride_kot
            h0 = (j - q_blocks) * BLOCK_H
            n_heads = num_kv_heads
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_i = tl.arange(0, BLOCK_HALF)
        i_ok = offs_i < HALF
        cos = _round(tl.load(cs_ptr + pos * stride_cs + offs_i, mask=i_ok, other=0.0))[None, :]
        sin = _round(tl.load(cs_ptr + pos * stride_cs + HALF + offs_i, mask=i_ok, other=0.0))[None, :]
        heads = h0 + tl.arange(0, BLOCK_H)
        h_ok = heads < n_heads
        base = heads[:, None] * HEAD
        if NEOX:
            ia = offs_i
            ib = offs_i + HALF
        else:
            ia = 2 * offs_i
            ib = 2 * offs_i + 1
        m = h_ok[:, None] & i_ok[None, :]
        a = _widen(tl.load(src + base + ia[None, :], mask=m, other=0.0))
        b = _widen(tl.load(src + base + ib[None, :], mask=m, other=0.0))
        out_a = round_to_dtype(_round(a * cos) - _round(b * sin), tl.bfloat16, True)
        out_b = round_to_dtype(_round(b * cos) + _round(a * sin), tl.bfloat16, True)
        tl.store(dst + base + ia[None, :], out_a, mask=m)
        tl.store(dst + base + ib[None, :], out_b, mask=m)
        if BLOCK_REST > 0:
            offs_r = 2 * HALF + tl.arange(0, BLOCK_REST)
            mr = h_ok[:, None] & (offs_r < HEAD)[None, :]
            tl.store(dst + base + offs_r[None, :], tl.load(src + base + offs_r[None, :], mask=mr), mask=mr)

    _rope = LazyKernel(_rope_kernel, pdl=True)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` channels of every query and key head (module docstring).

    Args:
        positions: ``[T]`` int32/int64 (any stride), each in ``[0, cos_sin_cache.shape[0])``
            (not checked on the device).
        query: ``[T, num_heads * head_size]``, key: ``[T, num_kv_heads * head_size]``, fp16 /
            bf16 / fp32; rows may be strided (e.g. column slices of a fused qkv output).
        cos_sin_cache: ``[max_position, rotary_dim]`` fp32, ``cat(cos, sin)`` per position.
        head_size, rotary_dim: channels per head and rotated channels (even, ``<= head_size``).
        is_neox_style: the pairing (module docstring).

    Returns:
        ``(query, key)``: new contiguous tensors of the inputs' shapes and dtypes.

    Raises:
        ValueError: shapes that do not fit together, ``head_size <= 0`` or a ``cos_sin_cache``
            that is not ``[max_position, rotary_dim]`` (named in the message).

    The Triton kernel runs for bf16 query and key with unit-stride rows (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); everything else, and autograd, takes
    :func:`rotary_embedding_ref`. Both give identical bits. No host sync, CUDA-graph capturable.
    """
    t = query.shape[0]
    if positions.dim() != 1 or positions.shape[0] != t or key.shape[0] != t or query.dim() != 2 or key.dim() != 2:
        raise ValueError(f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key {tuple(key.shape)} "
                         "must be [T], [T, heads * head_size] and [T, kv_heads * head_size]")
    if head_size <= 0 or query.shape[1] % head_size or key.shape[1] % head_size or rotary_dim % 2 \
            or not 0 < rotary_dim <= head_size:
        raise ValueError(f"query width {query.shape[1]} and key width {key.shape[1]} must be multiples of "
                         f"head_size={head_size} (> 0), and rotary_dim={rotary_dim} even in (0, head_size]")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}], got "
                         f"{tuple(cos_sin_cache.shape)}")
    fast = (query.dtype in KERNEL_DTYPES and key.dtype == query.dtype and query.stride(1) == 1
            and key.stride(1) == 1 and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
            and use_triton(query, key, cos_sin_cache))
    if not fast:
        return rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    positions = positions.contiguous()  # the kernel reads one position per row at unit stride
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if t == 0:
        return q_out, k_out
    nh, nkv = query.shape[1] // head_size, key.shape[1] // head_size
    q_blocks = cdiv(nh, BLOCK_H)
    half = rotary_dim // 2
    rest = head_size - rotary_dim
    _rope[(t, q_blocks + cdiv(nkv, BLOCK_H))](
        query, key, q_out, k_out, positions, cos_sin_cache, nh, nkv, q_blocks,
        query.stride(0), key.stride(0), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
        HEAD=head_size, HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_REST=next_power_of_2(rest) if rest else 0,
        BLOCK_H=BLOCK_H, NEOX=bool(is_neox_style), num_warps=4)
    return q_out, k_out
