"""triton_helpers.round_to_dtype by bits (what the RoPE kernel uses compiled, and every kernel under
the interpreter) equals torch's fp32 -> bf16 conversion bit for bit on finite values and infinities,
and keeps a NaN a NaN of the same sign, whatever its payload: the GPU's canonical NaN 0x7FFFFFFF
(what an invalid multiply such as inf * 0 gives there) carried into -0.0 before 2026-12-03."""

import pytest
import torch

from mtpspec.ops.triton_utils import HAS_TRITON, LazyKernel, cdiv, tl

if not HAS_TRITON:
    pytest.skip("triton not installed", allow_module_level=True)

from mtpspec.ops.triton_helpers import round_to_dtype  # noqa: E402


def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, round_to_dtype(x, tl.bfloat16, True), mask=ok)


_round = LazyKernel(_round_kernel)

SPECIAL_BITS = [
    0x7FFFFFFF, 0xFFFFFFFF,  # NaN, all payload bits set (the GPU's canonical NaN and its negative)
    0x7F800001, 0x7FBFFFFF, 0xFF800001,  # signalling NaNs with low payloads only / all below the quiet bit
    0x7FC00000, 0xFFC00000, 0x7FFF8000,  # quiet NaNs (x86's default, its negative, a carry-prone one)
    0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,  # +-inf, +-max finite (rounds up to inf)
    0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000,  # just below / at / a tie below the largest bf16
    0x00000001, 0x00008000, 0x00018000, 0x0000FFFF, 0x80008001,  # subnormals, ties, a carry into the exponent
    0x3F808000, 0x3F818000, 0x00000000, 0x80000000,  # ties to even both ways, +-0
]


def test_round_to_dtype_by_bits_matches_torch(kdev):
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2 ** 31), 2 ** 31, (4093,), generator=g, dtype=torch.int64)
    bits = torch.cat([torch.tensor(SPECIAL_BITS, dtype=torch.int64), random_bits])
    x = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32).to(kdev)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=kdev)
    _round[(cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.cpu().to(torch.bfloat16)
    got = y.cpu()
    nan = x.cpu().isnan()
    assert torch.equal(got.isnan(), nan), x.cpu()[got.isnan() != nan]
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(got[nan].view(torch.int16) < 0, x.cpu()[nan].view(torch.int32) < 0)  # sign kept

