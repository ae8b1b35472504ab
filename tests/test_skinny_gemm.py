"""The few-row 16-bit GEMM (``mtpspec.ops.skinny_gemm``, on up to 16 rows by default): equal to a float64 product of the
same 16-bit values to the output dtype's rounding, with and without bias, one and several K splits
(fixed-order sum), ragged N and K, 1..16 rows; the dispatch (``linear``) takes it only where it is
switched on and falls back to ``F.linear`` elsewhere; it compiles ahead of time for sm_90 with its
weight loads pipelined."""

import pytest
import torch
import torch.nn.functional as F

from mtpspec.ops import skinny_gemm


@pytest.mark.parametrize("m,n,k,splits", [(1, 64, 256, None), (5, 100, 200, 1), (16, 130, 1000, 3),
                                          (3, 70, 520, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_vs_float64(kdev, m, n, k, splits, dtype, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    out = skinny_gemm.skinny_linear(x.to(kdev), w.to(kdev), None if b is None else b.to(kdev), splits=splits).cpu()
    assert out.dtype == dtype and out.shape == (m, n)
    # fp32 accumulation, one rounding to the 16-bit output: within one output ulp of the exact sum
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=2 ** -7 if dtype == torch.bfloat16
                               else 2 ** -10, atol=1e-3)


def test_skinny_launch_splits_fill_the_machine():
    # o_proj of GLM-4.5-Air (N 4096, K 12288) on 132 SMs: 64 tiles -> 4 splits of 24 steps
    assert skinny_gemm.skinny_launch(4096, 12288, 132) == (4, 3072)
    # qkv (N 14336): 224 tiles already fill 2 per SM -> no split
    assert skinny_gemm.skinny_launch(14336, 4096, 132) == (1, 4096)
    # short K: never below 4 steps per split
    assert skinny_gemm.skinny_launch(64, 512, 132) == (1, 512)


def test_linear_dispatch(kdev, monkeypatch):
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x = torch.randn(2, 3, 64).to(torch.bfloat16).to(kdev)
    w = torch.randn(32, 64).to(torch.bfloat16).to(kdev)
    monkeypatch.setattr(skinny_gemm, "SKINNY_MAX_M", 0)  # off: F.linear
    torch.testing.assert_close(skinny_gemm.linear(x, w), F.linear(x.float(), w.float()).to(torch.bfloat16),
                               rtol=2 ** -7, atol=1e-2)
    assert calls == []
    monkeypatch.setattr(skinny_gemm, "SKINNY_MAX_M", 16)  # on: 6 rows flattened, shape restored
    y = skinny_gemm.linear(x, w)
    assert calls == [(6, 64)] and y.shape == (2, 3, 32)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2 ** -7, atol=1e-2)
    skinny_gemm.linear(torch.randn(17, 64).to(torch.bfloat16).to(kdev), w)  # 17 rows: F.linear
    skinny_gemm.linear(torch.randn(2, 64).to(kdev), w.float())  # fp32: F.linear
    assert len(calls) == 1
    with pytest.raises(ValueError, match="M <= 16"):
        skinny_gemm.skinny_linear(torch.randn(17, 64).to(torch.bfloat16).to(kdev), w)


def test_linear_bias_and_out(kdev, monkeypatch):
    """A bias the kernel cannot read as a contiguous row of x's dtype (strided, fp32) goes to
    F.linear; ``out`` is written in place by the kernel (contiguous, x's dtype) or by torch.mm /
    addmm otherwise, with the values of the call without it."""
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(skinny_gemm, "SKINNY_MAX_M", 16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(kdev)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16).to(kdev)
    b64 = torch.randn(64, generator=g).to(torch.bfloat16).to(kdev)
    want = F.linear(x.float(), w.float(), b64[::2].float())
    for bias in (b64[::2], b64[::2].float()):  # strided; fp32 (F.linear itself refuses a mixed dtype)
        try:
            got = skinny_gemm.linear(x, w, bias)
        except RuntimeError:
            assert bias.dtype == torch.float32
            continue
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2e-2)
    assert calls == []
    for bias in (None, b64[:32].contiguous()):
        ref = skinny_gemm.linear(x, w, bias)
        n = len(calls)
        out = torch.empty(3, 32, dtype=torch.bfloat16, device=kdev)
        assert skinny_gemm.linear(x, w, bias, out=out) is out and len(calls) == n + 1
        assert torch.equal(out, ref)
        wide = torch.empty(3, 40, dtype=torch.bfloat16, device=kdev)[:, :32]  # not contiguous: torch.mm
        skinny_gemm.linear(x, w, bias, out=wide)
        assert len(calls) == n + 1
        torch.testing.assert_close(wide.float(), ref.float(), rtol=2 ** -7, atol=2e-2)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.skinny_linear(x, w, out=torch.empty(3, 31, dtype=torch.bfloat16, device=kdev))


def test_skinny_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    from mtpspec.ops import triton_utils
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
           **{a: "i32" for a in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")}}
    spec = {"module": "mtpspec.ops.skinny_gemm", "kernel": "_skinny", "signature": sig,
            "constexprs": dict(HAS_BIAS=True, BLOCK_N=64, BLOCK_T=16, BLOCK_K=128, SPLIT=True, DOT_FP32=False,
                               BF16_BY_BITS=False),
            "aligned": [a for a in sig if a != "M"], "num_warps": 4, "num_stages": 4}
    (rep,) = triton_utils.compile_reports([spec])
    assert rep["shared_bytes"] >= 3 * (64 * 128 + 128 * 16) * 2, rep  # several K steps in flight


def test_pdl_kernels_wait_then_release_their_dependents(monkeypatch):
    """Programmatic dependent launch (sm_90+ unless MTPSPEC_PDL=0): a LazyKernel(fn, pdl=True) kernel
    compiled with PDL begins with griddepcontrol.wait (its inputs are the previous kernel's
    outputs) and launch_dependents, and has neither without; launches pass PDL and Triton's
    launch_pdl only for compiled kernels with PDL enabled (the interpreter never sees them)."""
    pytest.importorskip("triton")
    from mtpspec.ops import skinny_gemm, triton_utils
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
           **{a: "i32" for a in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")}}
    spec = {"module": "mtpspec.ops.skinny_gemm", "kernel": "_skinny", "signature": sig,
            "constexprs": dict(HAS_BIAS=False, BLOCK_N=64, BLOCK_T=16, BLOCK_K=128, SPLIT=False, DOT_FP32=False,
                               BF16_BY_BITS=False),
            "aligned": [a for a in sig if a != "M"], "num_warps": 4}
    on = {**spec, "constexprs": {**spec["constexprs"], "PDL": True}}
    off, pdl = triton_utils.compile_reports([spec, on])
    assert off["ptx_griddepcontrol"] == 0 and pdl["ptx_griddepcontrol"] == 2, (off, pdl)
    kernel = skinny_gemm._skinny
    assert kernel.pdl
    monkeypatch.setattr(triton_utils, "_PDL", [])  # decided once per process: decide again here
    monkeypatch.setenv("MTPSPEC_PDL", "0")
    assert triton_utils.pdl_enabled() is False
    monkeypatch.setattr(triton_utils, "_PDL", [])
    monkeypatch.delenv("MTPSPEC_PDL")
    assert triton_utils.pdl_enabled() is (torch.cuda.is_available() and torch.version.hip is None
                                           and torch.cuda.get_device_capability() >= (9, 0))
    monkeypatch.setattr(triton_utils, "pdl_enabled", lambda: True)
    if triton_utils.interpreter_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert kernel[(1,)].keywords == {"PDL": False}  # interpreted: never
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel[(1,)].keywords == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(triton_utils, "pdl_enabled", lambda: False)
    assert kernel[(1,)].keywords == {"PDL": False}
