"""Triton device functions shared by the kernels; compiled kernels inline them.

- :func:`round_to_dtype`: an fp32 block rounded to the output dtype. Triton's interpreter
  truncates in ``.to(tl.bfloat16)``, so kernels launched under it with bf16 outputs pass
  ``BF16_BY_BITS=True`` and get round-to-nearest-even by integer ops on the fp32 bits; compiled
  kernels pass ``False`` and use the native conversion (the GPU rounds to nearest even), except
  ``ops/rotary.py``'s, which passes ``True`` everywhere to keep every intermediate rounding.
- :func:`quant_fp8` / :func:`dequant_kv`: an fp8 (E4M3) KV cache's write rounding (nearest even,
  saturating at +-448; by integer ops under the interpreter) and tile read (``x * scale`` in the
  query's dtype), :mod:`mtpspec.ops.kv_quant`.
- The two halves of a row RMSNorm (Zhang & Sennrich 2019, eq. 4), statistics in fp32:
  :func:`rms_rstd` (``1 / sqrt(mean(x**2) + eps)`` per row) and :func:`rms_normed`
  (``x * rstd * weight`` rounded to the output dtype), used by ``rms_norm`` /
  ``fused_add_rms_norm``, ``fused_eh_norm`` and the p2p all-reduce backend;
  :func:`store_rounded` (the residual sum rounded once to the dtype and stored; the norm is
  taken of that rounded sum, the residual convention of docs/structures.md) and
  :func:`store_rms_normed` (normalise with a loaded weight, store), :func:`store_rms_norm_rows`
  (both halves for rows held whole in one block, the weight loaded before the reduction) and
  :func:`rms_norm_pass2` (the read-back pass of rows longer than one block) for the kernels whose rows live in
  ``[rows, stride]`` tensors (``rms_norm`` and the p2p backend).
- :func:`store_swap_tile`: the epilogue (bias, split-K partial or rounded store) of the swap-AB
  GEMMs (``fp8_gemm``'s FP8 swap kernel and ``skinny_gemm``).
- :func:`last_to_arrive`: a program's arrival on a counter shared by the programs whose partial
  results one of them then reduces (the last to arrive), so the reduction needs no launch of its
  own; the counters are :func:`~mtpspec.ops.triton_utils.arrival_counters`.

Where a row comes from differs (one tensor, one of two halves, a sum over peers' slots), so
those loads stay in the kernels (as kernel-local device functions). Each function holds the same
operations in the same order as when they were written out in each kernel (address arithmetic
included, computed where it was), so the compiled code did not change: identical sm_90 PTX for
every variant a GPU compiles (``BF16_BY_BITS=False``), until 2026-12-04, when
:func:`store_rms_norm_rows` moved its weight load before the reduction (same values, one memory
round trip fewer). Define new helpers with
:func:`~mtpspec.ops.triton_utils.device_function`, not ``@triton.jit``, so that kernels run by
the interpreter can call them too.
"""

from mtpspec.ops.triton_utils import HAS_TRITON, device_function, tl

