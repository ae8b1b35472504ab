"""FP8 block-scaled weights (issue 19): DeepSeek-V3's ``-FP8`` checkpoint layout end to end.

What is tested, and how tight:

* the block GEMM kernel (Triton; interpreted on CPU, ``kdev``) against a float64 torch
  reference of the same quantised math (activations quantised per token and group exactly as
  the kernel does, both sides dequantised, one float64 matmul), on shapes whose M, N and K are
  not multiples of the blocks, per-row scales included: fp32 accumulation error only (fp32
  output: 2e-6 of the output's max; bf16 / fp16: their output rounding); the expert loop
  likewise (1e-4);
* the CPU torch path (what CI runs: weights dequantised, activations not quantised): logits of
  an FP8 tiny checkpoint (128 x 128 blocks) through mtpspec equal those of the same weights
  dequantised into a plain float32 checkpoint to 1e-4 (only the expert-sum order differs: the
  FP8 experts loop over routed experts), target and MTP, for GLM-4.5, DeepSeek-V3, V3.2 and
  GLM-5; and equal ``transformers``' own model loaded from the tensors dequantised by
  ``transformers``' ``Fp8Dequantize`` (2e-4; ``from_pretrained`` of the FP8 checkpoint itself
  needs ``accelerate``, absent here; on CPU it dequantises with that same op);
* the kernel path through a whole model (DeepSeek-V3 tiny, activations quantised): equal to a
  torch emulation of the kernel's math to 1e-3, and within 15% (target) / 30% (MTP) relative
  RMS of the dequantised model's logits (activation quantisation error, measured 10% / 22%),
  >= 70% of greedy tokens the same;
* the fused expert layout, layers stored unquantised, a float expert among FP8 ones, the dummy
  load format;
* engine: greedy speculative decoding (k = 3) on the FP8 model emits plain greedy's tokens;
  tp 2 (gloo ranks) emits tp 1's tokens and every rank's logits equal tp 1's (1e-4);
  ``mtpspec generate --kv-cache-dtype fp8`` runs on an FP8 checkpoint;
* errors: a tp-2 shard that cuts weight blocks, a missing ``weight_scale_inv`` (nothing
  returned), FP8 tensors without ``quantization_config``, bad ``quantization_config`` values.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mtpspec.models.fp8_writer import (
    dequantize_state_dict, quantize_state_dict, should_quantize, write_dequantized_checkpoint, write_fp8_checkpoint)
from mtpspec.models.loader import CheckpointError, MissingKeyError, load_models, read_checkpoint_tensors
from mtpspec.ops.fp8_gemm import (
    FP8_WEIGHT_DTYPE, dequantize_weight_blocks, fp8_block_linear, fp8_block_linear_w8a8_ref, fp8_experts_loop,
    fp8_moe_experts, quantize_activations, quantize_weight_blocks, scale_grid)

F8 = FP8_WEIGHT_DTYPE
FAMILIES = ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")


# ------------------------------------------------------------------------------------------- math
def test_block_quantisation_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    w[:128, :128] = 0.0  # an all-zero block: scale 1, codes 0
    q, s = quantize_weight_blocks(w, (128, 128))
    assert q.dtype == F8 and s.dtype == torch.float32 and tuple(s.shape) == (2, 3) == scale_grid(w.shape, (128, 128))
    assert s[0, 0] == 1.0 and q[:128, :128].float().abs().max() == 0
    amax = w[128:, 256:].abs().max()
    assert s[1, 2] == amax / 448  # partial edge block: amax over the rows / columns it holds
    dq = dequantize_weight_blocks(q, s, 128, 128)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 of each value (normals)
    big = w.abs() > s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2 ** -6
    assert ((dq - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[big].all()
    e = torch.randn(3, 64, 40, generator=g)  # experts: leading dims kept
    qe, se = quantize_weight_blocks(e, (16, 32))
    assert tuple(se.shape) == (3, 4, 2)
    torch.testing.assert_close(dequantize_weight_blocks(qe, se, 16, 32)[1],
                               dequantize_weight_blocks(*quantize_weight_blocks(e[1], (16, 32)), 16, 32))


@pytest.mark.parametrize("block", [(100000, 100000), (1 << 40, 1 << 40), (100000, 16)])
def test_block_larger_than_the_weight_is_one_block_over_the_dim(block) -> None:
    """A block dim at least the weight's: scales ``ceil(dim / block) = 1`` as the format says, the
    same codes and scales as a block of exactly that dim, and no block-sized intermediate (a
    100000 x 100000 block used to pad every weight to 40 GB)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    q, s = quantize_weight_blocks(w, block)
    exact = (min(block[0], 96), min(block[1], 64))
    q1, s1 = quantize_weight_blocks(w, exact)
    assert tuple(s.shape) == scale_grid(w.shape, block) == (1, 4 if block[1] == 16 else 1)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    if block[1] != 16:
        assert s[0, 0] == w.abs().max() / 448
    torch.testing.assert_close(dequantize_weight_blocks(q, s, *block), dequantize_weight_blocks(q1, s1, *exact),
                               atol=0, rtol=0)
    e = torch.randn(3, 40, 24, generator=g)  # experts: leading dims kept
    qe, se = quantize_weight_blocks(e, block)
    assert tuple(se.shape) == scale_grid(e.shape, block)
    assert torch.equal(qe.view(torch.uint8), quantize_weight_blocks(e, (min(block[0], 40), min(block[1], 24)))[0]
                       .view(torch.uint8))
    x = torch.randn(5, 64, generator=g)  # the reference's activation groups likewise
    xq, xs = quantize_activations(x, block[1])
    xq1, xs1 = quantize_activations(x, exact[1])
    assert torch.equal(xq.view(torch.uint8), xq1.view(torch.uint8)) and torch.equal(xs, xs1)


def test_activation_quantisation() -> None:
    x = torch.tensor([[1.0, -3.0, 0.5, 0.0, 0.0, 0.0], [0.0] * 6])
    xq, s = quantize_activations(x, 4)
    assert tuple(s.shape) == (2, 2)
    assert s[0, 0] == 3.0 / 448 and s[0, 1] == 1e-10 / 448 and s[1, 0] == 1e-10 / 448
    assert xq[0, 1].float() == -448 and (xq[1].float() == 0).all()


KERNEL_CASES = [  # (M, N, K, block_n, block_k, dtype, bias)
    (1, 40, 70, 16, 32, torch.float32, False),
    (5, 130, 300, 128, 128, torch.float32, True),
    (17, 257, 129, 128, 128, torch.bfloat16, False),
    (3, 33, 64, 1, 16, torch.float16, True),  # one scale row per weight row (unaligned TP shards)
    (70, 72, 200, 32, 64, torch.float32, False),  # M over one row block
    (2, 48, 512, 32, 32, torch.float32, True),  # split-K (16 groups): fp32 partials, the bias added once
]


