"""Triton device functions shared by the kernels; compiled kernels inline them.

- :func:`round_to_dtype`: an fp32 block rounded to the output dtype. Triton's interpreter
  truncates in ``.to(tl.bfloat16)``, so kernels launched under it with bf16 outputs pass
  ``BF16_BY_BITS=True`` and get round-to-nearest-even by integer ops on the fp32 bits; compiled
  kernels pass ``False`` and use the native conversion (the GPU rounds to nearest even).
- The two halves of a row RMSNorm (Zhang & Sennrich 2019, eq. 4), statistics in fp32:
  :func:`rms_rstd` (``1 / sqrt(mean(x**2) + eps)`` per row) and :func:`rms_normed`
  (``x * rstd * weight`` rounded to the output dtype). Used by ``rms_norm`` /
  ``fused_add_rms_norm``, ``fused_eh_norm`` and the p2p all-reduce backend, which round the
  residual sum with :func:`round_to_dtype` and normalise that rounded sum (the residual
  convention of docs/structures.md).

The kernels keep their loads and stores (where a row comes from and goes to differs: one
tensor, one of two halves, a sum over peers' slots); these functions hold the arithmetic, with
the same operations in the same order as when it was written out in each kernel, so the compiled
code is unchanged (same PTX for sm_90).
"""

from mtpspec.ops.triton_utils import HAS_TRITON, device_function, tl

if HAS_TRITON:
    @device_function
    def round_to_dtype(x, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """fp32 ``x`` converted to ``dtype``; with ``BF16_BY_BITS`` (``dtype`` bf16, interpreter)
        rounded to nearest even by integer ops: add ``0x7FFF`` plus the lowest kept bit, drop
        the low 16 bits."""
        if BF16_BY_BITS:
            b = x.to(tl.uint32, bitcast=True)
            b = b + 0x7FFF + ((b >> 16) & 1)
            x_low = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            x_low = x.to(dtype)
        return x_low

    @device_function
    def rms_rstd(sq, n_cols, eps):
        """``1 / sqrt(sum(sq, axis=1) / n_cols + eps)``: the per-row inverse RMS of a
        ``[BLOCK_M, BLOCK_N]`` fp32 block of squares (a whole row's ``x * x``, or the
        accumulated squares of a row's column blocks)."""
        return tl.rsqrt(tl.sum(sq, axis=1) / n_cols + eps)

    @device_function
    def rms_normed(x, rstd, w, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """``x * rstd[:, None] * w[None, :]`` rounded to ``dtype`` (``x`` ``[BLOCK_M, BLOCK_N]``
        fp32, ``rstd`` ``[BLOCK_M]`` from :func:`rms_rstd`, ``w`` ``[BLOCK_N]`` fp32 weight)."""
        y = x * rstd[:, None] * w[None, :]
        return round_to_dtype(y, dtype, BF16_BY_BITS)
