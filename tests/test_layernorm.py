"""RMSNorm layer against a float64 reference and Hugging Face's own LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from mtpspec.layers import RMSNorm

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 3, 17, 96])
def test_rms_norm_matches_float64(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    h = 40
    norm = RMSNorm(h, eps=1e-5, params_dtype=dtype)
    w = torch.randn(h, generator=g)
    norm.weight.weight_loader(norm.weight, w)
    x = (torch.randn(n, h, generator=g) * 3).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.double(), _ref(x, norm.weight, 1e-5), atol=atol, rtol=rtol)
    assert norm.variance_epsilon == norm.eps == 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_convention_and_fp32_accumulation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    h = 64
    norm = RMSNorm(h, params_dtype=dtype)
    norm.weight.weight_loader(norm.weight, torch.rand(h, generator=g) + 0.5)
    # Large residual + small update: a bf16 accumulation of several steps would lose the update.
    residual = (torch.randn(2, 5, h, generator=g) * 1000).to(dtype)
    x = torch.randn(2, 5, h, generator=g).to(dtype)
    out, s = norm(x, residual)
    expected_s = (x.float() + residual.float()).to(dtype)
    assert torch.equal(s, expected_s)  # formed in fp32, rounded once
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), _ref(expected_s, norm.weight, norm.eps), atol=atol, rtol=rtol)
    assert out.shape == x.shape and s.shape == x.shape


def test_matches_hugging_face_llama_rms_norm() -> None:
    h = 48
    ours = RMSNorm(h, eps=1e-6)
    hf = LlamaRMSNorm(h, eps=1e-6)
    w = torch.randn(h)
    ours.weight.weight_loader(ours.weight, w)
    with torch.no_grad():
        hf.weight.copy_(w)
    x = torch.randn(9, h)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-5)


def test_zero_rows_give_zeros_not_nan() -> None:
    norm = RMSNorm(32)
    out = norm(torch.zeros(4, 32))
    assert torch.equal(out, torch.zeros(4, 32))
    out, s = norm(torch.zeros(4, 32), torch.zeros(4, 32))
    assert torch.equal(out, torch.zeros(4, 32)) and torch.equal(s, torch.zeros(4, 32))


def test_bad_inputs_raise() -> None:
    norm = RMSNorm(16)
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        norm(torch.zeros(3, 15))
    with pytest.raises(ValueError, match="residual shape"):
        norm(torch.zeros(3, 16), torch.zeros(2, 16))
    with pytest.raises(TypeError, match="residual dtype"):
        norm(torch.zeros(3, 16), torch.zeros(3, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="floating point"):
        norm(torch.zeros(3, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[16\].*\[17\]"):
        norm.weight.weight_loader(norm.weight, torch.ones(17))
    with pytest.raises(ValueError, match="hidden_size"):
        RMSNorm(0)