def _check_gemm(kdev, m, n, k, bn, bk, dtype, bias, small_m=None) -> torch.Tensor:
    """The kernel (``small_m``: the path) against the float64 reference; returns the result."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    x[0, :min(k, bk)] = 0.0  # an all-zero activation group
    q, s = quantize_weight_blocks(torch.randn(n, k, generator=g) / k ** 0.5, (bn, bk))
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = fp8_block_linear(x.to(kdev), q.to(kdev), s.to(kdev), bn, bk, None if b is None else b.to(kdev),
                           small_m=small_m).cpu()
    want = fp8_block_linear_w8a8_ref(x, q, s, bn, bk) + (0 if b is None else b.double())
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.abs().max().item()
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype] * max(scale, 1.0)
    if kdev == "cuda" and bk >= 32:  # fp8 tensor-core dots: Hopper keeps about 14 bits of the sum inside
        tol = max(tol, 2e-3 * max(scale, 1.0))  # one dot (DeepSeek-V3 report, sec. 3.3.2); fp32 across groups
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    return got


@pytest.mark.parametrize("m,n,k,bn,bk,dtype,bias", KERNEL_CASES)
def test_block_gemm_kernel_matches_float64_reference(kdev, m, n, k, bn, bk, dtype, bias) -> None:
    _check_gemm(kdev, m, n, k, bn, bk, dtype, bias)  # M <= 16: the swap path (the default)
    if m <= 16:  # and the tile path
        _check_gemm(kdev, m, n, k, bn, bk, dtype, bias, small_m="tile")


SWAP_CASES = [  # (M, N, K, block_n, block_k, dtype, bias); N, K not multiples of the tiles
    (1, 40, 70, 16, 32, torch.float32, False),  # one K split
    (3, 130, 300, 1, 128, torch.bfloat16, True),  # per-row scales, bias
    (8, 33, 520, 1, 32, torch.float16, True),  # split-K (17 groups -> 6 splits), the bias added once
    (16, 257, 129, 128, 128, torch.bfloat16, False),  # 5 column tiles, a 1-column last group
    (16, 72, 1000, 32, 64, torch.float32, True),  # split-K, 2 column tiles
    (1, 48, 512, 32, 16, torch.float32, False),  # 16-column groups (fp32 dots on the GPU), split
    (40, 70, 256, 16, 32, torch.float32, False),  # forced at 40 rows: a 64-row token tile
    (70, 72, 200, 32, 64, torch.bfloat16, True),  # forced at 70 rows: two token tiles
]


@pytest.mark.parametrize("m,n,k,bn,bk,dtype,bias", SWAP_CASES)
def test_swap_ab_kernel_matches_float64_reference(kdev, m, n, k, bn, bk, dtype, bias) -> None:
    """The swap-AB path (W tiles as stored times xq^T, split-K) against the float64 reference."""
    _check_gemm(kdev, m, n, k, bn, bk, dtype, bias, small_m="swap")


@pytest.mark.parametrize("m,k,bk", [(3, 300, 128), (8, 520, 32), (40, 256, 32)])  # one pass; split-K; 64 rows
def test_swap_ab_fused_quantisation_gives_the_same_bits(kdev, m, k, bk) -> None:
    """``small_m="swap_fused"`` (activations quantised in the swap kernel's K loop) == ``"swap"``
    (quantised in a pass of their own), bit for bit."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    q, s = quantize_weight_blocks(torch.randn(70, k, generator=g) / k ** 0.5, (1, bk))
    b = torch.randn(70, generator=g).bfloat16()
    args = [a.to(kdev) for a in (x, q, s)]
    got = fp8_block_linear(*args, 1, bk, b.to(kdev), small_m="swap_fused")
    assert torch.equal(got, fp8_block_linear(*args, 1, bk, b.to(kdev), small_m="swap"))


def test_swap_ab_is_the_default_for_few_rows(kdev, monkeypatch) -> None:
    """Dispatch: the swap kernel for M <= SWAP_AB_MAX_M (or forced), the tile kernel above (or
    forced); a bad ``small_m`` is an error."""
    import mtpspec.ops.fp8_gemm as fg
    assert fg.small_m_path(1) == fg.small_m_path(fg.SWAP_AB_MAX_M) == "swap"
    assert fg.small_m_path(fg.SWAP_AB_MAX_M + 1) == "tile" == fg.small_m_path(1, "tile")
    assert fg.small_m_path(500, "swap") == "swap" and fg.small_m_path(2, "swap_fused") == "swap_fused"
    launched = []
    monkeypatch.setattr(fg, "_swap", _SpyKernel("swap", fg._swap, launched))
    monkeypatch.setattr(fg, "_kernel", _SpyKernel("tile", fg._kernel, launched))
    q, s = quantize_weight_blocks(torch.randn(40, 64), (16, 32))
    args = [q.to(kdev), s.to(kdev), 16, 32]
    for m, small_m, want in ((3, None, "swap"), (fg.SWAP_AB_MAX_M + 1, None, "tile"), (3, "tile", "tile"),
                             (20, "swap", "swap"), (2, "swap_fused", "swap")):
        launched.clear()
        fp8_block_linear(torch.randn(m, 64, device=kdev), *args, small_m=small_m)
        assert [n for n, _ in launched] == [want], (m, small_m, launched)
    launched.clear()
    monkeypatch.setattr(fg, "SWAP_AB_MAX_M", 0)  # the knob turns it off
    fp8_block_linear(torch.randn(1, 64, device=kdev), *args)
    assert [n for n, _ in launched] == ["tile"]
    with pytest.raises(ValueError, match="small_m"):
        fp8_block_linear(torch.randn(1, 64), q, s, 16, 32, small_m="wide")


def test_swap_ab_plan() -> None:
    """Tile sizes and K splits at DeepSeek-V3's decode shapes on 132 SMs (H200)."""
    from mtpspec.ops.fp8_gemm import swap_launch_config, swap_programs_per_sm, swap_split_k
    assert swap_launch_config(1, 7168) == (128, 16, 4, 4) and swap_launch_config(16, 576) == (64, 16, 4, 4)
    assert swap_launch_config(17, 7168) == (128, 32, 4, 4) and swap_launch_config(64, 7168) == (128, 64, 8, 4)
    assert swap_launch_config(200, 7168)[1] == 64
    # one wave of at most 3 x 132 programs
    assert swap_split_k(56, 128, 132) == 7  # o_proj (7168 x 16384): 56 tiles x 7 splits of 19 groups
    assert swap_split_k(192, 12, 132) == 2  # q_b_proj (24576 x 1536): 192 tiles x 2 splits of 6 groups
    assert swap_split_k(56, 16, 132) == 7  # expert down (7168 x 2048): 7 -> 6 splits of 3 groups
    assert swap_split_k(64, 56, 132) == 6  # expert gate_up (4096 x 7168): 64 tiles x 6 splits
    assert swap_split_k(9, 56, 132) == 28  # kv_a_proj (576 x 7168): 9 tiles x 28 splits of 2 groups
    assert swap_split_k(56, 3, 132) == 1 and swap_split_k(500, 128, 132) == 1  # few groups; tiles fill a wave
    assert swap_programs_per_sm(128, 16, 128, 4) == 3 and swap_programs_per_sm(128, 64, 128, 4) == 2
    assert swap_split_k(56, 128, 132, per_sm=2) == 4


@pytest.mark.parametrize("m,k", [(5, 300), (2, 512)])  # one pass; split-K
def test_prequantised_activations_give_the_same_bits(kdev, m, k) -> None:
    """``prequant=True`` (activations quantised in a pass of their own) == the in-loop quantisation, bit for bit."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    q, s = quantize_weight_blocks(torch.randn(40, k, generator=g) / k ** 0.5, (32, 32))
    args = [a.to(kdev) for a in (x, q, s)]
    got = fp8_block_linear(*args, 32, 32, prequant=True, small_m="tile")
    # exact (assert_close with zero tolerance reports how many elements differ and by how much)
    torch.testing.assert_close(got, fp8_block_linear(*args, 32, 32, prequant=False, small_m="tile"), atol=0, rtol=0)
    want = fp8_block_linear_w8a8_ref(x, q, s, 32, 32)  # and the independent float64 reference
    torch.testing.assert_close(got.cpu().double(), want, atol=8e-3 * max(want.abs().max().item(), 1.0), rtol=0)
    # the device's activation codes and scales are torch's, bit for bit (on an H200 an approximate
    # division once put scales one ulp off, and with them some codes)
    from mtpspec.ops.fp8_gemm import _quantise_rows, quantize_activations
    xq, xs = _quantise_rows(args[0], 32)
    rq, rs = quantize_activations(x, 32)
    assert torch.equal(xs.cpu(), rs), f"{(xs.cpu() != rs).sum()} scales differ"
    codes, ref_codes = xq.cpu().view(torch.uint8), rq.view(torch.uint8)
    assert torch.equal(codes, ref_codes), f"{(codes != ref_codes).sum()} codes differ"


def test_split_k_plan() -> None:
    from mtpspec.ops.fp8_gemm import split_k
    assert split_k(1, 56, 128, 132) == 5  # o_proj at M = 1: 56 tiles -> 280 programs
    assert split_k(128, 56, 128, 132) == 1 and split_k(1, 56, 4, 132) == 1  # many rows / few groups: no split
    assert split_k(1, 1, 16, 132) == 4  # at least 4 groups per split


def test_fp8_gemm_kernels_compile_for_hopper() -> None:
    """The dense kernel (split or not), the swap-AB one (split or not, 16 / 64 token rows, its split
    sum) and the grouped ones (tile and swap-AB) compile for sm_90 with fp8 dots (the interpreter does not check
    Triton's typing or fp8 dot shape rules)."""
    from mtpspec.ops import triton_utils
    i32 = lambda names: {n: "i32" for n in names}  # noqa: E731
    def dense(preq):
        return {"x_ptr": "*fp8e4nv" if preq else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                "b_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
                **i32(["M", "N", "K", "stride_xm", "stride_xs", "stride_wn", "stride_wsn", "stride_om", "n_kb",
                       "kb_per_split", "SCALE_BN"])}
    specs = [{"module": "mtpspec.ops.fp8_gemm", "kernel": "_kernel", "signature": dense(preq),
              "constexprs": dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT=split, PREQ=preq,
                                 FP8_DOT=True, FP8_BY_BITS=False, BF16_BY_BITS=False),
              "aligned": ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "part_ptr"], "num_warps": 4}
             for split, preq in ((False, False), (True, False), (False, True))]
    specs.append({"module": "mtpspec.ops.fp8_gemm", "kernel": "_act_quant",
                  "signature": {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32",
                                **i32(["K", "stride_xm", "stride_qm", "n_kb"])},
                  "constexprs": dict(BLOCK_K=128, FP8_BY_BITS=False), "aligned": ["x_ptr", "xq_ptr"], "num_warps": 4})
    def swap(preq):
        return {"xq_ptr": "*fp8e4nv" if preq else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                "ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                **i32(["M", "N", "K", "stride_qm", "stride_xs", "stride_wn", "stride_wsn", "stride_om", "n_kb",
                       "kb_per_split", "SCALE_BN"])}
    specs += [{"module": "mtpspec.ops.fp8_gemm", "kernel": "_swap", "signature": swap(preq),
               "constexprs": dict(HAS_BIAS=bias, BLOCK_N=bn, BLOCK_T=bt, BLOCK_K=128, SPLIT=split, PREQ=preq,
                                  FP8_DOT=True, FP8_BY_BITS=False, BF16_BY_BITS=False),
               "aligned": ["xq_ptr", "w_ptr", "ws_ptr", "out_ptr", "part_ptr", "K", "stride_qm", "stride_wn"],
               "num_warps": warps}
              for bn, bt, split, bias, warps, preq in ((128, 16, True, True, 4, True), (64, 16, False, False, 4, True),
                                                       (128, 64, True, False, 8, True),
                                                       (128, 16, True, False, 4, False))]
    specs.append({"module": "mtpspec.ops.fp8_gemm", "kernel": "_split_sum",
                  "signature": {"part_ptr": "*fp32", "out_ptr": "*bf16", **i32(["MN", "splits"])},
                  "constexprs": dict(BLOCK=1024, BF16_BY_BITS=False), "aligned": ["part_ptr", "out_ptr"],
                  "num_warps": 4})
    grouped = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32",
               "block_expert_ptr": "*i32", "rw_ptr": "*fp32",
               **i32(["num_pairs", "num_experts", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_wse",
                      "stride_wsn", "stride_om", "n_kb", "SCALE_BN"])}
    specs.append({"module": "mtpspec.ops.fp8_gemm", "kernel": "_grouped_kernel", "signature": grouped,
                  "constexprs": dict(A_ROW_DIV=8, HAS_RW=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, FP8_DOT=True,
                                     FP8_BY_BITS=False, BF16_BY_BITS=False),
                  "aligned": ["a_ptr", "w_ptr", "ws_ptr", "out_ptr"], "num_warps": 4})
    def grouped_swap(preq):
        return {"xq_ptr": "*fp8e4nv" if preq else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                "ws_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                "rw_ptr": "*fp32",
                **i32(["num_pairs", "num_experts", "N", "K", "stride_qm", "stride_xs", "stride_we", "stride_wn",
                       "stride_wse", "stride_wsn", "stride_om", "n_kb", "SCALE_BN"])}
    specs += [{"module": "mtpspec.ops.fp8_gemm", "kernel": "_grouped_swap", "signature": grouped_swap(preq),
               "constexprs": dict(A_ROW_DIV=div, HAS_RW=rw, BLOCK_T=16, BLOCK_N=bn, BLOCK_K=128, PREQ=preq,
                                  FP8_DOT=True, FP8_BY_BITS=False, BF16_BY_BITS=False),
               "aligned": ["xq_ptr", "w_ptr", "ws_ptr", "out_ptr", "K", "stride_qm", "stride_we", "stride_wn"],
               "num_warps": 4} for div, rw, bn, preq in ((8, False, 64, True), (1, True, 128, False))]
    reports = triton_utils.compile_reports(specs)
    assert len(reports) == len(specs)
    for spec, rep in zip(specs, reports):  # the swap kernel: no spills (cp.async-pipelined weight tiles)
        if spec["kernel"] in ("_swap", "_grouped_swap") and rep["spill_bytes"] is not None:
            assert rep["spill_bytes"] == 0, (spec["constexprs"], rep)