if HAS_TRITON:
    from triton.language.extra import cuda as tl_cuda

    @device_function
    def pdl_begin(PDL: tl.constexpr):
        """The start of a kernel built with ``LazyKernel(fn, pdl=True)``: under a programmatic
        dependent launch (``PDL``), wait until the kernel before it in the stream has finished and
        its writes are visible (``griddepcontrol.wait``), then let the kernel after it launch
        (``griddepcontrol.launch_dependents``: its programs start and wait in turn, so its launch
        overlaps this kernel's work). Nothing without ``PDL``."""
        if PDL:
            tl_cuda.gdc_wait()
            tl_cuda.gdc_launch_dependents()

    @device_function
    def round_to_dtype(x, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """fp32 ``x`` converted to ``dtype``; with ``BF16_BY_BITS`` (``dtype`` bf16: under the
        interpreter, and compiled in ``ops/rotary.py``) rounded to nearest even by integer ops:
        add ``0x7FFF`` plus the lowest kept bit, drop the low 16 bits; a NaN keeps its sign and
        high bits with the quiet bit set (the add would carry a NaN whose low mantissa bits are
        all ones, such as the GPU's canonical 0x7FFFFFFF, into -0.0)."""
        if BF16_BY_BITS:
            b = x.to(tl.uint32, bitcast=True)
            nan = (b & 0x7FFFFFFF) > 0x7F800000
            b = tl.where(nan, b | 0x400000, b + 0x7FFF + ((b >> 16) & 1))
            x_low = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            x_low = x.to(dtype)
        return x_low

    @device_function
    def quant_fp8(x, scale, FP8_BY_BITS: tl.constexpr):
        """fp32 ``x`` stored in an fp8 (E4M3) cache: ``clamp(x / scale, -448, 448)`` rounded to
        nearest even (:mod:`mtpspec.ops.kv_quant`). With ``FP8_BY_BITS`` (interpreter, whose
        fp32 -> fp8 cast truncates and overflows) the value is first rounded to an E4M3 value
        by integer ops on the fp32 bits (normals: keep 3 mantissa bits; below ``2^-6``:
        multiples of ``2^-9`` by the ``2^23`` add-subtract), which the cast then keeps exactly;
        compiled kernels use the native saturating, nearest-even conversion
        (``cvt.rn.satfinite``). The division is correctly rounded (``div_rn``: Triton's ``/`` is
        an approximate division on GPUs), so the stored codes are torch's for any scale."""
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        if FP8_BY_BITS:
            b = y.to(tl.uint32, bitcast=True)
            sign = b & 0x80000000
            a = b & 0x7FFFFFFF
            rn = (a + 0x7FFFF + ((a >> 20) & 1)) & 0xFFF00000
            af = a.to(tl.float32, bitcast=True)
            sub = ((af * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
            r = tl.where(a >= 0x3C800000, rn, sub.to(tl.uint32, bitcast=True))
            y = (r | sign).to(tl.float32, bitcast=True)
        return y.to(tl.float8e4nv)

    @device_function
    def dequant_kv(x, scale, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """A tile loaded from an fp8 cache as the query's ``dtype``: ``float(x) * scale``
        rounded to ``dtype`` (:func:`round_to_dtype`; ``BF16_BY_BITS`` under the interpreter)."""
        return round_to_dtype(x.to(tl.float32) * scale, dtype, BF16_BY_BITS)

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

    @device_function
    def store_rounded(ptr, rows, stride, cols, x, mask, BF16_BY_BITS: tl.constexpr):
        """Store fp32 ``x`` (``[BLOCK_M, BLOCK_N]``) rounded to ``ptr``'s element type at
        ``ptr + rows[:, None] * stride + cols[None, :]``; return the stored values in fp32 (a
        residual sum: the norm is then taken of the rounded values)."""
        x_low = round_to_dtype(x, ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(ptr + rows[:, None] * stride + cols[None, :], x_low, mask=mask)
        return x_low.to(tl.float32)

    @device_function
    def store_rms_normed(out_ptr, w, rows, stride, cols, mask, x, rstd, BF16_BY_BITS: tl.constexpr):
        """Store :func:`rms_normed` of ``x`` with the weight's columns ``w`` (``[BLOCK_N]`` fp32,
        loaded by the caller) at ``out_ptr + rows[:, None] * stride + cols[None, :]`` in
        ``out_ptr``'s element type."""
        y_low = rms_normed(x, rstd, w, out_ptr.dtype.element_ty, BF16_BY_BITS)
        tl.store(out_ptr + rows[:, None] * stride + cols[None, :], y_low, mask=mask)

    @device_function
    def store_rms_norm_rows(out_ptr, w_ptr, rows, stride, cols, col_mask, mask, x, n_cols, eps,
                            BF16_BY_BITS: tl.constexpr):
        """RMSNorm of whole rows held in one block: :func:`rms_rstd` of fp32 ``x``
        (``[BLOCK_M, BLOCK_N]``, zero where masked off), then :func:`store_rms_normed`. The
        weight is loaded before the sum of squares: after it, the reduction's barrier kept the load
        from issuing with the row's (a second memory round trip on a one-row kernel's path)."""
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        store_rms_normed(out_ptr, w, rows, stride, cols, mask, x, rms_rstd(x * x, n_cols, eps), BF16_BY_BITS)

    @device_function
    def rms_norm_pass2(src_ptr, src_stride, out_ptr, w_ptr, rows, row_mask, out_stride, cols,
                       n_cols, rstd, BLOCK_N: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """Second pass of a row norm over column blocks (rows too long for one block): after a
        block barrier (``src`` may hold this block's own stores of the first pass), read each
        block of ``cols`` of the rows back from ``src`` and store it normalised with ``rstd``."""
        tl.debug_barrier()
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            s = tl.load(src_ptr + rows[:, None] * src_stride + c[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=col_mask, other=0.0).to(tl.float32)
            store_rms_normed(out_ptr, w, rows, out_stride, c, mask, s, rstd, BF16_BY_BITS)

    @device_function
    def store_swap_tile(acc, b_ptr, out_ptr, part_ptr, pid_k, offs_n, cols, rows, n_ok, t_ok, M, N, stride_om,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        """The epilogue of a swap-AB GEMM program (``fp8_gemm``'s FP8 swap kernel, ``skinny_gemm``):
        ``acc`` = the fp32 ``out^T`` tile ``[BLOCK_N, BLOCK_T]`` of weight rows ``offs_n`` (``cols``
        as int64, mask ``n_ok``) and token rows ``rows`` (mask ``t_ok``) over K split ``pid_k``; the
        bias (``[N]``) added once, in split 0; ``SPLIT``: stored fp32 to ``part_ptr [splits, M, N]``,
        else rounded to ``out_ptr``'s dtype at ``out [M, N]`` (row stride ``stride_om``)."""
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        ok = n_ok[:, None] & t_ok[None, :]
        if SPLIT:
            tl.store(part_ptr + pid_k.to(tl.int64) * M * N + rows[None, :] * N + cols[:, None], acc, mask=ok)
        else:
            y = round_to_dtype(acc, out_ptr.dtype.element_ty, BF16_BY_BITS)
            tl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], y, mask=ok)

    @device_function
    def last_to_arrive(counter_ptr, total):
        """True in the program that arrives last of the ``total`` programs sharing the int32 counter
        at ``counter_ptr`` (which must read 0 before the first of them arrives); that program must
        store 0 back when it is done with the reduction (the next launch finds it zeroed).

        The ordering is the semaphore pattern of CUTLASS (``cutlass/semaphore.h``: a CTA barrier,
        then one thread's gpu-scope release / acquire): the barrier puts every thread's stores of
        this program before the counter's ``acq_rel`` add, so the last program, after its add,
        sees every other program's stores; the caller reads them past L1 (``cache_modifier=".cg"``).
        A launch stopped part-way leaves its counter non-zero (later launches then never reduce):
        the kernels that use it have no early exit before their arrival."""
        tl.debug_barrier()
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        return old == total - 1

