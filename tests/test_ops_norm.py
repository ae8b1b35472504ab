"""rms_norm / fused_add_rms_norm: Triton kernel (interpreter) and torch paths vs float64 math.

Triton builds its own library functions (``tl.sum``, ...) when first imported, so the
interpreter needs ``TRITON_INTERPRET=1`` at that moment: tests/conftest.py sets it around that
import and restores the variable; each interpreter test then sets it for its own duration. If
triton was already imported without it, the interpreter tests run in a subprocess instead
(``test_interpreter_in_subprocess``).
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from mtpspec.ops import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from mtpspec.ops import triton_utils
from mtpspec.ops.triton_utils import interpreter_available, use_triton

# mtpspec.ops re-exports the function rms_norm, which shadows the submodule attribute.
rms_mod = importlib.import_module("mtpspec.ops.rms_norm")

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN_SIZES = [7, 2880, 3584, 6144, 7168, 16384]
# B * (1 + k): batches of B sequences verifying k draft tokens each.
SPEC_COUNTS = [2 * (1 + 1), 3 * (1 + 2), 8 * (1 + 3)]
# Relative bound vs float64 (one rounding to the output dtype plus fp32 noise) and absolute floor.
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -8}
ATOL = {torch.float32: 1e-6, torch.float16: 1e-7, torch.bfloat16: 1e-6}


def token_counts(hidden: int):
    """{0, 1, 3, 17} and B * (1 + k) counts; large rows get fewer tokens (interpreter time)."""
    if hidden <= 64:
        return [0, 1, 3, 17, 64 + 5] + SPEC_COUNTS
    if hidden <= 4096:
        return [0, 1, 3, 17, SPEC_COUNTS[0], SPEC_COUNTS[1]]
    return [0, 1, 3, SPEC_COUNTS[0]]


class _NoKernel:
    """Stands in for a kernel that must not be launched."""

    def __getitem__(self, grid):
        raise AssertionError("Triton kernel launched on the reference path")


def norm64(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Float64 RMSNorm of an already-rounded input."""
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def expected(x, residual, weight, eps):
    """(float64 norm of s, s) with s = x + residual rounded once to x.dtype (exact: the float64
    sum of two fp16/bf16/fp32 values rounds to the same value as the fp32 sum)."""
    s = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    return norm64(s, weight, eps), s