def test_block_gemm_leading_dims_and_empty(kdev) -> None:
    q, s = quantize_weight_blocks(torch.randn(48, 32), (16, 16))
    x = torch.randn(2, 3, 32)
    y = fp8_block_linear(x.to(kdev), q.to(kdev), s.to(kdev), 16, 16).cpu()
    want = fp8_block_linear_w8a8_ref(x.reshape(6, 32), q, s, 16, 16).reshape(2, 3, 48)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    assert fp8_block_linear(torch.empty(0, 32, device=kdev), q.to(kdev), s.to(kdev), 16, 16).shape == (0, 48)
    with pytest.raises(ValueError, match="needs scales"):
        fp8_block_linear(x, q, s[:, :1], 16, 16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_block_linear(x, q.float(), s, 16, 16)


def test_cpu_path_dequantises_weights_only(no_interp) -> None:
    q, s = quantize_weight_blocks(torch.randn(40, 70), (16, 32))
    x = torch.randn(5, 70)
    assert torch.equal(fp8_block_linear(x, q, s, 16, 32),
                       torch.nn.functional.linear(x, dequantize_weight_blocks(q, s, 16, 32)))


@pytest.mark.parametrize("grouped_swap", [True, False])
def test_fp8_experts_match_dequantised_experts(kdev, monkeypatch, grouped_swap) -> None:
    """Both expert ops, the loop over the routed experts calling the dense kernel and the
    expert-grouped kernel (sync-free; its swap-AB variant for 16-pair blocks, or not), against a
    float64 loop of the same quantised math; the grouped kernel with per-row scales and bf16
    activations against the loop; no tokens."""
    import mtpspec.ops.fp8_gemm as fg
    monkeypatch.setattr(fg, "GROUPED_SWAP_MAX_BLOCK_M", 16 if grouped_swap else 0)
    launched = []
    for name in ("_grouped_swap", "_grouped_kernel"):
        kernel = getattr(fg, name)
        monkeypatch.setattr(fg, name, _SpyKernel(name, kernel, launched))
    g = torch.Generator().manual_seed(3)
    e, h, i, t, top_k = 4, 48, 32, 6, 2
    q13, s13 = quantize_weight_blocks(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, (16, 16))
    q2, s2 = quantize_weight_blocks(torch.randn(e, h, i, generator=g) / i ** 0.5, (16, 16))
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, top_k), generator=g)
    w = torch.rand(t, top_k, generator=g)
    args = [a.to(kdev) for a in (x, q13, s13, q2, s2, w, ids)]
    loop = fp8_experts_loop(*args, 16, 16, 16).cpu()
    grouped = fp8_moe_experts(*args, 16, 16, 16).cpu()
    want = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(top_k):
            x_ = ids[r, j].item()
            gu = fp8_block_linear_w8a8_ref(x[r:r + 1], q13[x_], s13[x_], 16, 16)
            act = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).float()
            want[r] += w[r, j].double() * fp8_block_linear_w8a8_ref(act, q2[x_], s2[x_], 16, 16)[0]
    for got in (loop, grouped):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # per-row gate | up scales (tp shards that cut block rows), bf16 activations
    s13_rows = s13.repeat_interleave(16, dim=1)
    xb = x.bfloat16()
    a16 = [a.to(kdev) for a in (xb, q13, s13_rows, q2, s2, w, ids)]
    grouped16 = fp8_moe_experts(*a16, 1, 16, 16).cpu()
    torch.testing.assert_close(grouped16.float(), fp8_experts_loop(*a16, 1, 16, 16).cpu().float(), atol=3e-2,
                               rtol=2e-2)
    assert fp8_moe_experts(*(a[:0] if a.dim() and i in (0, 5, 6) else a for i, a in enumerate(args)),
                           16, 16, 16).shape == (0, h)
    assert {n for n, _ in launched} == {"_grouped_swap" if grouped_swap else "_grouped_kernel"}
    if grouped_swap:  # activations quantised in the swap kernel's K loop: the same bits
        monkeypatch.setattr(fg, "GROUPED_SWAP_PREQUANT", False)
        assert torch.equal(fp8_moe_experts(*a16, 1, 16, 16).cpu(), grouped16)


