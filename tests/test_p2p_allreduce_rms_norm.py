"""P2PAllReduceRMSNorm: the one-shot peer-memory kernel (Triton interpreter, spawned CPU ranks).

Every multi-rank check runs inside one launch per tp size (2, 3, 4). References, recomputed in
the parent from the seed: the fp32 sum in rank order rounded once (the kernel's contract: equal
bit for bit), a float64 reference (within dtype rounding), and the exact NCCL-style fallback run
by the ranks themselves (gloo all-reduce + fused_add_rms_norm; within two roundings).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from test_engine_fixtures import repo_env

from mtpspec.distributed import get_tensor_model_parallel_rank, launch
from mtpspec.distributed.peer_memory import allocate_peer_buffers
from mtpspec.distributed.allreduce_rms_norm import (NcclAllReduceThenAddRMSNorm, backend_usage,
                                            fused_allreduce_rms_norm,
                                            register_allreduce_rms_norm_backend, select_backend,
                                            unregister_allreduce_rms_norm_backend)
from mtpspec.distributed.p2p_allreduce_rms_norm import P2PAllReduceRMSNorm, PeerTimeoutError
from mtpspec.ops.rms_norm import rms_norm_ref

EPS = 1e-5
CAP_TOKENS = 16
#: One slot holds 16 tokens of hidden 36 in fp32, or of hidden 72 in bf16 / fp16.
CAP_BYTES = CAP_TOKENS * 36 * 4
HIDDEN = {torch.float32: 36, torch.bfloat16: 72, torch.float16: 72}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Spacing of representable numbers at 1 (one unit in the last place, relative).
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
P2P = P2PAllReduceRMSNorm.name
FALLBACK = NcclAllReduceThenAddRMSNorm.name
#: Every B * (1 + k) for B <= 16, k <= 5.
SPEC_COUNTS = sorted({b * (1 + k) for b in range(1, 17) for k in range(1, 6)})


class _Norm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps


# ------------------------------------------------------------------------------------------
# Inputs and references (shared by the ranks and the parent)
# ------------------------------------------------------------------------------------------

def _inputs(seed: int, tp: int, n: int, dtype: torch.dtype, hidden: Optional[int] = None):
    """Every rank's partial sums ``[tp, n, hidden]``, a residual ``[n, hidden]`` (10x larger, as
    in a deep residual stream) and a weight, all in ``dtype``; ``hidden`` defaults to ``HIDDEN``'s."""
    hidden = hidden or HIDDEN[dtype]
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(tp, n, hidden, generator=g, dtype=torch.float64) * 3
    residual = torch.randn(n, hidden, generator=g, dtype=torch.float64) * 10
    weight = torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5
    return parts.to(dtype), residual.to(dtype), weight.to(dtype)


def _cases(seed: int, tp: int) -> List[Tuple[str, int, str, bool, int]]:
    """(tag, n, dtype name, with residual, input seed) in call order; identical on every rank."""
    cases = []
    for name in ("fp32", "bf16"):
        # Every count 0 .. capacity + 8 (which holds every B * (1 + k) that fits, and crosses
        # the limit into the fallback) for fp32 at tp 2 / 3 and bf16 at tp 2 / 4; otherwise the
        # counts around the limit (interpreter time).
        full = tp == 2 or (tp == 3) == (name == "fp32")
        counts = range(0, CAP_TOKENS + 9) if full else [1, 2, CAP_TOKENS - 1, CAP_TOKENS,
                                                        CAP_TOKENS + 1, CAP_TOKENS + 8]
        for n in counts:
            cases.append(("sweep", n, name, n % 4 != 1, seed + 1000 * n + len(name)))
    rng = random.Random(seed)
    for i in rng.sample(range(len(cases)), 6):
        cases.append(("repeat",) + cases[i][1:])
    for i in range(12):
        n = rng.choice([rng.randint(1, CAP_TOKENS), rng.randint(1, CAP_TOKENS + 4), 1, 2, 4])
        cases.append(("stress", n, rng.choice(list(DTYPES)), rng.random() < 0.7, seed + 7 + i))
    return cases