def assert_normed(out: torch.Tensor, y64: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` is within one output rounding of ``y64``; for fp16/bf16, nearly every element is
    the correctly rounded value (norming the unrounded sum, or bf16 statistics, would miss)."""
    assert out.dtype == dtype and out.shape == y64.shape
    assert not out.isnan().any()
    err = (out.double() - y64).abs()
    bound = ATOL[dtype] + RTOL[dtype] * y64.abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    if dtype != torch.float32 and out.numel():
        exact = (out == y64.to(dtype)).double().mean().item()
        assert exact >= 0.99, f"only {exact:.4f} of elements correctly rounded"


def make(n, hidden, dtype, seed, residual_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    r = torch.randn(n, hidden, generator=g, dtype=torch.float64) * residual_scale
    w = torch.rand(hidden, generator=g, dtype=torch.float64) * 2 - 0.5
    return x.to(dtype), r.to(dtype), w.to(dtype)


def check_fused(x, r, w, dtype, eps=EPS):
    x0, r0 = x.clone(), None if r is None else r.clone()
    out, r_out = fused_add_rms_norm(x, r, w, eps)
    y64, s = expected(x, r, w, eps)
    assert_normed(out, y64, dtype)
    if r is None:
        assert r_out is x
    else:
        assert r_out.dtype == dtype and torch.equal(r_out, s)
        assert torch.equal(r, r0)
    assert torch.equal(x, x0)
    return out, r_out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_kernel_matches_float64(interp, hidden, dtype):
    for n in token_counts(hidden):
        x, r, w = make(n, hidden, dtype, seed=hidden * 31 + n)
        for res in (r, None):
            out, _ = check_fused(x, res, w, dtype)
            if res is None:
                assert torch.equal(rms_norm(x, w, EPS), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_large_residual_and_fp32_weight(interp, dtype):
    # A residual 1e3 times x: the sum must be formed in fp32 and rounded once (no bf16 add).
    x, r, _ = make(9, 2880, dtype, seed=5, residual_scale=1e3)
    w = torch.rand(2880, dtype=torch.float32) + 0.5
    check_fused(x, r, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_zero_rows_are_zero(interp, dtype):
    x, r, w = make(5, 2880, dtype, seed=6)
    x[1] = 0
    r[3] = -x[3]  # s row 3 is exactly zero
    out, r_out = fused_add_rms_norm(x, r, w, EPS)
    assert (r_out[3] == 0).all() and (out[3] == 0).all()
    assert (rms_norm(x, w, EPS)[1] == 0).all()
    assert not out.isnan().any()


@pytest.mark.parametrize("hidden", [100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_looping_path(interp, monkeypatch, hidden, dtype):
    # Rows longer than MAX_FUSED_HIDDEN loop over column blocks (the last one partial).
    monkeypatch.setattr(triton_utils, "MAX_FUSED_HIDDEN", 64)
    monkeypatch.setattr(triton_utils, "LOOP_BLOCK_N", 64)
    assert not triton_utils.row_launch(3, hidden, 2).one_pass
    for n in (0, 1, 3, SPEC_COUNTS[0]):
        x, r, w = make(n, hidden, dtype, seed=hidden + n)
        check_fused(x, r, w, dtype)
        check_fused(x, None, w, dtype)


def test_kernel_hidden_above_fused_limit(interp):
    hidden = triton_utils.MAX_FUSED_HIDDEN + 1000
    x, r, w = make(2, hidden, torch.float16, seed=7)
    check_fused(x, r, w, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_views_and_leading_dims(interp, dtype):
    hidden = 2880
    x, r, w = make(7, hidden, dtype, seed=8)
    # Offset view (x[1:]), unaligned offset (one element in), strided rows (column slice).
    flat = torch.randn(7 * hidden + 1).to(dtype)
    wide = torch.randn(6, hidden + 5).to(dtype)
    check_fused(x[1:], r[1:], w, dtype)
    check_fused(flat[1:].view(7, hidden), r, w, dtype)
    check_fused(wide[:, 3:3 + hidden], r[:6], w, dtype)
    check_fused(x[:6], wide[:, :hidden], w, dtype)
    check_fused(wide[:, 2:2 + hidden], None, w, dtype)
    # Leading dims flatten; the result keeps x's shape.
    x3, r3 = x[:6].reshape(2, 3, hidden), r[:6].reshape(2, 3, hidden)
    out, r_out = fused_add_rms_norm(x3, r3, w, EPS)
    ref_out, ref_r = fused_add_rms_norm(x[:6], r[:6], w, EPS)
    assert out.shape == x3.shape and torch.equal(out.reshape(6, hidden), ref_out)
    assert torch.equal(r_out.reshape(6, hidden), ref_r)
    assert torch.equal(rms_norm(x3, w, EPS).reshape(6, hidden), rms_norm(x[:6], w, EPS))
    # A 1-D input is one token.
    assert torch.equal(rms_norm(x[0], w, EPS), rms_norm(x[:1], w, EPS)[0])


@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_bad_inputs_raise(request, path):
    request.getfixturevalue(path)
    x, r, w = make(3, 16, torch.float16, seed=9)
    cases = [
        (ValueError, r"weight must have shape \[hidden_size\] = \[16\]", (x, r, w[:15], EPS)),
        (ValueError, r"weight must have shape", (x, r, w.view(4, 4), EPS)),
        (ValueError, r"residual must have x's shape", (x, r[:2], w, EPS)),
        (TypeError, r"residual dtype torch.float32 differs from x dtype torch.float16",
         (x, r.float(), w, EPS)),
        (TypeError, r"x must be float16, bfloat16 or float32, got torch.int32",
         (x.int(), None, w, EPS)),
        (TypeError, r"weight must be float16", (x, r, w.long(), EPS)),
        (ValueError, r"eps must be a finite number >= 0", (x, r, w, -1e-6)),
        (ValueError, r"eps must be a finite number", (x, r, w, float("nan"))),
        (ValueError, r"eps must be a finite number", (x, r, w, float("inf"))),
        (ValueError, r"weight is on meta but x is on cpu", (x, r, w.to("meta"), EPS)),
        (ValueError, r"x must have unit stride in its last dimension.*strides \(32, 2\)",
         (torch.randn(3, 32).half()[:, ::2], None, w, EPS)),
        (ValueError, r"residual must have unit stride.*strides \(1, 3\)",
         (x, r.t().contiguous().t(), w, EPS)),
        (ValueError, r"cannot be viewed as \[num_tokens, hidden_size\]",
         (torch.randn(2, 3, 16).half()[:, :2], None, w, EPS)),
        (ValueError, r"hidden_size 0", (x[:, :0], None, w[:0], EPS)),
        (ValueError, r"0-d tensor", (x[0, 0], None, w, EPS)),
        (TypeError, r"residual must be a torch.Tensor or None", (x, 1.0, w, EPS)),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            fused_add_rms_norm(*args)
            pytest.fail(f"no {exc.__name__} matching {match!r}")
    with pytest.raises(ValueError, match=r"weight must have shape"):
        rms_norm(x, w[:3], EPS)


def test_reference_path_without_interpreter(no_interp, monkeypatch):
    monkeypatch.setattr(rms_mod, "_kernel", _NoKernel())
    x, r, w = make(5, 48, torch.bfloat16, seed=10)
    assert not use_triton(x)
    out, r_out = fused_add_rms_norm(x, r, w, EPS)
    ref_out, ref_r = fused_add_rms_norm_ref(x, r, w, EPS)
    assert torch.equal(out, ref_out) and torch.equal(r_out, ref_r)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    y64, s = expected(x, r, w, EPS)
    assert_normed(out, y64, torch.bfloat16)
    assert torch.equal(r_out, s)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_add_rms_norm(x, r, w[:4], EPS)  # validated on this path too


def test_interpreter_path_launches_kernel(interp, monkeypatch):
    x, r, w = make(2, 48, torch.float32, seed=11)
    assert use_triton(x, r, w)
    monkeypatch.setattr(rms_mod, "_kernel", _NoKernel())
    with pytest.raises(AssertionError, match="kernel launched"):
        fused_add_rms_norm(x, r, w, EPS)


def test_use_triton_rule(monkeypatch):
    x = torch.randn(2, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(x) == triton_utils.HAS_TRITON
    assert not use_triton(torch.empty(2, 4, device="meta"))
    wg = torch.ones(4, requires_grad=True)
    assert not use_triton(x, None, wg)
    with torch.no_grad():
        assert use_triton(x, None, wg) == triton_utils.HAS_TRITON


def test_autograd_uses_differentiable_reference(interp, monkeypatch):
    monkeypatch.setattr(rms_mod, "_kernel", _NoKernel())
    x64, r64, w64 = make(4, 24, torch.float64, seed=12)
    x, r, w = (t.float().requires_grad_() for t in (x64, r64, w64))
    out, r_out = fused_add_rms_norm(x, r, w, EPS)
    (out * torch.arange(24.0)).sum().backward()
    xd, rd, wd = (t.clone().requires_grad_() for t in (x64, r64, w64))
    (norm64(xd + rd, wd, EPS) * torch.arange(24.0, dtype=torch.float64)).sum().backward()
    for got, want in ((x.grad, xd.grad), (r.grad, rd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert rms_norm(x, w, EPS).grad_fn is not None
    # Without grad recording the same call takes the kernel path.
    with torch.no_grad(), pytest.raises(AssertionError, match="kernel launched"):
        fused_add_rms_norm(x, r, w, EPS)


def test_interpreter_in_subprocess():
    if interpreter_available() or not triton_utils.HAS_TRITON:
        pytest.skip("the interpreter tests ran in this process (or triton is absent)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_compiles_for_sm90_vectorised_without_spills():
    """The compiled (GPU) kernel, built offline for sm_90 with the launch shapes the dispatcher
    picks (short rows packed, whole rows, looping rows): every global load and store is a
    16-byte vector, and nothing spills."""
    if not triton_utils.HAS_TRITON:
        pytest.skip("triton is not installed")
    ptrs = ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"]
    ints = ["n_rows", "n_cols", "stride_x", "stride_res", "stride_out"]
    sig = {**{p: "*bf16" for p in ptrs}, **{i: "i32" for i in ints}, "eps": "fp32"}
    specs = []
    for hidden, has_residual in ((64, True), (7168, True), (7168, False), (20000, True)):
        cfg = triton_utils.row_launch(8192, hidden, 2)
        specs.append({"module": "mtpspec.ops.rms_norm", "signature": sig,
                      "constexprs": dict(HAS_RESIDUAL=has_residual, ONE_PASS=cfg.one_pass,
                                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                         BF16_BY_BITS=False),
                      "aligned": ptrs + ints[1:], "num_warps": cfg.num_warps})
    for spec, rep in zip(specs, triton_utils.compile_reports(specs)):
        # Packed short rows (BLOCK_M > 1) may load the small weight vector narrower.
        narrow = 1 if spec["constexprs"]["BLOCK_M"] > 1 else 0
        assert rep["ptx_vec4_loads"] > 0, (spec, rep)
        assert rep["ptx_loads"] - rep["ptx_vec4_loads"] <= narrow, (spec, rep)
        assert rep["ptx_stores"] > 0 and rep["ptx_vec4_stores"] == rep["ptx_stores"], (spec, rep)
        assert rep["spill_bytes"] in (0, None), (spec, rep)