class _SpyKernel:
    """A LazyKernel stand-in recording ``(name, grid)`` of every launch."""

    def __init__(self, name, kernel, launched):
        self.name, self.kernel, self.launched = name, kernel, launched

    def __getitem__(self, grid):
        self.launched.append((self.name, tuple(grid)))
        return self.kernel[grid]


# ------------------------------------------------------------------------------------------- checkpoints
def test_writer_layout_follows_the_released_checkpoints(tmp_path) -> None:
    from tiny_models import make_tiny_checkpoint
    src, dst = str(tmp_path / "src"), str(tmp_path / "fp8")
    make_tiny_checkpoint(src, family="glm_moe_dsa")
    write_fp8_checkpoint(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    t = dict(read_checkpoint_tensors(dst))
    fp8 = {k for k, v in t.items() if v.dtype == F8}
    for k in fp8:
        assert t[k + "_scale_inv"].dtype == torch.float32
        assert tuple(t[k + "_scale_inv"].shape) == scale_grid(t[k].shape, (128, 128))
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.0.self_attn.indexer.weights_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.4.shared_head.head.weight"):
        assert t[kept].dtype == torch.float32, kept
    for quantised in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                      "model.layers.0.self_attn.indexer.wq_b.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                      "model.layers.4.eh_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
                      if "model.layers.0.mlp.gate_up_proj.weight" in t else "model.layers.0.mlp.up_proj.weight"):
        assert quantised in fp8, quantised
    assert not should_quantize("model.layers.1.mlp.experts.gate_up_proj", torch.empty(2, 2))
    assert should_quantize("model.layers.1.mlp.experts.gate_up_proj", torch.empty(2, 2, 2))
    back = dequantize_state_dict(quantize_state_dict({"a.weight": torch.ones(3, 3)}, (2, 2)), (2, 2))
    assert set(back) == {"a.weight"} and torch.equal(back["a.weight"], torch.ones(3, 3))
    # the CLI: FP8 with 64 x 32 blocks, then back to float32
    from mtpspec.models.fp8_writer import main
    main([src, str(tmp_path / "cli"), "--block", "64", "32"])
    with open(tmp_path / "cli" / "config.json") as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [64, 32]
    main([str(tmp_path / "cli"), str(tmp_path / "cli-dq"), "--dequantize"])
    back = dict(read_checkpoint_tensors(str(tmp_path / "cli-dq")))
    assert all(v.dtype == torch.float32 for v in back.values()) and not any(k.endswith("_scale_inv") for k in back)
    with pytest.raises(ValueError, match="already quantised"):
        write_fp8_checkpoint(dst, str(tmp_path / "again"))