def _exact(parts: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor):
    """The kernel's contract: fp32 sum in rank order 0..tp-1, plus the residual, rounded once;
    RMSNorm (fp32 statistics) of the rounded sum."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    if residual is not None:
        acc = acc + residual.float()
    s = acc.to(parts.dtype)
    return rms_norm_ref(s, weight, EPS), s


def _check_float64(y: torch.Tensor, s: torch.Tensor, parts, residual, weight, roundings: int):
    """``s`` and ``y`` within ``roundings`` roundings to the dtype of the float64 result (error
    scaled by the magnitudes that were summed, so cancellation is allowed for)."""
    u = ULP[parts.dtype]
    terms = parts.double().abs().sum(0) + (residual.double().abs() if residual is not None else 0)
    s64 = parts.double().sum(0) + (residual.double() if residual is not None else 0)
    bound_s = roundings * u * (s64.abs() + terms) + 1e-30
    assert ((s.double() - s64).abs() <= bound_s).all(), (s.double() - s64).abs().max()
    rstd = torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    y64 = s64 * rstd * weight.double()
    bound_y = (roundings + 2) * u * (y64.abs() + rstd * weight.double().abs() * terms) + 1e-30
    assert ((y.double() - y64).abs() <= bound_y).all(), (y.double() - y64).abs().max()


# ------------------------------------------------------------------------------------------
# Rank side
# ------------------------------------------------------------------------------------------

def _rank_main(tp: int, seed: int, absent: int) -> Dict[str, object]:
    rank = get_tensor_model_parallel_rank()
    out: Dict[str, object] = {}
    # Peer memory by itself: every rank stores through its mapping of every peer's buffer.
    pb = allocate_peer_buffers(4096)
    for peer, buf in enumerate(pb.buffers):
        buf[64 * rank:64 * (rank + 1)] = rank + 1
    dist.barrier()
    own = pb.buffers[rank][:64 * tp].view(tp, 64)
    out["peer_memory"] = (pb.kind, own.clone(), [os.path.exists(f) for f in pb.files])
    pb.close()

    backend = P2PAllReduceRMSNorm(CAP_BYTES, num_buffers=3 if tp == 3 else 2)
    out["max_bytes"] = backend.max_bytes
    register_allreduce_rms_norm_backend(backend)
    rows = []
    sleep_rng = random.Random(seed * 31 + rank)
    try:
        fallback = NcclAllReduceThenAddRMSNorm()
        for tag, n, name, use_res, s in _cases(seed, tp):
            parts, residual, weight = _inputs(s, tp, n, DTYPES[name])
            res = residual if use_res else None
            if tag == "stress" and sleep_rng.random() < 0.3:
                time.sleep(sleep_rng.random() * 0.03)  # ranks arrive in varying orders
            h = parts[rank].clone()
            used = select_backend(h).name
            before = backend.calls
            y, new_res = fused_allreduce_rms_norm(h, res, _Norm(weight, EPS))
            assert backend.calls == before + (used == P2P and n > 0)
            ref = None
            if tag == "sweep" and used == P2P and n % 2:
                ref = fallback(parts[rank].clone(), res, weight, EPS)
            rows.append((tag, n, name, use_res, s, used, y, new_res, ref))
    finally:
        unregister_allreduce_rms_norm_backend(backend)
    out["rows"] = rows
    out["usage"] = backend_usage()
    out["state"] = backend._state.clone()

    # Several programs per launch looping over row blocks (2 programs, 2 rows each), and the
    # two-pass path for rows longer than the register limit (16 columns per pass).
    extra = []
    multi = P2PAllReduceRMSNorm(CAP_BYTES, max_programs=2, max_block_rows=2)
    two_pass = P2PAllReduceRMSNorm(CAP_BYTES, max_fused_hidden=16)
    # Rows that are not whole 16-byte vectors (hidden 7, 37, 65: the masked tail of every row).
    odd = P2PAllReduceRMSNorm(CAP_BYTES)
    for be, n, name, use_res, hidden in [(multi, 7, "fp32", True, None), (multi, 4, "bf16", False, None),
                                         (two_pass, 2, "bf16", True, None), (two_pass, 1, "fp16", False, None),
                                         (odd, 9, "fp32", True, 7), (odd, 4, "fp32", False, 65),
                                         (odd, 9, "bf16", True, 37), (two_pass, 3, "bf16", False, 37)]:
        s = seed + 99 + n
        parts, residual, weight = _inputs(s, tp, n, DTYPES[name], hidden)
        y, new_res = be(parts[rank].clone(), residual if use_res else None, weight, EPS)
        extra.append((n, name, use_res, s, hidden, y, new_res))
    out["extra"] = extra
    out["guards"] = [b.guards_intact() for b in (backend, multi, two_pass, odd)]

    # A peer that never arrives: the others give up after a bounded spin, with a clear error.
    lonely = P2PAllReduceRMSNorm(CAP_BYTES, max_spins=1000)
    dist.barrier()
    timeout = None
    if rank != absent:
        parts, residual, weight = _inputs(seed + 5, tp, 3, torch.float32)
        errors = []
        for i in range(2):
            if i == 1:  # as if launched before the host saw the error (CUDA graph replays)
                lonely._err[0] = 0
            t0 = time.monotonic()
            try:
                lonely(parts[rank].clone(), residual, weight, EPS)
                errors.append(None)
            except PeerTimeoutError as exc:
                errors.append((str(exc), time.monotonic() - t0, exc.outputs))
        timeout = errors
    dist.barrier()
    flags = lonely.peers.buffers[rank][lonely.flag_offset:].view(torch.int64)
    out["timeout"] = (timeout, flags.view(lonely.num_buffers, tp, lonely.max_programs)[:, :, 0].clone(),
                      lonely._state.clone())

    # Ranks that disagree on the shape of a call: an error naming the cause, not mixed rows.
    mismatch = P2PAllReduceRMSNorm(CAP_BYTES, max_spins=300)
    n = 3 if rank == 0 else 4
    parts, residual, weight = _inputs(seed + 6, tp, n, torch.float32)
    dist.barrier()
    try:
        mismatch(parts[rank].clone(), residual, weight, EPS)
        out["mismatch"] = None
    except PeerTimeoutError as exc:
        out["mismatch"] = str(exc)
    return out


# ------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 3, 4])
def test_p2p_allreduce_rms_norm_ranks(interp, tp):
    seed = int(torch.randint(0, 2 ** 20, ()).item())
    absent = tp - 1
    results = launch(_rank_main, tp, tp, seed, absent, timeout_s=600)
    cases = _cases(seed, tp)

    # Peer memory: every rank's marker arrived in every buffer; no shared-memory file is left.
    for rank, res in enumerate(results):
        kind, own, exists = res["peer_memory"]
        assert kind == "shm" and not any(exists)
        assert torch.equal(own, torch.arange(1, tp + 1, dtype=torch.uint8)[:, None].expand(tp, 64))

    first: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
    counts = {P2P: 0, FALLBACK: 0}  # calls served
    launches = 0  # kernel launches (a 0-token call launches nothing)
    for i, (tag, n, name, use_res, s) in enumerate(cases):
        dtype = DTYPES[name]
        parts, residual, weight = _inputs(s, tp, n, dtype)
        res = residual if use_res else None
        row0 = results[0]["rows"][i]
        assert row0[:5] == (tag, n, name, use_res, s)
        fits = n * HIDDEN[dtype] * parts.element_size() <= CAP_BYTES
        used, y, new_res = row0[5], row0[6], row0[7]
        # The size limit is bytes = tokens * hidden * element size against the slot capacity.
        assert used == (P2P if fits else FALLBACK), (n, name, used)
        counts[used] += 1
        launches += used == P2P and n > 0
        assert y.shape == (n, HIDDEN[dtype]) and y.dtype == dtype and new_res.dtype == dtype
        _check_float64(y, new_res, parts, res, weight, roundings=2 if used == FALLBACK else 1)
        if used == P2P:
            y_ref, s_ref = _exact(parts, res, weight)
            assert torch.equal(new_res, s_ref), (tag, n, name)
            torch.testing.assert_close(y, y_ref, rtol=ULP[dtype], atol=1e-6)
            for other in results[1:]:  # bit-identical on every rank
                assert torch.equal(other["rows"][i][6], y) and torch.equal(other["rows"][i][7], new_res)
        if row0[8] is not None:  # the exact fallback, run by the ranks on the same inputs
            y_fb, s_fb = row0[8]
            u = ULP[dtype]
            mag = parts.double().abs().sum(0) + (residual.double().abs() if use_res else 0)
            assert ((new_res.double() - s_fb.double()).abs() <= 3 * u * mag + 1e-30).all()
            assert ((y.double() - y_fb.double()).abs() <= 4 * u * (y_fb.double().abs() + mag)).all()
        key = (n, name, use_res, s)
        if tag == "repeat":  # bit-identical across repeated runs
            assert torch.equal(y, first[key][0]) and torch.equal(new_res, first[key][1])
        else:
            first.setdefault(key, (y, new_res))
    assert counts[P2P] > 20 and counts[FALLBACK] > 8
    swept = {(n, name) for tag, n, name, _, _ in cases if tag == "sweep"}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if (name, tp) in (("fp32", 2), ("fp32", 3), ("bf16", 2), ("bf16", 4)):
            assert {(n, name) for n in SPEC_COUNTS if n <= CAP_TOKENS + 8} <= swept
    for res in results:
        assert res["max_bytes"] == CAP_BYTES
        assert res["usage"].get(P2P) == counts[P2P]
        assert res["state"][0].item() == launches, "one epoch per launch, none for 0 tokens"
        assert res["guards"] == [True, True, True, True], "a rank wrote past a slot"

    # Multi-program and two-pass launches, and rows of odd widths.
    for i, (n, name, use_res, s, hidden, y, new_res) in enumerate(results[0]["extra"]):
        parts, residual, weight = _inputs(s, tp, n, DTYPES[name], hidden)
        y_ref, s_ref = _exact(parts, residual if use_res else None, weight)
        assert torch.equal(new_res, s_ref), (n, name, hidden)
        torch.testing.assert_close(y, y_ref, rtol=ULP[DTYPES[name]], atol=1e-6)
        for other in results[1:]:
            assert torch.equal(other["extra"][i][5], y) and torch.equal(other["extra"][i][6], new_res)

    # The absent peer: every other rank raised PeerTimeoutError naming it, with NaN outputs;
    # the second call failed at once (sticky) and pushed nothing.
    for rank, res in enumerate(results):
        errors, flags, state = res["timeout"]
        if rank == absent:
            assert errors is None
            # Present ranks signalled epoch 1 (buffer 1) and nothing for epoch 2 (buffer 0).
            present = [r for r in range(tp) if r != absent]
            tag_bits = 20
            assert (flags[1, present] >> tag_bits).tolist() == [1] * len(present)
            assert ((flags[0] >> tag_bits) != 2).all() and flags[1, absent].item() == 0
            continue
        assert state[2].item() == 1, "failure must be sticky"
        for msg, elapsed, outputs in errors:
            assert f"waiting for rank {absent}" in msg and "rebuild the backend" in msg
            assert outputs is not None and all(t.isnan().all() for t in outputs)
        assert "at call 1 " in errors[0][0] and "at call 1 " in errors[1][0]
        assert "its last signal here was for call 0" in errors[0][0]
    for rank, res in enumerate(results):
        assert res["mismatch"] is not None and "different shape or dtype" in res["mismatch"]


def test_single_rank_kernel_paths(interp):
    """tp 1 (one process, local buffer): every dtype, strided rows, residual None, one- and
    two-pass rows, several programs; equals the rank-order reference bit for bit."""
    one = P2PAllReduceRMSNorm(CAP_BYTES)
    multi = P2PAllReduceRMSNorm(CAP_BYTES, max_programs=3, max_block_rows=1, max_fused_hidden=32)
    for be in (one, multi):
        for name, dtype in DTYPES.items():
            for n, use_res in [(1, True), (5, False), (CAP_TOKENS, True)]:
                if be is multi and n == CAP_TOKENS:
                    continue  # interpreter time
                parts, residual, weight = _inputs(n * 7 + len(name), 1, n, dtype)
                wide = torch.zeros(n, HIDDEN[dtype] + 8, dtype=dtype)
                wide[:, 3:3 + HIDDEN[dtype]] = parts[0]
                x = wide[:, 3:3 + HIDDEN[dtype]]  # row stride != hidden
                res = residual if use_res else None
                y, s = be(x, res, weight, EPS)
                y_ref, s_ref = _exact(parts, res, weight)
                assert torch.equal(s, s_ref) and s.is_contiguous()
                torch.testing.assert_close(y, y_ref, rtol=ULP[dtype], atol=1e-6)
    assert one._state[0].item() == 9 and multi._state[0].item() == 6
    assert one.guards_intact() and multi.guards_intact()
    # Padding rows (zeros, residual zeros or absent) normalise to zeros, not NaN (fault 5).
    for res in (torch.zeros(3, 36), None):
        y, s = one(torch.zeros(3, 36), res, torch.ones(36), EPS)
        assert torch.equal(y, torch.zeros(3, 36)) and torch.equal(s, torch.zeros(3, 36))
    one.close()
    assert not one.accepts(torch.zeros(1, 36))


def test_accepts_is_a_byte_limit(interp, monkeypatch):
    """accepts(): tokens * hidden * element size <= the real slot size (capacity rounded up to
    16 bytes); any hidden size, any dtype; wrong device, rank or dtype refused (known fault 9)."""
    be = P2PAllReduceRMSNorm(1000)  # -> 1008 bytes per slot
    assert be.max_bytes == 1008 and be.slot_stride_bytes % 256 == 0
    assert be.slot_stride_bytes >= be.max_bytes + 64
    for dtype in DTYPES.values():
        for hidden in (1, 7, 36, 63, 126, 1008):
            es = torch.tensor([], dtype=dtype).element_size()
            for n in range(0, 1008 // (hidden * es) + 3):
                h = torch.zeros(n, hidden, dtype=dtype)
                assert be.accepts(h) == (n * hidden * es <= 1008), (dtype, hidden, n)
    assert not be.accepts(torch.zeros(2, 3, 4))
    assert not be.accepts(torch.zeros(4, dtype=torch.float64).view(2, 2))
    assert not be.accepts(torch.zeros(4, 4).t())
    assert not be.accepts(torch.zeros(2, 4, requires_grad=True))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not be.accepts(torch.zeros(2, 4)), "no kernel without the interpreter on CPU"
    with pytest.raises(ValueError, match="not accepted"):
        be(torch.zeros(2, 4), None, torch.ones(4), EPS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_buffers must be >= 2"):
        P2PAllReduceRMSNorm(1024, num_buffers=1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        P2PAllReduceRMSNorm(0)
    with pytest.raises(ValueError, match="timeout_s"):
        P2PAllReduceRMSNorm(1024, timeout_s=0)
    with pytest.raises(ValueError, match="max_programs"):
        P2PAllReduceRMSNorm(1024, max_programs=0)
    with pytest.raises(ValueError, match="nbytes"):
        allocate_peer_buffers(8)


_PTX_CHECK = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mtpspec.distributed.p2p_allreduce_rms_norm import _kernel
jit = triton.JITFunction(_kernel.fn)
names = [p.name for p in jit.params]
ptr = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
ptr.update({n: "*i64" for n in ("data_table", "flag_table", "state_ptr", "err_ptr")})
sig = dict(ptr, n_rows="i32", n_cols="i32", stride_x="i32", stride_res="i32", eps="fp32",
           rank="i32", slot_stride="i32", timeout_ns="i64", max_spins="i64", call_tag="i32")
cons = dict(WORLD=4, NUM_BUFFERS=2, MAX_PROGRAMS=128, HAS_RESIDUAL=True, ONE_PASS=True, BLOCK_M=1,
            BLOCK_N=8192, BF16_BY_BITS=False, USE_GLOBALTIMER=True)
sig.update({k: "constexpr" for k in cons})
aligned = list(ptr) + ["n_cols", "stride_x", "stride_res", "slot_stride"]
src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in cons.items()},
                attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
lines = ptx.splitlines()
print(json.dumps({
    "release_sys": sum(bool(re.search(r"atom\.global\.(sys\.release|release\.sys)\.exch", l)) for l in lines),
    "acquire_sys": sum(bool(re.search(r"(ld|atom)\.global\.(sys\.acquire|acquire\.sys)", l)) for l in lines),
    "globaltimer": ptx.count("%globaltimer"),
    "scalar_b16": sum(bool(re.search(r"(ld|st)\.global\.b16", l)) for l in lines),
    "v4_loads": sum(bool(re.search(r"ld\.global\S*\.v4", l)) for l in lines),
    "v4_stores": sum(bool(re.search(r"st\.global\S*\.v4", l)) for l in lines),
    "cg_v4_loads": sum(bool(re.search(r"ld\.global\.cg\S*\.v4", l)) for l in lines),
    "multicast": sum("multimem" in l for l in lines)}))
"""


def test_compiles_for_sm90_with_release_acquire():
    """Compiled ahead of time for sm_90 (no GPU needed): flags are written with system-scope
    release exchanges and polled with system-scope acquires, the wait reads %globaltimer,
    peer stores and slot loads are 16-byte vectors, and nothing uses multicast (multimem)."""
    pytest.importorskip("triton")
    import json

    env = repo_env()
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _PTX_CHECK], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["release_sys"] == 4, rep  # one flag per rank
    assert rep["acquire_sys"] >= 4, rep
    assert rep["globaltimer"] >= 2, rep
    assert rep["scalar_b16"] == 0 and rep["v4_loads"] > 0 and rep["v4_stores"] > 0, rep
    assert rep["cg_v4_loads"] >= 4, rep  # the 4 slots are read through L2, 16 bytes at a time
    assert rep["multicast"] == 0, rep
