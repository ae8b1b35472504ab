"""FP8 KV-cache storage (``--kv-cache-dtype fp8``): the torch side of quantise / dequantise.

Format: OCP FP8 E4M3 (``torch.float8_e4m3fn``, Triton's ``tl.float8e4nv``): 3 mantissa bits,
finite maximum 448, no infinities. One scale per layer and cache part (vLLM's ``k_scale`` /
``v_scale``: a float kept on the cache-owning layer, 1.0 when the checkpoint gives none, as
vLLM does without ``calculate_kv_scales``):

- write: ``x_fp8 = e4m3(clamp(x / scale, -448, 448))``, rounded to nearest even (saturating);
- read: ``x = (float(x_fp8) * scale)`` rounded to the query's dtype (vLLM's Triton attention does
  the same: ``(K.to(fp32) * k_scale).to(Q.dtype)``), inside the kernels' tile loads (GQA attention,
  indexer); the MLA kernels (dense and sparse) instead convert tiles unscaled (exact) and apply
  ``k_scale`` to their fp32 scores and outputs, i.e. read ``float(x_fp8) * scale`` in fp32
  (``dequantize_cache(x, torch.float32, scale)``). The cache is never dequantised as a whole.

A cache of any other dtype is stored and read as before (``scale`` ignored). The Triton halves
are :func:`~mtpspec.ops.triton_helpers.quant_fp8` and
:func:`~mtpspec.ops.triton_helpers.dequant_kv`; this module holds the torch references the
``*_ref`` ops and the SDPA fall-backs use.
"""

from __future__ import annotations

import torch

from mtpspec.config import KV_CACHE_DTYPES

#: The stored dtype of an fp8 cache.
FP8_KV_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3 value; writes saturate to +-this.
FP8_E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the fp8 cache dtype."""
    return dtype == FP8_KV_DTYPE


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The stored cache dtype for a ``--kv-cache-dtype`` value: ``auto`` -> ``model_dtype``,
    ``fp8`` / ``fp8_e4m3`` -> ``torch.float8_e4m3fn``.

    Raises:
        ValueError: any other value (named, with the accepted ones).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``cache_dtype``: fp8 -> ``clamp(float(x) / scale, +-448)``
    cast to E4M3 (torch's cast: nearest even); else ``x.to(cache_dtype)`` (``scale`` unused)."""
    if is_fp8(cache_dtype):
        return (x.float() / float(scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache values ``x`` as the kernels read them for queries of ``dtype``: fp8 ->
    ``(float(x) * scale).to(dtype)``; any other cache dtype -> ``x`` unchanged."""
    if is_fp8(x.dtype):
        return (x.float() * float(scale)).to(dtype)
    return x


def raw(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as bytes when it is fp8 (torch has no ``index_copy_`` / ``where`` for fp8 on
    CPU; the writes move the bytes), else ``x``."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def check_cache_dtype(op: str, q_dtype: torch.dtype, *caches: torch.Tensor) -> bool:
    """The caches all have ``q_dtype`` (returns False) or are all fp8 (returns True).

    Raises:
        TypeError: anything else (names ``op`` and the dtypes).
    """
    if all(c.dtype == q_dtype for c in caches):
        return False
    if all(is_fp8(c.dtype) for c in caches):
        return True
    raise TypeError(f"{op}: the query and the caches must share one of float16/bfloat16/float32, or the caches all "
                    f"be {FP8_KV_DTYPE}; got query {q_dtype}, caches {[c.dtype for c in caches]}")


__all__ = ["FP8_E4M3_MAX", "FP8_KV_DTYPE", "KV_CACHE_DTYPES", "check_cache_dtype", "dequantize_cache", "is_fp8",
           "quantize_to_cache", "raw", "resolve_kv_cache_dtype"]