def test_writer_cli_errors_modes_and_model_card(tmp_path, capsys) -> None:
    """CLI errors are ``error: ...`` + exit 2 (no traceback); the weights get a normal file's mode
    (umask applied, like config.json) and the source's model card is not copied."""
    from tiny_models import make_tiny_checkpoint
    from mtpspec.models.fp8_writer import main
    src, dst = str(tmp_path / "src"), str(tmp_path / "fp8")
    make_tiny_checkpoint(src)
    with open(os.path.join(src, "README.md"), "w") as f:
        f.write("# the float model\n")
    old = os.umask(0o022)
    try:
        assert main([src, dst]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    assert not os.path.exists(os.path.join(dst, "README.md"))
    for name in ("model.safetensors", "config.json"):
        assert os.stat(os.path.join(dst, name)).st_mode & 0o777 == 0o644, name
    for argv, needle in (([src, str(tmp_path / "b"), "--block", "0", "128"], "block sizes must be two ints >= 1"),
                         ([str(tmp_path / "missing"), str(tmp_path / "m")], "no checkpoint at"),
                         ([dst, str(tmp_path / "again")], "already quantised"),
                         ([src, str(tmp_path / "dq"), "--dequantize"], "has no quantization_config")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err, err


_ALLOC_FAILURES = {
    "cpu": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                "memory: you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.25 GiB. GPU 0 has a total "
                                           "capacity of 79.19 GiB of which 1.2 GiB is free."),
}


def _fail_on_call(fn, n, make_exc):
    """``fn`` that raises ``make_exc()`` on its ``n``-th call (after ``n - 1`` that work)."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise make_exc()
        return fn(*a, **kw)
    return wrapped


@pytest.mark.parametrize("kind", sorted(_ALLOC_FAILURES))
def test_writer_allocation_failure_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, kind) -> None:
    """An allocation failure while quantising (simulated on the 5th weight, after 4 went through)
    is ``error: ...`` naming the block asked for and the expected one, exit 2, no traceback; the
    output folder is not created, and an existing one gains no files. Same for ``--dequantize``."""
    import mtpspec.models.fp8_writer as fw
    from tiny_models import make_tiny_checkpoint
    src = str(tmp_path / "src")
    make_tiny_checkpoint(src)
    with open(os.path.join(src, "tokenizer.json"), "w") as f:  # an "other file", copied on success
        f.write("{}")
    assert fw.main([src, str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(fw, "quantize_weight_blocks", _fail_on_call(fw.quantize_weight_blocks, 5, _ALLOC_FAILURES[kind]))
        dst = tmp_path / "fp8"
        assert fw.main([src, str(dst), "--block", "100000", "100000"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: out of memory quantising ") and err.count("\n") == 1, err
        assert "100000 x 100000" in err and "128 x 128" in err and "Traceback" not in err, err
        assert ("37.3 GiB" if kind == "cpu" else "37.25 GiB") in err, err  # the failed allocation's size
        assert not dst.exists()
        existing = tmp_path / "existing"
        existing.mkdir()
        (existing / "notes.txt").write_text("mine")
        mp.setattr(fw, "quantize_weight_blocks", _fail_on_call(quantize_weight_blocks, 1, _ALLOC_FAILURES[kind]))
        assert fw.main([src, str(existing)]) == 2
        assert "out of memory" in capsys.readouterr().err
        assert sorted(os.listdir(existing)) == ["notes.txt"]
    with monkeypatch.context() as mp:
        mp.setattr(fw, "dequantize_weight_blocks", _fail_on_call(fw.dequantize_weight_blocks, 2, _ALLOC_FAILURES[kind]))
        assert fw.main([str(tmp_path / "ok"), str(tmp_path / "dq"), "--dequantize"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: out of memory dequantising ") and "128 x 128" in err, err
        assert not (tmp_path / "dq").exists()


def test_writer_other_errors_propagate_and_a_failed_write_is_removed(tmp_path, monkeypatch) -> None:
    """A RuntimeError that is not an allocation failure is not reworded (nor caught by the CLI);
    a failure while writing removes what was written: the folder it created, or the files it added."""
    import mtpspec.models.fp8_writer as fw
    import mtpspec.models.loader as loader
    from tiny_models import make_tiny_checkpoint
    src = str(tmp_path / "src")
    make_tiny_checkpoint(src)
    with monkeypatch.context() as mp:
        mp.setattr(fw, "quantize_weight_blocks", _fail_on_call(quantize_weight_blocks, 1, lambda: RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="^boom$"):
            write_fp8_checkpoint(src, str(tmp_path / "a"))
        assert not (tmp_path / "a").exists()
    real_save = loader.save_checkpoint

    def save_then_fail(path, *a, **kw):
        real_save(path, *a, **kw)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(loader, "save_checkpoint", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        write_fp8_checkpoint(src, str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    assert fw.main([src, str(tmp_path / "c")]) == 2
    assert sorted(os.listdir(tmp_path / "c")) == ["notes.txt"]


def _fp8_pair(root, family, block=(128, 128), seed=0, tokenizer=False, **overrides):
    """(fp8 folder, dequantised folder, hf model, config) of a tiny checkpoint of ``family``."""
    from test_engine_fixtures import make_model
    src, f8, dq = (os.path.join(root, f"{family}-{block[0]}x{block[1]}-{n}") for n in ("src", "fp8", "dq"))
    hf, cfg = make_model(src, seed=seed, family=family, tokenizer=tokenizer, **overrides)
    write_fp8_checkpoint(src, f8, block)
    write_dequantized_checkpoint(f8, dq)
    return f8, dq, hf, cfg


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8w"))
    made = {}

    def get(family, block=(128, 128), **kw):
        key = (family, block, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = _fp8_pair(root, family, block, **kw)
        return made[key]
    return get


def _logits(target, mtp, prompt):
    dev = next(target.parameters()).device
    ids = torch.tensor(prompt, device=dev)
    pos = torch.arange(len(prompt), device=dev)
    with torch.no_grad():
        h = target(ids, pos)
        lg = target.compute_logits(h)
        mh = mtp(ids.roll(-1), pos, h)
        return lg.cpu(), mtp.compute_logits(mh).cpu()


PROMPT = [5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 4]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_logits_equal_dequantised_checkpoint(pairs, family, no_interp) -> None:
    """CPU path: the FP8 model (weights kept FP8 + scales) and the dequantised float32 checkpoint
    give the same target and MTP logits (1e-4: only the expert-sum order differs)."""
    f8, dq, _, _ = pairs(family)
    t8, m8 = load_models(f8, device="cpu")
    tq, mq = load_models(dq, device="cpu")
    fp8_params = [n for n, p in list(t8.named_parameters()) + list(m8.named_parameters()) if p.dtype == F8]
    assert fp8_params and all(not n.endswith(("kv_b_proj.weight", "weights_proj.weight", "gate.weight",
                                              "embed_tokens.weight", "lm_head.weight")) for n in fp8_params)
    assert any(n.endswith("eh_proj.weight") for n in fp8_params)
    assert any(n.endswith("experts.w13_weight") for n in fp8_params)
    for got, want in zip(_logits(t8, m8, PROMPT), _logits(tq, mq, PROMPT)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    b8 = sum(p.numel() * p.element_size() for p in t8.parameters())
    bq = sum(p.numel() * p.element_size() for p in tq.parameters())
    assert b8 < bq  # fp8 weights: a quarter of float32's bytes (embeddings / lm_head stay float)


def test_huge_block_checkpoint_round_trips(pairs, no_interp) -> None:
    """``--block 100000 100000``: every weight one block (scales ``[1, 1]``, ``[E, 1, 1]``: the
    format's ``ceil(rows / 100000) x ceil(cols / 100000)``), the codes those of a block of the
    weight's own size; the loader takes it and its logits equal the dequantised checkpoint's."""
    block = (100000, 100000)
    f8, dq, _, _ = pairs("deepseek_v3", block)
    with open(os.path.join(f8, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == list(block)
    t = dict(read_checkpoint_tensors(f8))
    plain = dict(read_checkpoint_tensors(dq))
    fp8 = [k for k, v in t.items() if v.dtype == F8]
    assert fp8
    for k in fp8:
        s = t[k + "_scale_inv"]
        assert tuple(s.shape) == scale_grid(t[k].shape, block) and tuple(s.shape[-2:]) == (1, 1), k
        q1, s1 = quantize_weight_blocks(plain[k], tuple(t[k].shape[-2:]))  # requantising is exact
        assert torch.equal(t[k].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1), k
    t8, m8 = load_models(f8, device="cpu")
    tq, mq = load_models(dq, device="cpu")
    assert any(p.dtype == F8 for p in t8.parameters())
    for got, want in zip(_logits(t8, m8, PROMPT), _logits(tq, mq, PROMPT)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_fp8_logits_equal_transformers_with_its_own_dequantisation(pairs, family, no_interp) -> None:
    """Independent reference: transformers' model with the FP8 checkpoint's tensors dequantised
    by transformers' ``Fp8Dequantize`` (what ``from_pretrained(..., dequantize=True)`` does)."""
    import transformers
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from mtpspec.models.loader import save_checkpoint
    f8, _, _, _ = pairs(family)
    t = dict(read_checkpoint_tensors(f8))
    deq = Fp8Dequantize(None)
    plain = {k: deq._dequantize_one(v, t[k + "_scale_inv"], torch.float32) if v.dtype == F8 else v
             for k, v in t.items() if not k.endswith("_scale_inv")}
    with open(os.path.join(f8, "config.json")) as f:
        raw = json.load(f)
    raw.pop("quantization_config")
    ref_dir = os.path.join(os.path.dirname(f8), f"{family}-transformers-dequantised")
    save_checkpoint(ref_dir, plain, raw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    target, _ = load_models(f8, device="cpu", load_mtp=False)
    with torch.no_grad():
        got = target.compute_logits(target(torch.tensor(PROMPT), torch.arange(len(PROMPT))))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def _w8a8_emulation(x, weight, scale, block_n, block_k, bias=None):
    """The kernel's quantised math in torch (float32 result): a stand-in for the CPU path."""
    y = fp8_block_linear_w8a8_ref(x.reshape(-1, x.shape[-1]), weight, scale, block_n, block_k, torch.float32)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return (y if bias is None else y + bias.float()).to(x.dtype)


def test_fp8_kernel_path_through_the_model(pairs, kdev, monkeypatch) -> None:
    """The Triton path (activations quantised per token and group) through DeepSeek-V3's whole
    target and MTP model: every FP8 GEMM call (dense layers and grouped experts) equals a torch
    emulation of the same quantised math on the same input (codes and scales are torch's bit for
    bit; only the accumulation differs: fp32 summation order, and on Hopper the fp8 tensor cores'
    reduced-precision accumulation, DeepSeek-V3 sec. 3.3.2), and the model's logits stay near the
    dequantised-weight model (activation quantisation error, measured 10% relative RMS on the
    target's logits, 22% on the MTP layer's, whose input carries the target's error; most greedy
    tokens agree). Under the interpreter (exact fp32 dots) the whole model also equals the
    emulated one to 1e-3; on a GPU the per-call differences flip a few downstream activation
    codes (one e4m3 step, up to 6%), so only the per-call check is exact there."""
    import mtpspec.layers.fused_moe as fm
    import mtpspec.layers.linear as lin
    import mtpspec.ops.fp8_gemm as fg
    f8, dq, _, _ = pairs("deepseek_v3")
    t8, m8 = load_models(f8, device=kdev)
    calls = []

    def checked(name, fn):
        def run(*args, **kw):
            y = fn(*args, **kw)
            with monkeypatch.context() as mp:  # the same call, emulated in torch
                mp.setattr(fg, "use_triton", lambda *a: False)
                mp.setattr(fg, "fp8_block_linear_ref", _w8a8_emulation)
                e = fn(*args, **kw)
            err = (y.float() - e.float()).abs().max().item() / max(e.float().abs().max().item(), 1e-6)
            calls.append((name, tuple(args[0].shape), err))
            return y
        return run

    with monkeypatch.context() as mp:
        mp.setattr(lin, "fp8_block_linear", checked("linear", fg.fp8_block_linear))
        mp.setattr(fm, "fp8_moe_experts", checked("experts", fg.fp8_moe_experts))
        got = _logits(t8, m8, PROMPT)
    assert {c[0] for c in calls} == {"linear", "experts"}, calls
    # relative to the call's largest output: one GEMM differs in its accumulation only; the experts
    # chain two (gate | up, then down), so their intermediate's codes can differ by an e4m3 step
    # where the first GEMM's sums differ (H200: 5.7e-3 measured)
    for name, tol in (("linear", 2e-3), ("experts", 2e-2)):
        worst = max((c for c in calls if c[0] == name), key=lambda c: c[2])
        assert worst[2] < tol, worst
    if kdev == "cpu":
        with monkeypatch.context() as mp:
            mp.setattr(fg, "use_triton", lambda *a: False)
            mp.setattr(fg, "fp8_block_linear_ref", _w8a8_emulation)
            emulated = _logits(t8, m8, PROMPT)
        for g, e in zip(got, emulated):
            torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)
    tq, mq = load_models(dq, device=kdev)
    plain = _logits(tq, mq, PROMPT)
    for g, p, bound in zip(got, plain, (0.15, 0.3)):
        rel = ((g - p).norm() / p.norm()).item()
        agree = (g.argmax(-1) == p.argmax(-1)).float().mean().item()
        assert rel < bound and agree >= 0.7, (rel, agree)


def test_unaligned_tp_shard_is_a_clear_error(pairs, no_interp) -> None:
    """GLM-4.5 tiny at tp 2 with 128 x 128 blocks: o_proj's 128 input columns split into 64 per
    rank, which cuts the weight blocks."""
    from mtpspec.distributed import launch
    f8, _, _, _ = pairs("glm4_moe")
    errs = launch(_load_error, 2, f8, timeout_s=300)
    for e in errs:
        assert "ValueError" in e[0] or "CheckpointError" in e[0]
        assert "o_proj" in e[1] and "tp=2" in e[1] and "64 columns per rank" in e[1] and "128" in e[1], e


def _load_error(path):
    try:
        load_models(path, device="cpu")
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_missing_scale_is_a_clear_error_and_loads_nothing(pairs, tmp_path, no_interp) -> None:
    from safetensors.torch import save_file
    f8, _, _, _ = pairs("deepseek_v3")
    t = dict(read_checkpoint_tensors(f8))
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    del t[key]
    save_file(t, str(tmp_path / "model.safetensors"))
    with open(os.path.join(f8, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    result = None
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.") + r".*FP8 weight .*o_proj\.weight.* needs its"):
        result = load_models(str(tmp_path), device="cpu")
    assert result is None
    # FP8 tensors without quantization_config: named as such
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*quantization_config quant_method 'fp8'"):
        load_models(str(tmp_path), device="cpu")


def test_bad_quantization_config_is_refused(tmp_path) -> None:
    from mtpspec.config import Fp8WeightConfig, ModelConfigError
    assert Fp8WeightConfig.from_dict(None) is None
    assert Fp8WeightConfig.from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]}).weight_block_size == (
        128, 128)
    for bad, msg in (({"quant_method": "awq"}, "quant_method 'awq'"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt"),
                     ({"quant_method": "fp8"}, "weight_block_size"),
                     ({"quant_method": "fp8", "weight_block_size": [128]}, "two ints")):
        with pytest.raises(ModelConfigError, match=msg):
            Fp8WeightConfig.from_dict(bad)


# ------------------------------------------------------------------------------------------- engine
def _generate(path, prompts, k, **kw):
    from test_deepseek_v32 import engine_generate, engine_llm
    spec = {"num_speculative_tokens": k} if k else None
    with engine_llm(path, speculative_config=spec, **kw) as llm:
        out = engine_generate(llm, prompts)
        if k:
            m = llm.get_metrics()
            assert m["num_drafts"] > 0
    return out


@pytest.mark.parametrize("family", ["glm4_moe", "glm_moe_dsa"])
def test_spec_decoding_on_fp8_model_equals_greedy(pairs, family, no_interp) -> None:
    from test_engine_fixtures import mixed_prompts
    f8, _, _, cfg = pairs(family, tokenizer=True)
    prompts = mixed_prompts(4, cfg.vocab_size, seed=2)
    assert _generate(f8, prompts, 3) == _generate(f8, prompts, 0)


def test_fp8_tp2_equals_tp1(pairs, no_interp) -> None:
    """DeepSeek-V3 tiny (v_head_dim 8) with 32 x 16 blocks at tp 2: o_proj / down projections cut
    on 16-column blocks, q_b_proj's 40-row shards do not cut 32-row blocks (one scale row per
    weight row), kv_b_proj dequantised: greedy k = 3 at tp 2 emits tp 1's tokens."""
    from test_engine_fixtures import mixed_prompts
    f8, _, _, cfg = pairs("deepseek_v3", (32, 16), tokenizer=True, v_head_dim=8)
    from mtpspec.distributed import launch
    prompts = mixed_prompts(3, cfg.vocab_size, seed=5)
    want = _generate(f8, prompts, 0, device="cpu")  # the CPU path on both sides (a GPU's kernels quantise activations)
    assert _generate(f8, prompts, 3, tensor_parallel_size=2, device="cpu") == want
    # and the logits: every rank's target and MTP logits equal tp 1's
    t1, m1 = load_models(f8, device="cpu")
    ref = _logits(t1, m1, PROMPT)
    assert t1.model.layers[0].self_attn.q_b_proj.scale_block_n == 32  # tp 1: one shard, block rows kept
    for logits, sbn in launch(_rank_logits, 2, f8, timeout_s=300):
        assert sbn == 1  # 40-row shards of 32-row blocks: one scale row per weight row
        for got, r in zip(logits, ref):
            torch.testing.assert_close(got, r, atol=1e-4, rtol=1e-4)


def _rank_logits(path):
    torch.set_num_threads(1)
    target, mtp = load_models(path, device="cpu")
    return _logits(target, mtp, PROMPT), target.model.layers[0].self_attn.q_b_proj.scale_block_n


def test_generate_cli_fp8_checkpoint_fp8_cache(pairs, capsys, no_interp) -> None:
    from mtpspec.entrypoints.cli import main
    f8, _, _, _ = pairs("glm_moe_dsa", tokenizer=True)
    rc = main(["generate", "--model", f8, "--kv-cache-dtype", "fp8", "--prompt", "w5 w6 w7", "-k", "3",
               "--max-tokens", "5", "--max-model-len", "48", "--num-kv-blocks", "64", "--json"])
    assert rc in (0, None)
    got = json.loads(capsys.readouterr().out)
    assert len(got["outputs"][0]["token_ids"]) == 5


def test_layers_stored_unquantised_stay_plain_and_mixed_experts_quantise_on_load(pairs, tmp_path, no_interp) -> None:
    """``modules_to_not_convert``: a layer whose weight the checkpoint keeps in float is built plain
    (no scales); one float expert among FP8 ones is block-quantised on load (exact here: a
    dequantised block re-quantises to the same codes, its amax code being 448)."""
    from safetensors.torch import save_file
    from mtpspec.engine.model_runner import _host_sync_layers
    f8, dq, _, _ = pairs("deepseek_v3")
    t = dict(read_checkpoint_tensors(f8))
    plain = "model.layers.1.self_attn.o_proj.weight"
    t[plain] = dequantize_weight_blocks(t[plain], t.pop(plain + "_scale_inv"), 128, 128)
    mixed = "model.layers.2.mlp.experts.5.up_proj.weight"
    t[mixed] = dequantize_weight_blocks(t[mixed], t.pop(mixed + "_scale_inv"), 128, 128)
    save_file(t, str(tmp_path / "model.safetensors"))
    with open(os.path.join(f8, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    t8, m8 = load_models(str(tmp_path), device="cpu")
    o = t8.model.layers[1].self_attn.o_proj
    assert o.fp8_block is None and o.weight.dtype == torch.float32 and not hasattr(o, "weight_scale_inv")
    assert t8.model.layers[2].mlp.experts.w13_weight.dtype == F8
    assert not _host_sync_layers(t8, m8)  # 128-column groups: the grouped kernel, sync-free
    from mtpspec.layers.fp8 import fp8_weights
    from mtpspec.layers.fused_moe import FusedMoE
    with fp8_weights((16, 24)):  # a group the kernel does not take: the expert loop, host sync
        assert _host_sync_layers(FusedMoE(4, 48, 32))
    tq, mq = load_models(dq, device="cpu")
    for got, want in zip(_logits(t8, m8, PROMPT), _logits(tq, mq, PROMPT)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_dummy_load_format_builds_fp8_layers(pairs, no_interp) -> None:
    f8, _, _, _ = pairs("glm_moe_dsa")
    target, mtp = load_models(f8, device="cpu", load_format="dummy")
    w = target.model.layers[0].self_attn.q_a_proj
    assert w.weight.dtype == F8 and w.weight_scale_inv.dtype == torch.float32
    deq = dequantize_weight_blocks(w.weight, w.weight_scale_inv, 128, 128)
    assert deq.abs().max() <= 1e-3 + 1e-9 and deq.abs().max() > 1e-4
    lg = _logits(target, mtp, PROMPT)
    assert all(bool(torch.isfinite(x).all()) for x in lg)


def test_fused_expert_layout_fp8(pairs, tmp_path, no_interp) -> None:
    """transformers >= 5's fused expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]`` +
    ``gate_up_proj_scale_inv``, ``down_proj`` likewise) load like the per-expert ones."""
    from safetensors.torch import save_file
    _, dq, _, cfg = pairs("glm4_moe", (16, 16))
    t = dict(read_checkpoint_tensors(dq))
    e = cfg.n_routed_experts
    for layer in range(1, cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.stack([torch.cat([t.pop(f"{p}{x}.gate_proj.weight"), t.pop(f"{p}{x}.up_proj.weight")])
                               for x in range(e)])
        down = torch.stack([t.pop(f"{p}{x}.down_proj.weight") for x in range(e)])
        t[p + "gate_up_proj"], t[p + "down_proj"] = gate_up, down
    q = quantize_state_dict(t, (16, 16))
    assert q["model.layers.1.mlp.experts.gate_up_proj"].dtype == F8
    assert tuple(q["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape) == (e, 4, 4)
    save_file(q, str(tmp_path / "model.safetensors"))
    with open(os.path.join(dq, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    t8, m8 = load_models(str(tmp_path), device="cpu")
    assert t8.model.layers[1].mlp.experts.w13_scale_block_n == 16
    tq, mq = load_models(dq, device="cpu")
    for got, want in zip(_logits(t8, m8, PROMPT), _logits(tq, mq, PROMPT)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_spec_decoding_on_fp8_model_kernel_path(pairs, kdev) -> None:
    """Through the Triton kernels (interpreted on CPU: dense FP8 GEMMs, the expert-grouped FP8
    kernel, every step graph-style): greedy k = 3 emits plain greedy's tokens over an FP8 cache."""
    from test_engine_fixtures import mixed_prompts
    f8, _, _, cfg = pairs("glm4_moe", tokenizer=True)
    prompts = mixed_prompts(2, cfg.vocab_size, seed=2)
    plain = _generate(f8, prompts, 0, graph_mode="static", kv_cache_dtype="fp8")
    assert _generate(f8, prompts, 3, graph_mode="static", kv_cache_dtype="fp8") == plain


def test_kernel_takes_only_tile_sized_groups():
    """The Triton kernel dots one group of ``block_k`` columns per ``tl.dot`` step, so only
    powers of two in 16 .. 256 go to it; a huge power-of-two group (``fp8_writer --block 131072
    131072`` is accepted) takes the torch path instead of a 131072-column tile."""
    from mtpspec.ops.fp8_gemm import KERNEL_MAX_BLOCK_K, kernel_supports
    assert [b for b in (8, 16, 32, 64, 96, 128, 256) if kernel_supports(b)] == [16, 32, 64, 128, 256]
    assert KERNEL_MAX_BLOCK_K == 256
    assert not any(kernel_supports(b) for b in (512, 100000, 131072, 1 << 40))
