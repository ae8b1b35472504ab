"""fused_eh_norm (MTP input): Triton kernel (interpreter) and torch paths vs float64 math.

The MTP convention (DeepSeek-V3 report section 2.2; vLLM's MTP layers): the embedding at
position 0 is zeroed (no previous token), then ``[enorm(embeds), hnorm(hidden)]``. tests/conftest.py imports triton with the interpreter enabled (see its docstring).
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from mtpspec.ops import fused_eh_norm, fused_eh_norm_ref
from mtpspec.ops import triton_utils
from mtpspec.ops.triton_utils import interpreter_available, use_triton

eh_mod = importlib.import_module("mtpspec.ops.eh_norm")

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -8}
ATOL = {torch.float32: 1e-6, torch.float16: 1e-7, torch.bfloat16: 1e-6}


class _NoKernel:
    def __getitem__(self, grid):
        raise AssertionError("Triton kernel launched on the reference path")


def norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def expected(positions, embeds, hidden, we, wh, eps):
    """Float64: zero the position-0 embeddings (by selection: NaN there must not leak)."""
    e = torch.where((positions == 0).unsqueeze(-1), torch.zeros((), dtype=torch.float64),
                    embeds.double())
    return torch.cat([norm64(e, we, eps), norm64(hidden, wh, eps)], dim=-1)


def make(n, hidden, dtype, seed, pos_dtype=torch.int64):
    """Positions of several sequences (0, 1, 2, 0, 1, ...-like, with random restarts); the
    embeddings at position 0 are NaN, so reading them would show. Distinct enorm/hnorm weights."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4, (n,), generator=g).to(pos_dtype)
    if n:
        pos[0] = 0
    e = torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype)
    h = (torch.randn(n, hidden, generator=g, dtype=torch.float64) * 5).to(dtype)
    e[pos == 0] = float("nan")
    we = (torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    wh = (torch.rand(hidden, generator=g, dtype=torch.float64) * 3 - 1).to(dtype)
    return pos, e, h, we, wh


def check(pos, e, h, we, wh, dtype, eps=EPS):
    inputs = [t.clone() for t in (pos, e, h, we, wh)]
    out = fused_eh_norm(pos, e, h, we, wh, eps)
    n, hidden = e.shape
    assert out.shape == (n, 2 * hidden) and out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any()
    y64 = expected(pos, e, h, we, wh, eps)
    err = (out.double() - y64).abs()
    bound = ATOL[dtype] + RTOL[dtype] * y64.abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    if dtype != torch.float32 and out.numel():
        exact = (out == y64.to(dtype)).double().mean().item()
        assert exact >= 0.99, f"only {exact:.4f} of elements correctly rounded"
    # Position-0 rows: embedding half exactly zero; no other row's halves are zero.
    zero = pos == 0
    assert (out[zero, :hidden] == 0).all()
    assert (out[~zero, :hidden] != 0).any(dim=-1).all()
    assert (out[:, hidden:] != 0).any(dim=-1).all()
    for before, after in zip(inputs, (pos, e, h, we, wh)):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [7, 2880, 6144, 7168])
def test_kernel_matches_float64(interp, hidden, dtype):
    counts = [0, 1, 3, 17, 4 * (1 + 3)] if hidden <= 2880 else [0, 1, 3, 2 * (1 + 1)]
    for n in counts:
        check(*make(n, hidden, dtype, seed=hidden + n), dtype)


def test_kernel_int32_positions_and_views(interp):
    hidden, dtype = 96, torch.bfloat16
    pos, e, h, we, wh = make(9, hidden, dtype, seed=3, pos_dtype=torch.int32)
    check(pos, e, h, we, wh, dtype)
    wide = torch.randn(9, hidden + 7).to(dtype)
    pos_strided = torch.stack([pos.long(), pos.long() + 5], 1)[:, 0]  # stride 2
    check(pos_strided, e, wide[:, 3:3 + hidden], we, wh, dtype)
    check(pos[1:], e[1:], h[1:], we, wh, dtype)


