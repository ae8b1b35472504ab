"""fused_allreduce_rms_norm: every tp size, both backends, residual or none, exact byte counts."""

import pytest
import torch

from mtpspec.distributed import (comm_stats, get_tensor_model_parallel_rank, launch,
                                 reset_comm_stats)
from mtpspec.distributed.allreduce_rms_norm import (
    ReduceScatterNormAllGather, backend_usage, fused_allreduce_rms_norm,
    register_allreduce_rms_norm_backend, select_backend, unregister_allreduce_rms_norm_backend)

HIDDEN = 48
EPS = 1e-5
# 0, 1, tp-1, tp+1 for every tp in 1..4, 17, and B * (1 + k) for B <= 16, k <= 5.
TOKEN_COUNTS = sorted({0, 1, 2, 3, 4, 5, 17} | {b * (1 + k) for b in (1, 3, 7, 16) for k in (1, 3, 5)})


class _Norm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps


def _inputs(seed: int, tp: int, n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(tp, n, HIDDEN, generator=g, dtype=torch.float64) * 3
    residual = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) * 10
    weight = torch.rand(HIDDEN, generator=g, dtype=torch.float64) + 0.5
    return parts.to(dtype), residual.to(dtype), weight.to(dtype)


def _reference(parts, residual, weight):
    s = parts.double().sum(0)
    if residual is not None:
        s = s + residual.double()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return y, s


def _run_rank(tp: int, seed: int, backend_max_bytes):
    rank = get_tensor_model_parallel_rank()
    extra = None
    if backend_max_bytes is not None:
        extra = ReduceScatterNormAllGather(max_bytes=backend_max_bytes)
        register_allreduce_rms_norm_backend(extra)
    out = []
    try:
        for n in TOKEN_COUNTS:
            for use_res in (True, False):
                parts, residual, weight = _inputs(seed + n, tp, n, torch.float32)
                res = residual if use_res else None
                reset_comm_stats()
                normed, new_res = fused_allreduce_rms_norm(parts[rank].clone(), res, _Norm(weight, EPS))
                out.append((n, use_res, normed, new_res, comm_stats(), select_backend(parts[rank]).name))
    finally:
        if extra is not None:
            unregister_allreduce_rms_norm_backend(extra)
    return out, backend_usage()


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("backend_max_bytes", [None, 9 * HIDDEN * 4])
def test_fused_allreduce_rms_norm_matches_float64(tp, backend_max_bytes):
    if tp == 1 and backend_max_bytes is not None:
        pytest.skip("tp 1 issues no collective: backends are never consulted")
    seed = int(torch.randint(0, 2**30, ()).item())
    results = launch(_run_rank, tp, tp, seed, backend_max_bytes)
    for rank, (rows, usage) in enumerate(results):
        for n, use_res, normed, new_res, stats, name in rows:
            parts, residual, weight = _inputs(seed + n, tp, n, torch.float32)
            ref_y, ref_s = _reference(parts, residual if use_res else None, weight)
            assert normed.shape == (n, HIDDEN) and new_res.shape == (n, HIDDEN)
            torch.testing.assert_close(new_res.double(), ref_s, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(normed.double(), ref_y, rtol=1e-5, atol=1e-5)
            # Every rank returns the same result (the draft path relies on it).
            other = results[0][0][[r[:2] for r in results[0][0]].index((n, use_res))]
            assert torch.equal(normed, other[2])
            nbytes = n * HIDDEN * 4
            if tp == 1:
                assert stats == {}, "tp 1 must issue no collective"
            elif backend_max_bytes is not None and nbytes <= backend_max_bytes:
                assert name == "reduce_scatter+norm+all_gather"
                assert set(stats) == {"reduce_scatter", "all_gather"}
            else:
                # Exactly one ring all-reduce of the input's bytes, nothing else.
                assert name == "allreduce+fused_add_rms_norm"
                assert stats == {"all_reduce": {"calls": 1, "bytes_sent": 2 * (tp - 1) * nbytes // tp,
                                                "bytes_received": 2 * (tp - 1) * nbytes // tp}}
        if tp == 1:
            assert set(usage) == {"local"}


def test_size_limit_boundary_dispatch():
    """The size check uses tokens * hidden * element size: exactly at capacity is accepted,
    one row more falls back (known fault 9: limits computed on the wrong dimension)."""
    cap_tokens = 7
    b = ReduceScatterNormAllGather(max_bytes=cap_tokens * HIDDEN * 2)
    register_allreduce_rms_norm_backend(b)
    try:
        for n in range(0, cap_tokens + 9):
            h = torch.zeros(n, HIDDEN, dtype=torch.bfloat16)
            assert (select_backend(h) is b) == (n <= cap_tokens)
            assert (select_backend(h.float()) is b) == (2 * n <= cap_tokens)
    finally:
        unregister_allreduce_rms_norm_backend(b)


def test_bad_shapes_raise():
    norm = _Norm(torch.ones(HIDDEN), EPS)
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        fused_allreduce_rms_norm(torch.zeros(2, 3, HIDDEN), None, norm)
    with pytest.raises(ValueError, match="residual must match"):
        fused_allreduce_rms_norm(torch.zeros(2, HIDDEN), torch.zeros(3, HIDDEN), norm)
    with pytest.raises(ValueError, match="residual must match"):
        fused_allreduce_rms_norm(torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN, dtype=torch.float64), norm)
    with pytest.raises(ValueError, match="norm weight"):
        fused_allreduce_rms_norm(torch.zeros(2, HIDDEN), None, _Norm(torch.ones(HIDDEN + 1), EPS))
