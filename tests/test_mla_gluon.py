"""The warp-specialised Gluon MLA kernel (:mod:`mtpspec.ops.mla_gluon`): against the torch
reference and the Triton kernel on a Hopper GPU (skipped elsewhere), its dispatch rules on any
machine, and an ahead-of-time sm_90 compile (no GPU needed) that bounds its shared memory and
checks that it issues bulk tensor copies, warpgroup MMAs and register reallocation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_engine_fixtures import repo_env

from mtpspec.ops import mla_gluon, mla_gluon_km
from mtpspec.ops.mla_attention import mla_attention, mla_attention_ref

ON_HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and mla_gluon.HAS_GLUON)


def _problem(heads, q_lens, seq_lens, block_size=64, seed=0, dtype=torch.bfloat16, device="cuda", spare_blocks=3):
    """Random DeepSeek-V3-size latent cache (512 + 64) with scattered block tables; stale (NaN)
    slots past every sequence's end, which must never reach the output."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [max(1, -(-s // block_size)) for s in seq_lens]
    nblocks = sum(need) + spare_blocks
    cache = torch.full((nblocks, block_size, 576), float("nan"), dtype=dtype)
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    k = 0
    for i, (n, s) in enumerate(zip(need, seq_lens)):
        ids = perm[k:k + n]
        k += n
        tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        for p in range(s):
            cache[ids[p // block_size], p % block_size] = (torch.randn(576, generator=g) * 0.5).to(dtype)
    t = sum(q_lens)
    q_latent = (torch.randn(t, heads, 512, generator=g) * 0.3).to(dtype)
    q_pe = (torch.randn(t, heads, 64, generator=g) * 0.3).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    to = lambda x: x.to(device)  # noqa: E731
    return (to(q_latent), to(q_pe), to(cache), to(qsl), to(torch.tensor(seq_lens, dtype=torch.int32)), to(tables),
            (128 + 64) ** -0.5, max(q_lens), max(max(seq_lens), 1))


CASES = [  # heads, query rows per sequence, sequence lengths (partial last tiles, short and long contexts), block
    (16, [4, 4, 4, 4, 4], [100, 37, 4, 333, 64]),
    (16, [4, 3, 1], [1000, 513, 2]),
    (128, [1, 1, 1], [33, 257, 1]),
    (128, [4, 2], [70, 500]),
    (64, [1, 2, 1, 1], [31, 32, 65, 1500]),
    (16, [4, 4, 1], [130, 700, 129], 128),
    (24, [4, 3], [200, 90]),  # 96 and 72 (row, head) pairs: a row block ends mid-row
    (16, [1, 1, 1, 1], [300, 65, 1, 128]),  # 16 pairs: one padded row block (16 heads x 1 row)
]


@pytest.fixture(params=["seesaw", "seesaw-r1", "split", "split-pv", "split@2", "split-pv@1"])
def schedule(request, monkeypatch):
    """The dense schedules of the Gluon kernel (:data:`mtpspec.ops.mla_gluon.DENSE_SCHEDULE`); ``@N``:
    with the L2 prefetch ``N`` key tiles ahead (:data:`mtpspec.ops.mla_gluon.L2_AHEAD`)."""
    name, _, ahead = request.param.partition("@")
    monkeypatch.setattr(mla_gluon, "DENSE_SCHEDULE", name)
    monkeypatch.setattr(mla_gluon, "L2_AHEAD", int(ahead or 0))
    return request.param


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_gluon_kernel_matches_reference(case, num_splits, schedule) -> None:
    args = _problem(*case[:3], block_size=case[3] if len(case) > 3 else 64)
    got = mla_attention(*args, num_splits=num_splits, impl="gluon").float()
    ref = mla_attention_ref(*args).float()
    tri = mla_attention(*args, num_splits=num_splits, impl="triton").float()
    assert torch.isfinite(got).all()
    err, tri_err = (got - ref).abs().max().item(), (tri - ref).abs().max().item()
    assert err <= max(2 * tri_err, 4e-3), (err, tri_err)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
def test_gluon_kernel_fp16_and_int64_tables(schedule) -> None:
    """fp16 queries and cache; int64 metadata (TMA coordinates are 32-bit: the kernel narrows them)."""
    args = list(_problem(16, [4, 4, 2], [300, 65, 1000], dtype=torch.float16))
    args[3], args[4], args[5] = args[3].long(), args[4].long(), args[5].long()
    got = mla_attention(*args, impl="gluon").float()
    ref = mla_attention_ref(*args).float()
    assert (got - ref).abs().max().item() < 4e-3


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
def test_gluon_kernel_padding_rows_and_graph_capture(schedule) -> None:
    """Padding sequences (no query rows, length 0) and rows past ``query_start_loc[-1]``; the
    launch inside a CUDA graph replays to the same result."""
    q_latent, q_pe, cache, qsl, sl, bt, scale, mq, ms = _problem(16, [4, 4], [77, 300])
    pad = 3
    q_latent = torch.cat([q_latent, torch.randn_like(q_latent[:pad])])
    q_pe = torch.cat([q_pe, torch.randn_like(q_pe[:pad])])
    qsl = torch.cat([qsl, qsl[-1:]])
    sl = torch.cat([sl, torch.zeros_like(sl[:1])])
    bt = torch.cat([bt, torch.zeros_like(bt[:1])])
    args = (q_latent, q_pe, cache, qsl, sl, bt, scale, mq, ms)
    ref = mla_attention_ref(*args).float()
    got = mla_attention(*args, impl="gluon")
    assert (got[-pad:] == 0).all()
    assert (got.float() - ref).abs().max().item() < 4e-3
    out = mla_attention(*args, impl="gluon")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_attention(*args, impl="gluon")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_dispatch_rules() -> None:
    """On tensors it cannot run (CPU here, or a non-512 + 64 latent) ``impl="gluon"`` is a clear
    error; an unknown ``impl`` too; ``None`` falls back silently."""
    args = _problem(16, [4], [40], device="cpu", dtype=torch.float32)
    assert not mla_gluon.supported(args[0], args[1], args[2])
    with pytest.raises(ValueError, match="impl='gluon' needs"):
        mla_attention(*args, impl="gluon")
    with pytest.raises(ValueError, match="impl must be"):
        mla_attention(*args, impl="cuda")
    mla_attention(*args)  # impl=None where the Gluon kernel cannot run: no error (here the torch path)
    with pytest.raises(ValueError, match="num_splits must be"):
        mla_gluon.sparse_plan(4, 128, 2048, 132, num_splits=0)
    with pytest.raises(ValueError, match="num_splits must be"):
        mla_gluon.dense_plan(4, 1, 16, 8192, 132, num_splits=0)
    if ON_HOPPER:  # Triton-kernel tuning with the Gluon kernel is a clear error, not ignored
        gpu = _problem(16, [4], [40])
        with pytest.raises(ValueError, match="takes none of them"):
            mla_attention(*gpu, impl="gluon", num_warps=4)


def test_dense_plan() -> None:
    """One wave of 64-pair programs: 16 x 1 pads one row block (2 splits at 64 x 8,192 on 132 SMs,
    not the Triton kernel's 16 for its 16-row programs), 128 x 4 has 8 row blocks (1 split), short
    contexts cap the splits at one per 256 keys, a given count is kept."""
    assert mla_gluon.dense_plan(64, 1, 16, 8192, 132) == dict(row_blocks=1, num_splits=2)
    assert mla_gluon.dense_plan(64, 4, 16, 8192, 132) == dict(row_blocks=1, num_splits=2)
    assert mla_gluon.dense_plan(64, 4, 128, 8192, 132) == dict(row_blocks=8, num_splits=1)
    assert mla_gluon.dense_plan(1, 1, 128, 600, 132) == dict(row_blocks=2, num_splits=3)
    assert mla_gluon.dense_plan(1, 1, 128, 600, 132, num_splits=5) == dict(row_blocks=2, num_splits=5)


_COMPILE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
import triton
from mtpspec.ops import mla_gluon as m
if not m.HAS_GLUON:
    print(json.dumps({"skip": "Triton without Gluon's Hopper API"}))
    sys.exit(0)
from triton.experimental.gluon._runtime import GluonASTSource
lay = m.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
desc = lambda shape: "tensordesc<bf16[%d, %d],%r>" % (shape[0], shape[1], lay)
sig = dict(ql_ptr="*bf16", qp_ptr="*bf16", k0_desc=desc([m.BLOCK_N, m.HALF]), k1_desc=desc([m.BLOCK_N, m.HALF]),
           kr_desc=desc([m.BLOCK_N, m.ROPE]), kv_ptr="*bf16", out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32",
           qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32", qk_scale="fp32", num_splits="i32")
for n in "stride_qlt stride_qlh stride_qpt stride_qph stride_ot stride_oh stride_bt stride_pt stride_ph".split():
    sig[n] = "i32"
out = []
for fn, heads, split, variant in ((m._mla_ws_kernel, 16, True, False), (m._mla_ws_kernel, 128, False, False),
                                  (m._mla_ws_kernel, 16, True, True), (m._mla_ws_kernel, 128, False, True),
                                  (m._mla_seesaw_kernel, 16, True, False), (m._mla_seesaw_kernel, 128, False, False),
                                  (m._mla_seesaw_kernel, 16, True, True), (m._mla_seesaw_kernel, 128, False, True)):
    cx = dict(NUM_HEADS=heads, CACHE_BLOCK=64, SPLIT=split, BLOCK_M=m.BLOCK_M, BLOCK_N=m.BLOCK_N, HALF=m.HALF,
              LORA=m.LORA, ROPE=m.ROPE)
    if fn is m._mla_ws_kernel:
        cx.update(STAGES=m.STAGES, P_BUFS=m.P_BUFS, WG1_REGS=m.WG1_REGS, PRODUCER_REGS=m.PRODUCER_REGS, PV_LAG=variant,
                  L2_AHEAD=2)
    else:
        cx.update(WG1_REGS=m.SEESAW_WG1_REGS, ONE_RESCALE=variant)
    full = {k: sig.get(k, "constexpr") for k in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in full.items() if v.startswith("*")}
    ck = triton.compile(GluonASTSource(fn, full, cx, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4))
    ptx = ck.asm["ptx"]
    out.append(dict(shared=ck.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                    bulk=ptx.count("cp.async.bulk.tensor"), setmaxnreg=ptx.count("setmaxnreg"),
                    prefetch=ptx.count("cp.async.bulk.prefetch.L2") if fn is m._mla_ws_kernel else None))
fn = m._sparse_mla_ws_kernel  # gathers: 16-byte cp.async (the launch specialises the 16-divisible strides)
sig = dict(ql_ptr="*bf16", qp_ptr="*bf16", kv_ptr="*bf16", slots_ptr="*i32", out_ptr="*bf16", part_acc_ptr="*fp32",
           part_ml_ptr="*fp32", qk_scale="fp32", num_topk="i32", n_slots="i32", num_splits="i32")
div = "stride_qlt stride_qlh stride_qpt stride_qph stride_kb stride_ks stride_ot stride_oh".split()
for n in div + "stride_st stride_pt stride_ph".split():
    sig[n] = "i32"
cx = dict(NUM_HEADS=128, CACHE_BLOCK=64, SPLIT=True, BLOCK_M=m.BLOCK_M, BLOCK_N=m.SPARSE_BLOCK_N,
          STAGES=m.SPARSE_STAGES, P_BUFS=m.SPARSE_P_BUFS, HALF=m.HALF, LORA=m.LORA, ROPE=m.ROPE,
          WG1_REGS=m.SPARSE_WG1_REGS, PRODUCER_REGS=m.SPARSE_PRODUCER_REGS, AHEAD=m.SPARSE_AHEAD)
full = {k: sig.get(k, "constexpr") for k in fn.arg_names}
attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in full.items() if v.startswith("*") or k in div}
ck = triton.compile(GluonASTSource(fn, full, cx, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = ck.asm["ptx"]
out.append(dict(shared=ck.metadata.shared, wgmma=ptx.count("wgmma.mma_async"), bulk=ptx.count("cp.async.cg"),
                setmaxnreg=ptx.count("setmaxnreg")))
print(json.dumps(out))
"""


def test_gluon_kernel_compiles_for_hopper() -> None:
    """Ahead-of-time sm_90 compile (a child process, Triton imported without its interpreter) of
    the dense schedules (split, split-pv, seesaw, seesaw-r1; split and split-pv with their L2 prefetch 2 tiles ahead)
    at 16 heads (split) and 128 heads (one split) and the sparse kernel at 128 heads:
    each fits an sm_90 program's 227 KB of shared memory, and its code has the copies (bulk tensor
    copies dense, 16-byte ``cp.async`` gathers sparse), warpgroup MMAs and per-partition register
    counts the design depends on."""
    env = repo_env()
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(reports, dict):  # this process imports Triton for its interpreter: Gluon checked in the child
        pytest.skip(reports["skip"])
    for rep in reports:
        assert rep["shared"] <= 227 * 1024, rep
        assert rep["bulk"] >= 3 and rep["wgmma"] >= 4 and rep["setmaxnreg"] >= 2, rep
        assert rep.get("prefetch") is None or rep["prefetch"] >= 2, rep  # dense, L2_AHEAD 2: tile 0's two, the loop's


def _sparse_problem(heads, tokens, topk, seed=0, block_size=64, nblocks=40, device="cuda"):
    """A latent cache with NaN in every slot no row selects; per token row ``topk`` distinct
    selected slots with unused entries (-1, and ids past the cache) at the end and in between."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = nblocks * block_size
    cache = torch.full((nblocks, block_size, 576), float("nan"), dtype=torch.bfloat16)
    slots = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t in range(tokens):
        valid = int(torch.randint(1, topk + 1, (1,), generator=g)) if t else topk  # row 0: every entry used
        slots[t, :valid] = torch.randperm(n, generator=g)[:valid].to(torch.int32)
        if valid > 3:
            slots[t, 1] = -1
            slots[t, 2] = n + 5  # past the cache: unused too
    used = slots[(slots >= 0) & (slots < n)].long().unique()
    cache.view(-1, 576)[used] = (torch.randn(len(used), 576, generator=g) * 0.5).to(torch.bfloat16)
    q_latent = (torch.randn(tokens, heads, 512, generator=g) * 0.3).to(torch.bfloat16)
    q_pe = (torch.randn(tokens, heads, 64, generator=g) * 0.3).to(torch.bfloat16)
    return q_latent.to(device), q_pe.to(device), cache.to(device), slots.to(device), (128 + 64) ** -0.5


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
@pytest.mark.parametrize("heads,tokens,topk", [(128, 3, 300), (64, 2, 2048), (16, 4, 100), (128, 1, 64)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_gluon_sparse_kernel_matches_reference(heads, tokens, topk, num_splits) -> None:
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_ref
    args = _sparse_problem(heads, tokens, topk)
    got = sparse_mla_attention(*args, num_splits=num_splits, impl="gluon").float()
    ref = sparse_mla_attention_ref(*args).float()
    tri = sparse_mla_attention(*args, num_splits=num_splits, impl="triton").float()
    assert torch.isfinite(got).all()
    err, tri_err = (got - ref).abs().max().item(), (tri - ref).abs().max().item()
    assert err <= max(2 * tri_err, 4e-3), (err, tri_err)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
@pytest.mark.parametrize("stages,ahead", [(4, 2), (4, 3), (3, 2), (2, 1), (4, 0), (2, 0), (1, 0)])
def test_gluon_sparse_gathers_further_ahead(stages, ahead) -> None:
    """The gathering producer in both completion modes (``ahead`` 0: the copies arrive on the tile's
    barrier themselves; ``ahead`` >= 1: the producer waits ``ahead`` tiles behind) and ring sizes 1-4:
    same result as the torch reference, no hang."""
    from mtpspec.ops.paged_attention import combine_splits
    from mtpspec.ops.paged_common import split_outputs
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention_ref
    ql, qp, cache, slots, scale = _sparse_problem(128, 3, 700)
    for splits in (1, 2):
        out, pa, pm = split_outputs(ql, splits, 512)
        shape = dict(block_n=32, p_bufs=2) if stages > 2 else {}  # 3-4 slots of 64-key tiles overflow smem
        mla_gluon.launch_sparse(ql, qp, cache, slots, out, pa, pm, scale * 1.4426950408889634, 2, splits,
                                stages=stages, ahead=ahead, **shape)
        if splits > 1:
            combine_splits(out, pa, pm, torch.full((1,), 3, dtype=torch.int32, device="cuda"), 0, splits, 512, 512,
                           False)
        ref = sparse_mla_attention_ref(ql, qp, cache, slots, scale).float()
        assert (out.float() - ref).abs().max().item() < 4e-3


def test_dense_launch_rejects_unknown_schedules_and_split_pv_shapes() -> None:
    """Checked before any launch: an unknown schedule names the five; ``split-pv`` (two key slots,
    one P buffer by design: its left halves are released one tile late) refuses other shapes."""
    x = torch.zeros(1, 1, 1)
    with pytest.raises(ValueError, match="'auto', 'split', 'split-pv', 'seesaw' or 'seesaw-r1'"):
        mla_gluon.launch(x, x, x, x, x, x, x, x, x, 1.0, 1, 1, schedule="pv")
    for stages, p_bufs, schedule in ((3, 1, "split-pv"), (2, 2, "split-pv")):
        with pytest.raises(ValueError, match="2 stages and 1 P buffer"):
            mla_gluon.launch(x, x, x, x, x, x, x, x, x, 1.0, 1, 1, stages=stages, p_bufs=p_bufs, schedule=schedule)
    with pytest.raises(ValueError, match=r"l2_ahead must be >= 0 \(key tiles\), got -1"):
        mla_gluon.launch(x, x, x, x, x, x, x, x, x, 1.0, 1, 1, l2_ahead=-1)


def test_dense_schedule_auto() -> None:
    """``"auto"``: split-pv from PV_ROW_BLOCKS row blocks a sequence (128 heads x 2 and 4 query rows,
    the compute-bound shapes), split below (16 heads; 128 heads x 1) and for launch shapes split-pv
    cannot take; a named schedule is kept."""
    plan = mla_gluon.dense_plan
    assert mla_gluon.PV_ROW_BLOCKS == 4
    assert mla_gluon.dense_schedule(plan(64, 4, 128, 8192, 132)["row_blocks"]) == "split-pv"
    assert mla_gluon.dense_schedule(plan(64, 2, 128, 8192, 132)["row_blocks"]) == "split-pv"
    assert mla_gluon.dense_schedule(plan(64, 1, 128, 8192, 132)["row_blocks"]) == "split"
    assert mla_gluon.dense_schedule(plan(64, 4, 16, 8192, 132)["row_blocks"]) == "split"
    assert mla_gluon.dense_schedule(8, pv_shape=False) == "split"
    for named in ("split", "seesaw", "seesaw-r1", "split-pv"):
        assert mla_gluon.dense_schedule(8, named) == named and mla_gluon.dense_schedule(1, named) == named


def test_sparse_launch_rejects_a_producer_that_would_hang() -> None:
    """``ahead`` must leave a slot to refill: ``0 <= ahead <= stages - 1`` (checked before any launch)."""
    x = torch.zeros(1, 1, 1)
    for stages, ahead in ((1, 1), (4, -1), (4, 4)):
        with pytest.raises(ValueError, match="0 <= ahead <= stages - 1"):
            mla_gluon.launch_sparse(x, x, x, x, x, x, x, 1.0, 1, 1, stages=stages, ahead=ahead)


def test_sparse_dispatch_rules() -> None:
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention
    args = _sparse_problem(16, 2, 20, nblocks=2, device="cpu")
    args = (args[0].float(), args[1].float(), torch.nan_to_num(args[2].float()), args[3], args[4])
    assert not mla_gluon.sparse_supported(*args[:4])
    with pytest.raises(ValueError, match="impl='gluon' needs"):
        sparse_mla_attention(*args, impl="gluon")
    with pytest.raises(ValueError, match="impl must be"):
        sparse_mla_attention(*args, impl="tma")
    sparse_mla_attention(*args)  # impl=None where the Gluon kernel cannot run: no error (here the torch path)


def test_resolve_impl(monkeypatch) -> None:
    """The one rule both ops follow: ``None`` picks the Gluon kernel only where it can run, no
    Triton tuning is given and ``MTPSPEC_MLA_GLUON`` is not ``0``; ``"triton"`` always wins;
    ``"gluon"`` where it cannot run, or with tuning, is an error naming what it needs."""
    r = mla_gluon.resolve_impl
    monkeypatch.setattr(mla_gluon, "USE_GLUON", True)
    assert r("op", None, True, False, "x") == "auto"
    assert r("op", None, False, False, "x") == "triton"
    assert r("op", None, True, True, "x") == "triton"
    assert r("op", "triton", True, False, "x") == "triton"
    assert r("op", "gluon", True, False, "x") == "gluon"
    with pytest.raises(ValueError, match="op: impl='gluon' needs .* and a 64-block cache"):
        r("op", "gluon", False, False, "a 64-block cache")
    with pytest.raises(ValueError, match="takes none of them"):
        r("op", "gluon", True, True, "x")
    monkeypatch.setattr(mla_gluon, "USE_GLUON", False)
    assert r("op", None, True, False, "x") == "triton" and r("op", "gluon", True, False, "x") == "gluon"


# ---------------------------------------------------------------- keys as M (few heads): mla_gluon_km

_COMPILE_KM = r"""
import json, sys
from triton.backends.compiler import GPUTarget
import triton
from mtpspec.ops import mla_gluon_km as k
if not k.mg.HAS_GLUON:
    print(json.dumps({"skip": "Triton without Gluon's Hopper API"}))
    sys.exit(0)
from triton.experimental.gluon._runtime import GluonASTSource
fn = k._sparse_km_kernel
sig = dict(ql_ptr="*bf16", qp_ptr="*bf16", kv_ptr="*bf16", slots_ptr="*i32", out_ptr="*bf16", part_acc_ptr="*fp32",
           part_ml_ptr="*fp32", qk_scale="fp32", num_topk="i32", n_slots="i32", num_splits="i32")
div = "stride_qlt stride_qlh stride_qpt stride_qph stride_kb stride_ks stride_ot stride_oh".split()
for n in div + "stride_st stride_pt stride_ph".split():
    sig[n] = "i32"
out = []
for heads, split in ((16, True), (32, False), (8, True)):
    cx = dict(NUM_HEADS=heads, NH=k.padded_heads(heads), CACHE_BLOCK=64, SPLIT=split, BLOCK_N=k.KM_BLOCK_N,
              STAGES=k.KM_STAGES, HALF=k.mg.HALF, LORA=k.mg.LORA, ROPE=k.mg.ROPE, PRODUCER_REGS=k.KM_PRODUCER_REGS)
    full = {n: sig.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, v in full.items()
             if v.startswith("*") or n in div}
    ck = triton.compile(GluonASTSource(fn, full, cx, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4))
    ptx = ck.asm["ptx"]
    out.append(dict(heads=heads, shared=ck.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                    n16=ptx.count("m64n16k16"), n32=ptx.count("m64n32k16"), gathers=ptx.count("cp.async.cg"),
                    setmaxnreg=ptx.count("setmaxnreg")))
print(json.dumps(out))
"""


def test_gluon_km_kernel_compiles_for_hopper() -> None:
    """Ahead-of-time sm_90 compile of the keys-as-M sparse kernel at 16 heads (split), 32 (one split)
    and 8 (padded to 16): within an sm_90 program's 227 KB of shared memory; per key tile 36 score
    MMAs (576 / 16 k-steps) and 32 value MMAs (512 / 64 row blocks x 64 / 16 k-steps), all of shape
    m64 n{heads padded} k16 (the heads on N: the point of the layout); 16-byte gathers; register
    reallocation between the partitions."""
    env = repo_env()
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_KM], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(reports, dict):
        pytest.skip(reports["skip"])
    for rep in reports:
        n_key = "n32" if rep["heads"] > 16 else "n16"
        assert rep["shared"] <= 227 * 1024, rep
        assert rep["wgmma"] == 68 and rep[n_key] == 68, rep
        assert rep["gathers"] >= 3 and rep["setmaxnreg"] >= 2, rep


def test_km_plan_padding_and_dispatch_rules() -> None:
    """Heads pad to a power of two >= 16 (the MMA's N), at most KM_MAX_HEADS; one head block's plan
    (one wave of programs) by default; ``impl="gluon-km"`` with too many heads, or where Gluon cannot run, is an error
    naming what it needs; an unknown impl names the four."""
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention
    assert [mla_gluon_km.padded_heads(h) for h in (1, 8, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert mla_gluon_km.KM_MAX_HEADS == 32
    assert mla_gluon_km.km_supported(32) == mla_gluon.HAS_GLUON and not mla_gluon_km.km_supported(33)
    assert mla_gluon.sparse_plan(64, 1, 2048, 132)["num_splits"] == 2
    assert mla_gluon.sparse_plan(256, 1, 2048, 132)["num_splits"] == 1
    assert mla_gluon.sparse_plan(1, 1, 300, 132)["num_splits"] == 2  # ceil(300 / 256)
    assert mla_gluon.sparse_plan(64, 1, 2048, 132, num_splits=5)["num_splits"] == 5
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        mla_gluon.sparse_plan(64, 1, 2048, 132, num_splits=0)
    x = torch.zeros(1, 1, 1)
    with pytest.raises(ValueError, match="1 to 32 heads, got 64"):
        mla_gluon_km.launch_sparse_km(torch.zeros(2, 64, 512), x, x, x, x, x, x, 1.0, 1)
    with pytest.raises(ValueError, match="stages 1 or 2"):
        mla_gluon_km.launch_sparse_km(torch.zeros(2, 16, 512), x, x, x, x, x, x, 1.0, 1, stages=3)
    big = _sparse_problem(64, 1, 8, nblocks=1, device="cpu")
    with pytest.raises(ValueError, match="impl='gluon-km' takes 1 to 32 heads, got 64"):
        sparse_mla_attention(*big, impl="gluon-km")
    args = _sparse_problem(16, 2, 20, nblocks=2, device="cpu")
    args = (args[0].float(), args[1].float(), torch.nan_to_num(args[2].float()), args[3], args[4])
    with pytest.raises(ValueError, match="impl='gluon-km' needs what impl='gluon' does: a compute-capability-9"):
        sparse_mla_attention(*args, impl="gluon-km")
    with pytest.raises(ValueError, match="'triton', 'gluon' or 'gluon-km'"):
        sparse_mla_attention(*args, impl="km")


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
@pytest.mark.parametrize("heads,tokens,topk", [(16, 4, 100), (16, 3, 700), (32, 2, 2048), (8, 3, 300), (1, 2, 64),
                                               (20, 2, 130)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_gluon_km_matches_reference(heads, tokens, topk, num_splits) -> None:
    """The keys-as-M kernel against the torch reference (and as close as the heads-as-M Gluon
    kernel): unused entries (-1, past the cache) anywhere in a row, NaN in every unselected cache
    slot, a row with one valid entry, splits with no valid entry, head counts padded to 16 / 32."""
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_ref
    args = _sparse_problem(heads, tokens, topk)
    got = sparse_mla_attention(*args, num_splits=num_splits, impl="gluon-km").float()
    ref = sparse_mla_attention_ref(*args).float()
    other = sparse_mla_attention(*args, num_splits=num_splits, impl="gluon").float()
    assert torch.isfinite(got).all()
    err, other_err = (got - ref).abs().max().item(), (other - ref).abs().max().item()
    assert err <= max(2 * other_err, 4e-3), (err, other_err)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a compute-capability-9 GPU and Triton's Gluon")
def test_gluon_km_in_a_cuda_graph_and_by_default(monkeypatch) -> None:
    """Captured in a CUDA graph and replayed on new inputs (the slots and queries read on the
    device); ``MTPSPEC_MLA_SPARSE_KM`` (USE_KM) makes ``impl=None`` take it at <= 32 heads only."""
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_ref
    ql, qp, cache, slots, scale = _sparse_problem(16, 64, 512)
    ql2, qp2, cache2, slots2, _ = _sparse_problem(16, 64, 512, seed=1)
    cache.copy_(torch.where(torch.isnan(cache), cache2, cache))  # NaN only where neither draw selects
    out = sparse_mla_attention(ql, qp, cache, slots, scale, impl="gluon-km")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sparse_mla_attention(ql, qp, cache, slots, scale, impl="gluon-km")
    ql.copy_(ql2), qp.copy_(qp2), slots.copy_(slots2)
    g.replay()
    torch.cuda.synchronize()
    ref = sparse_mla_attention_ref(ql, qp, cache, slots, scale).float()
    assert (out.float() - ref).abs().max().item() < 4e-3
    launched = []
    monkeypatch.setattr(mla_gluon_km, "USE_KM", True)
    monkeypatch.setattr(mla_gluon_km, "launch_sparse_km", lambda *a, **k: launched.append("km"))
    monkeypatch.setattr(mla_gluon, "launch_sparse", lambda *a, **k: launched.append("heads"))
    sparse_mla_attention(ql, qp, cache, slots, scale)
    big = _sparse_problem(64, 2, 100)
    sparse_mla_attention(*big)
    assert launched == ["km", "heads"]
