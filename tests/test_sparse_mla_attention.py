"""Sparse MLA attention (DSA: each row attends its own selected cache slots) on the torch path and
the Triton kernel (interpreter) against an independent float64 brute force (per row and head, a
python loop over the row's slots), its equality with dense MLA when the selection is every causal
position, positions_to_slots, the checks, the sm_90 compile and the benchmark's smoke run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mtpspec.ops.mla_attention import mla_attention
from mtpspec.ops.sparse_mla_attention import (positions_to_slots, sparse_mla_attention, sparse_mla_attention_plan,
                                              sparse_mla_attention_ref)

R, ROPE, BS = 64, 16, 8  # kv_lora_rank + rope at test sizes; cache block size
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_case(t: int, heads: int, k: int, dtype: torch.dtype, seed: int = 0, num_blocks: int = 9):
    """Random queries, a cache whose never-selected slots hold NaN (a stray read shows), and
    ``topk_slots [t, k]``: distinct slots per row, ``-1`` scattered through each row, row 1 all
    ``-1`` (a graph padding row), row 0 with a ``-1`` head, the last row with a ``-1`` tail."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * BS
    slots = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    unused = torch.rand(t, k, generator=g) < 0.3
    slots[unused] = -1
    slots[0, :k // 4] = -1
    slots[1] = -1
    slots[-1, k // 3:] = -1
    cache = torch.full((num_blocks, BS, R + ROPE), float("nan"), dtype=dtype)
    flat = cache.view(-1, R + ROPE)
    used = slots[slots >= 0].long().unique()
    flat[used] = torch.randn(used.numel(), R + ROPE, generator=g).to(dtype)
    ql = torch.randn(t, heads, R, generator=g).to(dtype)
    qp = torch.randn(t, heads, ROPE, generator=g).to(dtype)
    return ql, qp, cache, slots


def brute_force(ql, qp, cache, slots, scale) -> torch.Tensor:
    """float64, one (row, head) at a time over the row's valid slots in python."""
    flat = cache.reshape(-1, R + ROPE).double()
    t, nh, _ = ql.shape
    out = torch.zeros(t, nh, R, dtype=torch.float64)
    for i in range(t):
        keep = [s for s in slots[i].tolist() if 0 <= s < flat.shape[0]]
        if not keep:
            continue
        kv = flat[keep]
        for h in range(nh):
            q = torch.cat([ql[i, h], qp[i, h]]).double()
            p = torch.softmax(kv @ q * scale, dim=0)
            out[i, h] = p @ kv[:, :R]
    return out


TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("heads", [6, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_matches_brute_force(request, path, dtype, heads) -> None:
    request.getfixturevalue(path)
    ql, qp, cache, slots = make_case(5, heads, 40, dtype, seed=heads)
    scale = (R + ROPE) ** -0.5
    o = sparse_mla_attention(ql, qp, cache, slots, scale, block_n=16)
    assert o.shape == ql.shape and o.dtype == dtype
    want = brute_force(ql, qp, cache, slots, scale)
    torch.testing.assert_close(o.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(o[1], torch.zeros_like(o[1])), "an all -1 row gives zeros"


@pytest.mark.parametrize("num_splits,block_m", [(1, 16), (3, 16), (2, 32), (5, 16)])
def test_kernel_splits_and_head_blocks(interp, num_splits, block_m) -> None:
    # 40 heads at block_m 16: three head blocks, the last one partial; 5 splits of 48 slots at
    # block_n 16 leave some splits with nothing to do
    ql, qp, cache, slots = make_case(3, 40, 48, torch.float32, seed=3)
    o = sparse_mla_attention(ql, qp, cache, slots, 0.1, num_splits=num_splits, block_m=block_m, block_n=16)
    torch.testing.assert_close(o.double(), brute_force(ql, qp, cache, slots, 0.1), atol=1e-4, rtol=1e-4)
    ref = sparse_mla_attention_ref(ql, qp, cache, slots, 0.1)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_out_of_range_slots_and_strided_inputs(interp) -> None:
    """Slots >= num_blocks * block_size count as unused; head-strided q (a bmm's [H, T, r] output
    transposed), column-sliced topk_slots rows and int64 slots are accepted."""
    ql, qp, cache, slots = make_case(3, 16, 24, torch.float32, seed=4)
    n = cache.shape[0] * BS
    slots[0, 5] = n
    slots[2, 0] = n + 1000
    wide = torch.full((3, 30), -7, dtype=torch.int64)
    wide[:, 2:26] = slots
    ql_t = ql.transpose(0, 1).contiguous().transpose(0, 1)
    o = sparse_mla_attention(ql_t, qp, cache, wide[:, 2:26], 0.2, num_splits=2, block_n=16)
    torch.testing.assert_close(o.double(), brute_force(ql, qp, cache, slots, 0.2), atol=1e-4, rtol=1e-4)


def test_rows_of_one_sequence_keep_their_own_selection(interp) -> None:
    """Four verification rows with the SAME queries and different selections: each output is the
    softmax over its own row's slots (a kernel that used one row's selection for all would give
    four equal rows)."""
    ql, qp, cache, slots = make_case(4, 16, 16, torch.float32, seed=5)
    slots = torch.stack([torch.arange(16) + 4 * i for i in range(4)]).to(torch.int32)  # shifted windows
    cache = torch.randn(cache.shape)
    ql, qp = ql[:1].expand(4, -1, -1), qp[:1].expand(4, -1, -1)
    o = sparse_mla_attention(ql, qp, cache, slots, 0.1, block_n=16)
    torch.testing.assert_close(o.double(), brute_force(ql, qp, cache, slots, 0.1), atol=1e-4, rtol=1e-4)
    assert all((o[0] - o[i]).abs().max() > 1e-3 for i in (1, 2, 3))


def test_empty_inputs(interp) -> None:
    ql, qp, cache, slots = make_case(3, 6, 8, torch.float32)
    assert sparse_mla_attention(ql[:0], qp[:0], cache, slots[:0], 0.1).shape == (0, 6, R)
    assert torch.equal(sparse_mla_attention(ql, qp, cache, slots[:, :0], 0.1), torch.zeros_like(ql))


# ------------------------------------------------------------------------------------------ vs dense MLA
def dense_problem(q_lens, s_lens, heads, dtype, seed=0):
    """A dense-MLA batch (paged cache, shuffled block tables, graph padding: one row past the
    real ones and a padding sequence of length 0) and the sparse selection of EVERY causal
    position, as positions padded with -1 to ``max_seq_len + 3`` entries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s in s_lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    bt = torch.full((len(s_lens) + 1, max(need)), -1, dtype=torch.int32)
    k = 0
    for i, n in enumerate(need):
        bt[i, :n] = torch.tensor(perm[k:k + n])
        k += n
    cache = torch.randn(nb, BS, R + ROPE, generator=g).to(dtype)
    t = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist() + [t], dtype=torch.int32)
    seq_lens = torch.tensor(list(s_lens) + [0], dtype=torch.int32)
    ql = torch.randn(t + 1, heads, R, generator=g).to(dtype)
    qp = torch.randn(t + 1, heads, ROPE, generator=g).to(dtype)
    width = max(s_lens) + 3
    pos = torch.full((t + 1, width), -1, dtype=torch.int32)
    seq_idx = torch.full((t + 1,), len(s_lens), dtype=torch.int32)  # the padding row: the padding sequence
    row = 0
    for i, (q, s) in enumerate(zip(q_lens, s_lens)):
        for j in range(q):
            p = s - q + j
            pos[row, :p + 1] = torch.arange(p + 1)
            seq_idx[row] = i
            row += 1
    meta = (qsl, seq_lens, bt, max(q_lens), max(s_lens))
    return ql, qp, cache, meta, positions_to_slots(pos, seq_idx, bt, BS)


@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_every_causal_position_equals_dense_mla(request, path) -> None:
    """The issue's contract at the op level: with context <= index_topk the selection is every
    causal position, and sparse MLA must equal dense MLA (prefill, decode at a block boundary,
    1 + 3 verification rows, a graph padding row and sequence)."""
    request.getfixturevalue(path)
    ql, qp, cache, meta, slots = dense_problem([5, 1, 4, 1], [5, 17, 29, 16], 6, torch.float32, seed=1)
    dense = mla_attention(ql, qp, cache, *meta[:3], 0.12, *meta[3:])
    sparse = sparse_mla_attention(ql, qp, cache, slots, 0.12, block_n=16)
    torch.testing.assert_close(sparse, dense, atol=2e-6, rtol=2e-6)
    assert torch.equal(sparse[-1], torch.zeros_like(sparse[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_dense_mla_bitwise(interp, dtype) -> None:
    """Decode rows, one split, the same 16-head tile and 16-slot tiles: the sparse kernel does
    the dense kernel's arithmetic in the same order, so the outputs are bit-identical."""
    ql, qp, cache, meta, slots = dense_problem([1, 1, 1], [9, 16, 40], 16, dtype, seed=2)
    dense = mla_attention(ql, qp, cache, *meta[:3], 0.12, *meta[3:], num_splits=1, block_m=16, block_n=16)
    sparse = sparse_mla_attention(ql, qp, cache, slots, 0.12, num_splits=1, block_m=16, block_n=16)
    assert torch.equal(sparse, dense)


# ------------------------------------------------------------------------------------------ positions_to_slots
def test_positions_to_slots() -> None:
    bt = torch.tensor([[3, 0, 5], [7, -1, -1]], dtype=torch.int32)
    pos = torch.tensor([[0, 9, -1, 17, 24], [1, 8, 30, -1, 2], [5, 23, 8, -5, 0]], dtype=torch.int32)
    seq = torch.tensor([0, 1, 0], dtype=torch.int64)
    got = positions_to_slots(pos, seq, bt, BS)
    want = []
    for i in range(3):
        row = []
        for p in pos[i].tolist():
            b = p // BS
            ok = p >= 0 and b < bt.shape[1] and bt[seq[i], b] >= 0
            row.append(int(bt[seq[i], b]) * BS + p % BS if ok else -1)
        want.append(row)
    assert got.dtype == torch.int32 and got.tolist() == want
    assert want[0] == [24, 1, -1, 41, -1] and want[1] == [57, -1, -1, -1, 58]
    assert positions_to_slots(pos, seq, bt[:, :0], BS).eq(-1).all()


def test_no_host_sync(interp) -> None:
    from test_paged_attention import no_host_sync
    ql, qp, cache, meta, slots = dense_problem([1, 4], [9, 20], 6, torch.float32, seed=3)
    pos = torch.full(slots.shape, 3, dtype=torch.int32)
    with torch.no_grad(), no_host_sync():
        positions_to_slots(pos, torch.zeros(pos.shape[0], dtype=torch.int32), meta[2], BS)
        sparse_mla_attention(ql, qp, cache, slots, 0.1, num_splits=2)
        sparse_mla_attention_ref(ql, qp, cache, slots, 0.1)


# ------------------------------------------------------------------------------------------ checks / plan
def test_bad_inputs_raise() -> None:
    ql, qp, cache, slots = make_case(3, 6, 8, torch.float32)
    with pytest.raises(ValueError, match="topk_slots must be"):
        sparse_mla_attention(ql, qp, cache, slots[:2], 0.1)
    with pytest.raises(TypeError, match="topk_slots must be int32"):
        sparse_mla_attention(ql, qp, cache, slots.float(), 0.1)
    with pytest.raises(TypeError, match="share one of"):
        sparse_mla_attention(ql, qp, cache.double(), slots, 0.1)
    with pytest.raises(ValueError, match="kv_cache must be"):
        sparse_mla_attention(ql, qp, cache[..., :-1], slots, 0.1)
    with pytest.raises(ValueError, match="unit stride"):
        sparse_mla_attention(ql, qp, cache, slots.t().contiguous().t(), 0.1)
    with pytest.raises(TypeError, match="q_pe must be a torch.Tensor"):
        sparse_mla_attention(ql, None, cache, slots, 0.1)
    with pytest.raises(ValueError, match="block_size must be"):
        positions_to_slots(slots, torch.zeros(3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 0)
    with pytest.raises(TypeError, match="token_seq_idx must be int32"):
        positions_to_slots(slots, torch.zeros(3), torch.zeros(1, 2, dtype=torch.int32), BS)


def test_plan_is_static() -> None:
    # the target: 64 sequences x 1 or 4 rows, index_topk 2048, 16 / 128 heads, 132 SMs
    assert sparse_mla_attention_plan(64, 16, 2048, 132) == dict(block_m=16, head_blocks=1, num_splits=8, num_warps=4)
    assert sparse_mla_attention_plan(256, 16, 2048, 132)["num_splits"] == 2  # 5 * 132 // 256
    assert sparse_mla_attention_plan(256, 128, 2048, 132) == dict(block_m=64, head_blocks=2, num_splits=1, num_warps=8)
    assert sparse_mla_attention_plan(1, 6, 100, 132)["block_m"] == 16
    with pytest.raises(ValueError):
        sparse_mla_attention_plan(1, 16, 10, 1, block_m=24)


def test_kernel_compiles_for_hopper() -> None:
    """Ahead-of-time sm_90 compile (no GPU needed; the interpreter checks no tile rules) at
    DeepSeek sizes (512 + 64, bf16) with the default plans of 16 and 128 heads."""
    from mtpspec.ops import triton_utils
    sig = {n: "*bf16" for n in ("ql_ptr", "qp_ptr", "kv_ptr", "out_ptr")}
    sig.update({"slots_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32",
                "num_topk": "i32", "n_slots": "i32", "num_splits": "i32", "k_scale": "fp32"})
    strides = ["stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_kb", "stride_ks", "stride_st",
               "stride_ot", "stride_oh", "stride_pt", "stride_ph"]
    sig.update({s: "i32" for s in strides})
    specs = []
    for heads in (16, 128):
        plan = sparse_mla_attention_plan(64, heads, 2048, 132)
        specs.append({"module": "mtpspec.ops.sparse_mla_attention", "kernel": "_sparse_mla", "signature": sig,
                      "constexprs": dict(NUM_HEADS=heads, LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                                         BLOCK_M=plan["block_m"], BLOCK_N=64, SCAN_N=256, CACHE_BLOCK=16, SPLIT=True,
                                         DOT_FP32=False, PRECISION="tf32", BF16_BY_BITS=False, FP8=False),
                      "aligned": ["ql_ptr", "qp_ptr", "kv_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr",
                                  "slots_ptr"] + strides[:7], "num_warps": plan["num_warps"]})
    reports = triton_utils.compile_reports(specs)
    # like the dense kernel's default plans these spill a little (triton 3.9: 136 bytes at 16 heads
    # with 4 warps, 280 at 64 heads with 8); the dense test's bound, so a regression shows
    assert all((r["spill_bytes"] or 0) <= 512 for r in reports), reports


def test_bench_smoke(tmp_path) -> None:
    out = tmp_path / "sparse.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sparse_mla.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json
    res = json.loads(out.read_text())
    assert res["smoke"] and len(res["sparse"]) == 4 and len(res["indexer"]) == 2
    assert all(r["max_abs_err"] < 1e-2 and r["kernel_ms"] > 0 for r in res["sparse"] + res["indexer"])


def test_costs_script_smoke_and_fit(tmp_path) -> None:
    """``benchmarks/sparse_mla_costs.py --smoke`` runs (tiny shapes, CPU) and writes its rows; its
    least-squares line recovers an exact ``fixed + tile * tiles`` and refuses a single x."""
    out = tmp_path / "costs.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sparse_mla_costs.py"), "--smoke",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 2 and all(r["max_abs_err"] < 1e-2 and r["host_us"] > 0 for r in res["rows"])
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from sparse_mla_costs import fit
    finally:
        sys.path.pop(0)
    f = fit([4.0, 8.0, 16.0, 32.0], [12.0 + 2.5 * x for x in (4.0, 8.0, 16.0, 32.0)])
    assert abs(f["fixed_us"] - 12.0) < 1e-9 and abs(f["tile_us"] - 2.5) < 1e-9 and f["max_resid_us"] < 1e-9
    assert fit([8.0, 8.0], [1.0, 2.0]) is None