def test_kernel_each_half_uses_its_own_weight(interp):
    hidden = 64
    pos = torch.tensor([0, 5, 1, 0, 2])
    e = torch.randn(5, hidden)
    h = torch.randn(5, hidden)
    out = fused_eh_norm(pos, e, h, torch.full((hidden,), 2.0), torch.full((hidden,), 3.0), EPS)
    rms_e = out[:, :hidden].double().pow(2).mean(-1).sqrt()
    rms_h = out[:, hidden:].double().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms_e, torch.tensor([0, 2, 2, 0, 2.0], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_h, torch.full((5,), 3.0, dtype=torch.float64), rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_looping_path(interp, monkeypatch, dtype):
    monkeypatch.setattr(triton_utils, "MAX_FUSED_HIDDEN", 64)
    monkeypatch.setattr(triton_utils, "LOOP_BLOCK_N", 64)
    for n in (0, 1, 5):
        check(*make(n, 300, dtype, seed=n), dtype)


def test_kernel_hidden_above_fused_limit(interp):
    check(*make(2, triton_utils.MAX_FUSED_HIDDEN + 500, torch.float16, seed=4), torch.float16)


@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_bad_inputs_raise(request, path):
    request.getfixturevalue(path)
    pos, e, h, we, wh = make(3, 16, torch.float16, seed=5)
    cases = [
        (ValueError, r"previous_hidden_states must have inputs_embeds' shape",
         (pos, e, h[:2], we, wh, EPS)),
        (TypeError, r"previous_hidden_states dtype torch.float32 differs",
         (pos, e, h.float(), we, wh, EPS)),
        (ValueError, r"positions must have shape \[num_tokens\] = \[3\]",
         (pos[:2], e, h, we, wh, EPS)),
        (TypeError, r"positions must be int32 or int64", (pos.float(), e, h, we, wh, EPS)),
        (ValueError, r"enorm_weight must have shape \[hidden_size\] = \[16\]",
         (pos, e, h, we[:8], wh, EPS)),
        (ValueError, r"hnorm_weight must have shape", (pos, e, h, we, wh[None], EPS)),
        (ValueError, r"eps must be a finite number > 0", (pos, e, h, we, wh, 0.0)),
        (ValueError, r"inputs_embeds must be \[num_tokens, hidden_size\]",
         (pos, e[None], h[None], we, wh, EPS)),
        (TypeError, r"inputs_embeds must be float16", (pos, e.int(), h.int(), we, wh, EPS)),
        (ValueError, r"previous_hidden_states must have unit stride",
         (pos, e, h.t().contiguous().t(), we, wh, EPS)),
        (ValueError, r"positions is on meta", (pos.to("meta"), e, h, we, wh, EPS)),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            fused_eh_norm(*args)
            pytest.fail(f"no {exc.__name__} matching {match!r}")


def test_reference_path_without_interpreter(no_interp, monkeypatch):
    monkeypatch.setattr(eh_mod, "_kernel", _NoKernel())
    pos, e, h, we, wh = make(6, 40, torch.bfloat16, seed=6)
    assert not use_triton(e)
    out = check(pos, e, h, we, wh, torch.bfloat16)
    assert torch.equal(out, fused_eh_norm_ref(pos, e, h, we, wh, EPS))


def test_interpreter_path_launches_kernel(interp, monkeypatch):
    monkeypatch.setattr(eh_mod, "_kernel", _NoKernel())
    with pytest.raises(AssertionError, match="kernel launched"):
        fused_eh_norm(*make(2, 16, torch.float32, seed=7), EPS)


def test_autograd_uses_differentiable_reference(interp, monkeypatch):
    monkeypatch.setattr(eh_mod, "_kernel", _NoKernel())
    pos, e64, h64, we64, wh64 = make(5, 24, torch.float64, seed=8)
    e64 = torch.where((pos == 0).unsqueeze(-1), 7.0, e64)  # finite, still masked
    leaves = [t.float().requires_grad_() for t in (e64, h64, we64, wh64)]
    probe = torch.randn(5, 48, dtype=torch.float64)
    (fused_eh_norm(pos, *leaves, EPS) * probe.float()).sum().backward()
    ref = [t.clone().requires_grad_() for t in (e64, h64, we64, wh64)]
    (expected(pos, *ref, EPS) * probe).sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)
    assert (leaves[0].grad[pos == 0] == 0).all()
    with torch.no_grad(), pytest.raises(AssertionError, match="kernel launched"):
        fused_eh_norm(pos, *leaves, EPS)


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
    """The compiled (GPU) kernel, built offline for sm_90 with the dispatcher's launch shapes:
    every activation load and every store is a 16-byte vector, and nothing spills."""
    if not triton_utils.HAS_TRITON:
        pytest.skip("triton is not installed")
    ptrs = ["pos_ptr", "e_ptr", "h_ptr", "we_ptr", "wh_ptr", "out_ptr"]
    ints = ["n_rows", "n_cols", "stride_pos", "stride_e", "stride_h", "stride_out"]
    sig = {**{p: "*bf16" for p in ptrs}, **{i: "i32" for i in ints}, "eps": "fp32",
           "pos_ptr": "*i64"}
    specs = []
    for hidden in (7168, 20000):
        cfg = triton_utils.row_launch(8192, hidden, 2)
        specs.append({"module": "mtpspec.ops.eh_norm", "signature": sig,
                      "constexprs": dict(ONE_PASS=cfg.one_pass, BLOCK_M=cfg.block_m,
                                         BLOCK_N=cfg.block_n, BF16_BY_BITS=False),
                      "aligned": ptrs + ["n_cols", "stride_e", "stride_h", "stride_out"],
                      "num_warps": cfg.num_warps})
    for spec, rep in zip(specs, triton_utils.compile_reports(specs)):
        # One scalar load per row: the position.
        assert rep["ptx_vec4_loads"] == rep["ptx_loads"] - 1 and rep["ptx_vec4_loads"] > 0, rep
        assert rep["ptx_stores"] > 0 and rep["ptx_vec4_stores"] == rep["ptx_stores"], rep
        assert rep["spill_bytes"] in (0, None), (spec, rep)
