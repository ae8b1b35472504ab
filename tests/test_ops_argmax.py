"""Vocab-parallel argmax kernels (mtpspec/ops/argmax.py) in Triton's interpreter.

Contract: ``torch.argmax``'s (first maximum; NaN is the maximum, first NaN wins; all -inf rows give
the first real id). Every kernel result is checked against the torch reference AND a brute-force
Python scan of the full row (itself checked against ``torch.argmax``). Splits are shrunk
(``small_split``) so that rows of tens of columns cross several chunks and loop iterations, and
ties / NaNs are placed on chunk, block and lane boundaries computed from the actual plan.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mtpspec.ops import (local_argmax, local_argmax_ref, local_top_pairs, local_top_pairs_ref,
                         pick_top_tokens, pick_top_tokens_ref)
from mtpspec.ops import triton_utils
from mtpspec.ops.triton_utils import interpreter_available

am = importlib.import_module("mtpspec.ops.argmax")

# The interpreter's numpy max over a NaN-only tile warns; the kernels handle NaN explicitly.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALPHABET = [-INF, INF, NAN, -3.0, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0]
BIG_START = 2**24 + 1
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def small_split(monkeypatch):
    """Blocks of 8 columns, chunks of >= 8, 4 SMs: a 70-column row is 5 chunks of 16 at 1 token."""
    monkeypatch.setattr(am, "BLOCK_COLS", 8)
    monkeypatch.setattr(am, "MIN_CHUNK_COLS", 8)
    monkeypatch.setattr(am, "INTERPRETER_SMS", 4)


class Counter:
    """Wraps a LazyKernel and counts launches."""

    def __init__(self, kernel: Any, log: List[str], name: str) -> None:
        self.kernel, self.log, self.name = kernel, log, name

    def __getitem__(self, grid: Any) -> Any:
        self.log.append(self.name)
        return self.kernel[grid]


class NoKernel:
    def __getitem__(self, grid: Any) -> Any:
        raise AssertionError("Triton kernel launched on the reference path")


@pytest.fixture
def launches(monkeypatch) -> List[str]:
    log: List[str] = []
    for name in ("_chunk", "_combine", "_pick"):
        monkeypatch.setattr(am, name, Counter(getattr(am, name), log, name))
    return log


# ---------------------------------------------------------------- independent references

def brute_first_argmax(row: List[float]) -> int:
    """Python scan: index of the first NaN, else of the first maximum (-1 for an empty row)."""
    for i, v in enumerate(row):
        if math.isnan(v):
            return i
    best = -1
    for i, v in enumerate(row):
        if best < 0 or v > row[best]:
            best = i
    return best


def expected_pairs(x: torch.Tensor, vocab_start: int, num_real: int) -> torch.Tensor:
    """Brute-force pairs, with the index cross-checked against ``torch.argmax``."""
    rows = x[:, :num_real].double().tolist()
    idx = [brute_first_argmax(r) for r in rows]
    if num_real and x.shape[0]:
        assert idx == torch.argmax(x[:, :num_real], dim=-1).tolist(), "brute force != torch.argmax"
    vals = [r[i] if i >= 0 else -INF for r, i in zip(rows, idx)]
    ids = [vocab_start + i if i >= 0 else -1 for i in idx]
    return torch.tensor([vals, ids], dtype=torch.float64).T.reshape(len(rows), 2)


def assert_pairs_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Exact: ids equal, values equal bit-for-bit up to the NaN payload (also the sign of zero)."""
    assert got.dtype == torch.float64 and got.shape == want.shape, (what, got.shape, got.dtype)
    assert torch.equal(got[:, 1], want[:, 1]), f"{what}: ids {got[:, 1].tolist()} != {want[:, 1].tolist()}"
    gv, wv = got[:, 0], want[:, 0]
    assert torch.equal(gv.isnan(), wv.isnan()), f"{what}: NaN {gv.tolist()} vs {wv.tolist()}"
    keep = ~wv.isnan()
    assert torch.equal(gv[keep], wv[keep]), f"{what}: values {gv.tolist()} vs {wv.tolist()}"
    assert torch.equal(gv[keep].signbit(), wv[keep].signbit()), f"{what}: sign of zero"


def check_local(x: torch.Tensor, vocab_start: int, num_real: int, what: str = "") -> None:
    want = expected_pairs(x, vocab_start, num_real)
    assert_pairs_equal(local_top_pairs(x, vocab_start, num_real), want, what)
    assert_pairs_equal(local_top_pairs_ref(x, vocab_start, num_real), want, f"{what} (ref)")
    ids = local_argmax(x, vocab_start, num_real)
    assert ids.dtype == torch.int64 and torch.equal(ids, want[:, 1].long()), what
    assert torch.equal(local_argmax_ref(x, vocab_start, num_real), ids), what


# ---------------------------------------------------------------- local_top_pairs / local_argmax

def special_rows(per: int, num_real: int) -> torch.Tensor:
    """Rows whose winners sit on the plan's chunk / block / lane boundaries (positions are taken
    modulo ``num_real``); the padding (columns >= num_real) holds would-be winners: +inf in even
    rows, NaN in odd rows."""
    plan = am.split_plan(1, max(1, num_real), am.INTERPRETER_SMS)
    ch, bl = plan.chunk, plan.block
    n = max(1, num_real)
    g = torch.Generator().manual_seed(per * 31 + num_real)

    def base() -> torch.Tensor:
        return torch.randint(-3, 3, (per,), generator=g).float()

    def put(row: torch.Tensor, pos: List[int], v: float) -> torch.Tensor:
        for p in pos:
            row[p % n] = v
        return row

    rows = [
        torch.ones(per),  # every column ties
        put(base(), [ch - 1, ch], 5.0),  # tie across a chunk boundary
        put(base(), [ch, 2 * ch], 5.0),  # tie between the first columns of two chunks
        put(base(), [3 + bl, 2 + 2 * bl], 5.0),  # later block, lower lane loses to the earlier column
        put(put(base(), [2], INF), [ch + 1, 2 * ch + 5, ch + 1 + bl], NAN),  # NaN after +inf; several NaNs
        put(base(), [bl + 1, 1], NAN),  # two NaNs in one lane / chunk
        put(torch.full((per,), -INF), [ch + 2, 3 * ch], INF),
        torch.full((per,), -INF),  # all -inf: the first real id
        torch.full((per,), INF),
        put(put(torch.full((per,), -2.0), [ch + 3], -0.0), [ch + 4, 1], 0.0),  # -0.0 == 0.0: first wins
        torch.randn(per, generator=g).mul(4).round().div(4),
        put(torch.full((per,), -1.0), [num_real - 1], 7.0),  # the last real column wins
    ]
    x = torch.stack(rows)
    x[0::2, num_real:] = INF
    x[1::2, num_real:] = NAN
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(interp, small_split, dtype):
    per = 70
    for i, num_real in enumerate((0, 1, per - 1, per, 9, 33)):  # 9, 33: mostly padding, cut chunks
        x = special_rows(per, num_real).to(dtype)
        vocab_start = (0, BIG_START)[i % 2]
        check_local(x, vocab_start, num_real, f"{dtype} num_real={num_real} start={vocab_start}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_counts_and_views(interp, small_split, dtype):
    g = torch.Generator().manual_seed(5)
    per = 45
    for t in (0, 1, 3, 17):
        x = torch.randn(t, per, generator=g).mul(2).round().to(dtype)  # many ties
        check_local(x, 7, per - 2, f"T={t}")
        if t == 3:
            wide = torch.randn(2 * t, per + 13, generator=g).round().to(dtype)
            check_local(wide[:, 5:5 + per], 3, per, f"T={t} column slice (row stride {per + 13})")
            check_local(wide[::2, 5:], 3, per - 1, f"T={t} every other row")
    cols_major = torch.randn(per, 3, generator=g).round().to(dtype).T  # column stride 3: copied
    check_local(cols_major, 0, per - 4, "column-strided")


def test_ids_above_2_pow_24_and_near_2_pow_53(interp, small_split):
    x = torch.zeros(3, 40)
    x[0, 1] = x[0, 3] = 1.0  # the tie goes to BIG_START + 1 (odd; float32 would round it)
    x[1, 39] = NAN
    x[2, 37] = 2.0
    pairs = local_top_pairs(x, BIG_START, 40)
    assert pairs[:, 1].tolist() == [BIG_START + 1, BIG_START + 39, BIG_START + 37]
    assert local_argmax(x, BIG_START, 40).tolist() == [BIG_START + 1, BIG_START + 39, BIG_START + 37]
    top = 2**53 - 40
    assert local_top_pairs(x, top, 40)[:, 1].tolist() == [top + 1, top + 39, top + 37]
    check_local(x, top, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_default_split_long_row(interp, dtype):
    """Default constants: a 5000-column shard at 1 token is cut into 3 chunks of 2048."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5000, generator=g).round().to(dtype)
    x[0, 2047] = x[0, 2048] = 9.0
    x[1, 4095] = NAN
    x[1, 100] = INF
    assert am.split_plan(1, 4990, am.INTERPRETER_SMS).n_chunks == 3
    check_local(x[:1], 0, 4990)
    check_local(x, 11, 4990)


def test_bf16_native_load_in_interpreter(interp, small_split, monkeypatch):
    """The compiled path loads bf16 natively; under this interpreter that must agree too."""
    monkeypatch.setattr(am, "BF16_BITS_IN_INTERPRETER", False)
    x = special_rows(50, 41).to(torch.bfloat16)
    check_local(x, 5, 41)


@st.composite
def shard_cases(draw: st.DrawFn) -> Tuple[torch.Tensor, int, int]:
    t = draw(st.integers(0, 4))
    per = draw(st.integers(1, 40))
    num_real = draw(st.integers(0, per))
    arr = draw(hnp.arrays(np.float32, (t, per), elements=st.sampled_from(ALPHABET)))
    x = torch.from_numpy(arr).to(draw(st.sampled_from(DTYPES)))
    return x, draw(st.sampled_from([0, 5, BIG_START, 2**40 + 3])), num_real


@settings(max_examples=40, **SETTINGS)
@given(case=shard_cases(), block=st.sampled_from([1, 2, 4, 8]), min_chunk=st.integers(1, 9),
       sms=st.sampled_from([1, 3, 8]))
def test_property_local_pairs(interp, monkeypatch, case, block, min_chunk, sms):
    monkeypatch.setattr(am, "BLOCK_COLS", block)
    monkeypatch.setattr(am, "MIN_CHUNK_COLS", min_chunk)
    monkeypatch.setattr(am, "INTERPRETER_SMS", sms)
    x, vocab_start, num_real = case
    check_local(x, vocab_start, num_real, f"block={block} min_chunk={min_chunk} sms={sms}")


# ---------------------------------------------------------------- pick_top_tokens

def shard_and_pick(logits: torch.Tensor, tp: int, fill: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shards ``[T, V]`` logits as ``tp`` ranks would (padding = ``fill``): kernel pairs and ref pairs."""
    t, v = logits.shape
    per = -(-v // tp)
    padded = torch.full((t, per * tp), fill, dtype=logits.dtype)
    padded[:, :v] = logits
    got, ref = [], []
    for r in range(tp):
        shard, num_real = padded[:, r * per:(r + 1) * per], max(0, min(v - r * per, per))
        got.append(local_top_pairs(shard, r * per, num_real))
        ref.append(local_top_pairs_ref(shard, r * per, num_real))
    return torch.stack(got), torch.stack(ref)


@settings(max_examples=30, **SETTINGS)
@given(tp=st.integers(1, 9), v=st.integers(1, 60), t=st.integers(0, 4), fill=st.sampled_from([INF, NAN]),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_property_sharded_pick_equals_torch_argmax(interp, small_split, tp, v, t, fill, dtype, data):
    arr = data.draw(hnp.arrays(np.float32, (t, v), elements=st.sampled_from(ALPHABET)))
    logits = torch.from_numpy(arr).to(dtype)
    got_pairs, ref_pairs = shard_and_pick(logits, tp, fill)
    for r in range(tp):
        assert_pairs_equal(got_pairs[r], ref_pairs[r], f"rank {r}")
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(want, torch.tensor([brute_first_argmax(r) for r in logits.double().tolist()],
                                          dtype=torch.int64))
    got = pick_top_tokens(got_pairs)
    assert got.dtype == torch.int64 and torch.equal(got, want), (logits, tp)
    assert torch.equal(pick_top_tokens_ref(ref_pairs), want)


@settings(max_examples=40, **SETTINGS)
@given(tp=st.integers(1, 9), t=st.integers(0, 6), data=st.data())
def test_property_pick_random_pairs(interp, tp, t, data):
    """Arbitrary pair stacks (sentinels anywhere, incl. rank 0; values from the special alphabet)."""
    vals = data.draw(hnp.arrays(np.float64, (tp, t), elements=st.sampled_from(ALPHABET)))
    ids = data.draw(hnp.arrays(np.float64, (tp, t), elements=st.sampled_from([-1.0, -2.0, 0.0, 3.0, 2.0**40 + 1])))
    pairs = torch.stack([torch.from_numpy(vals), torch.from_numpy(ids)], dim=-1)
    got, want = pick_top_tokens(pairs), pick_top_tokens_ref(pairs)
    assert torch.equal(got, want), pairs
    for j in range(t):  # brute force: first valid NaN, else first valid maximum, else rank 0's id
        valid = [r for r in range(tp) if ids[r, j] >= 0]
        nans = [r for r in valid if math.isnan(vals[r, j])]
        if nans:
            r = nans[0]
        elif valid:
            top = max(vals[r, j] for r in valid)
            r = next(r for r in valid if vals[r, j] == top)
        else:
            r = 0
        assert got[j].item() == int(ids[r, j]), (pairs[:, j], got[j])


def test_pick_cases_and_layouts(interp):
    pairs = torch.tensor([[[1.0, 10], [9.0, 11], [5.0, 12]],
                          [[2.0, 70], [3.0, 71], [5.0, 72]]], dtype=torch.float64)
    assert pick_top_tokens(pairs).tolist() == [70, 11, 12]  # rank-major, not token-major
    pairs = torch.tensor([[[-INF, 0], [INF, 3], [1.0, 4], [-INF, -1]],
                          [[-INF, -1], [NAN, 90], [NAN, 91], [-INF, -1]],
                          [[-INF, -1], [NAN, 130], [-INF, -1], [NAN, -1]]], dtype=torch.float64)
    assert pick_top_tokens(pairs).tolist() == [0, 90, 91, -1]  # sentinels (even NaN ones) never win
    assert pick_top_tokens_ref(pairs).tolist() == [0, 90, 91, -1]
    token_major = pairs.transpose(0, 1).contiguous().transpose(0, 1)  # strided [tp, T, 2] view
    assert token_major.stride(0) == 2 and pick_top_tokens(token_major).tolist() == [0, 90, 91, -1]
    assert pick_top_tokens(pairs[:, 1:3]).tolist() == [90, 91]
    assert pick_top_tokens(pairs[:, :0]).shape == (0,)
    big = torch.tensor([[[3.0, 2.0**52 + 1], [1.0, 2.0**24 + 1]]], dtype=torch.float64)
    assert pick_top_tokens(big).tolist() == [2**52 + 1, 2**24 + 1]


# ---------------------------------------------------------------- launches, dispatch, errors

def test_launch_counts(interp, small_split, launches):
    x = torch.randn(1, 70)
    assert am.split_plan(1, 70, am.INTERPRETER_SMS).n_chunks > 1
    local_top_pairs(x, 0, 70)
    assert launches == ["_chunk", "_combine"]
    launches.clear()
    local_argmax(x, 0, 70)
    assert launches == ["_chunk", "_combine"]
    launches.clear()
    x = torch.randn(64, 9)  # one chunk per row: one launch
    assert am.split_plan(64, 9, am.INTERPRETER_SMS).n_chunks == 1
    local_top_pairs(x, 0, 9)
    local_argmax(x, 0, 9)
    local_top_pairs(x, 0, 0)  # sentinels: one launch
    assert launches == ["_chunk", "_chunk", "_combine"]
    launches.clear()
    pick_top_tokens(torch.zeros(3, 5, 2, dtype=torch.float64))
    local_top_pairs(x[:0], 0, 9)
    assert launches == ["_pick"]


@pytest.mark.parametrize("sms,tokens,num_real,chunks", [
    (132, 1, 151552, 74), (132, 64, 151552, 5), (132, 1, 18944, 10), (132, 4096, 151552, 1),
    (132, 1, 100, 1)])
def test_split_plan_h200_shapes(sms, tokens, num_real, chunks):
    plan = am.split_plan(tokens, num_real, sms)
    assert plan.n_chunks == chunks, plan
    assert plan.chunk % plan.block == 0 and (plan.n_chunks - 1) * plan.chunk < num_real <= plan.n_chunks * plan.chunk


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 10**5), num_real=st.integers(1, 2**31 - 1), sms=st.integers(1, 200))
def test_split_plan_every_chunk_has_real_columns(tokens, num_real, sms):
    plan = am.split_plan(tokens, num_real, sms)
    assert 1 <= plan.n_chunks <= am.MAX_CHUNKS and plan.chunk % plan.block == 0
    assert (plan.n_chunks - 1) * plan.chunk < num_real <= plan.n_chunks * plan.chunk


def test_reference_path_without_interpreter(no_interp, monkeypatch):
    for name in ("_chunk", "_combine", "_pick"):
        monkeypatch.setattr(am, name, NoKernel())
    x = torch.tensor([[1.0, NAN, 3.0], [2.0, 2.0, -INF]])
    assert local_top_pairs(x, 4, 3)[:, 1].tolist() == [5.0, 4.0]
    assert local_argmax(x, 4, 3).tolist() == [5, 4]
    assert pick_top_tokens(local_top_pairs(x, 0, 3).unsqueeze(0)).tolist() == [1, 0]


def test_reference_for_other_dtypes_and_autograd(interp, monkeypatch):
    monkeypatch.setattr(am, "_chunk", NoKernel())
    monkeypatch.setattr(am, "_combine", NoKernel())
    x = torch.tensor([[1.0, 3.0, 3.0]], dtype=torch.float64)
    assert local_argmax(x, 0, 3).tolist() == [1]
    y = torch.tensor([[1.0, 3.0, 2.0]], requires_grad=True)
    assert local_top_pairs(y, 0, 3)[:, 1].tolist() == [1.0]


@pytest.mark.parametrize("path", ["interp", "no_interp"])
def test_bad_inputs_raise(request, path):
    request.getfixturevalue(path)
    x = torch.zeros(2, 4)
    for fn in (local_top_pairs, local_argmax):
        with pytest.raises(ValueError, match="num_real"):
            fn(x, 0, 5)
        with pytest.raises(ValueError, match="num_real"):
            fn(x, 0, -1)
        with pytest.raises(ValueError, match=r"per_rank\] logits, got \[4\]"):
            fn(torch.zeros(4), 0, 1)
        with pytest.raises(ValueError, match="2\\*\\*53"):
            fn(x, 2**53 - 2, 4)
        with pytest.raises(ValueError, match="2\\*\\*53"):
            fn(x, -1, 4)
        with pytest.raises(TypeError, match="num_real must be an int"):
            fn(x, 0, 2.0)
    with pytest.raises(ValueError, match="float64"):
        pick_top_tokens(torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="float64"):
        pick_top_tokens(torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one rank"):
        pick_top_tokens(torch.zeros(0, 3, 2, dtype=torch.float64))


# ---------------------------------------------------------------- LogitsProcessor on the kernels

def _processor_rank(cases: List[Tuple[int, int, torch.dtype, torch.Tensor, torch.Tensor]]) -> Any:
    from mtpspec.layers import LogitsProcessor, ParallelLMHead
    out = []
    for vocab, padded_vocab, dtype, w, h in cases:
        head = ParallelLMHead(padded_vocab, w.shape[1], params_dtype=dtype)
        head.weight.weight_loader(head.weight, w)
        lp = LogitsProcessor(vocab)
        out.append((lp.get_top_tokens(head, h.to(dtype)), torch.argmax(lp.compute_logits(head, h.to(dtype)), -1)))
    return interpreter_available() and triton_utils.use_triton(torch.zeros(1)), out


def processor_cases(seed: int) -> Iterator[Tuple[int, int, torch.dtype, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for i, (vocab, padded) in enumerate([(130, 131), (1000, 1000), (200, 257)]):  # odd: uneven shards
        w = torch.randint(-2, 3, (padded, 1), generator=g).float()
        w[vocab // 2] = NAN if i == 1 else w[vocab // 2]
        h = torch.tensor([[1.0], [-1.0], [0.5], [0.0]])  # h = 0: every real logit ties at 0 (or NaN)
        yield vocab, padded, DTYPES[i % 3], w, h


def test_processor_tp1_uses_local_argmax(interp, small_split, launches):
    used, results = _processor_rank(list(processor_cases(1)))
    assert used and "_chunk" in launches and "_pick" not in launches
    for top, ref in results:
        assert torch.equal(top, ref), (top, ref)


def test_processor_tp2_on_kernels(interp):
    from mtpspec.distributed import launch
    cases = list(processor_cases(2))
    results = launch(_processor_rank, 2, cases)
    for used, res in results:
        assert used, "ranks did not run the Triton kernels"
        for (top, ref), (vocab, _, dtype, w, h) in zip(res, cases):
            want = torch.argmax((h.to(dtype).double() @ w.to(dtype).double().T)[:, :vocab], -1)
            assert torch.equal(top, ref) and torch.equal(top, want), (vocab, dtype, top, want)


def test_compiles_for_sm90():
    """The compiled (GPU) kernels build offline for sm_90; stage 1's whole blocks load 16-byte vectors."""
    if not triton_utils.HAS_TRITON:
        pytest.skip("triton is not installed")
    chunk_sig = {"x_ptr": "*bf16", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "pair_ptr": "*fp64",
                 "id_ptr": "*fp64", "n_real": "i32", "chunk": "i32", "n_chunks": "i32", "stride_row": "i32",
                 "vocab_start": "i64"}
    specs = [{"module": "mtpspec.ops.argmax", "kernel": "_chunk", "signature": chunk_sig,
              "constexprs": dict(MODE=mode, BLOCK=2048, BF16_BY_BITS=False),
              "aligned": ["x_ptr", "stride_row", "chunk"], "num_warps": am.NUM_WARPS} for mode in (0, 1)]
    specs.append({**specs[0], "constexprs": dict(MODE=2, BLOCK=1, BF16_BY_BITS=False), "aligned": [],
                  "signature": {**chunk_sig, "x_ptr": "*fp16", "pair_ptr": "*i64", "id_ptr": "*i64"}})
    specs.append({"module": "mtpspec.ops.argmax", "kernel": "_combine",
                  "signature": {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "pair_ptr": "*i64",
                                "id_ptr": "*i64", "n_rows": "i32", "n_chunks": "i32", "vocab_start": "i32"},
                  "constexprs": dict(MODE=2, BLOCK_T=32, BLOCK_C=128), "aligned": [], "num_warps": am.NUM_WARPS})
    specs.append({**specs[-1], "constexprs": dict(MODE=1, BLOCK_T=64, BLOCK_C=1), "num_warps": 1,
                  "signature": {**specs[-1]["signature"], "pair_ptr": "*fp64", "id_ptr": "*fp64"}})
    specs.append({"module": "mtpspec.ops.argmax", "kernel": "_pick",
                  "signature": {"pairs_ptr": "*fp64", "out_ptr": "*i64", "n_ranks": "i32", "n_tokens": "i32",
                                "stride_r": "i32", "stride_t": "i32", "stride_c": "i32"},
                  "constexprs": dict(BLOCK_T=256), "aligned": [], "num_warps": am.NUM_WARPS})
    reports = triton_utils.compile_reports(specs)
    for spec, rep in zip(specs, reports):
        assert rep["spill_bytes"] in (0, None), (spec["kernel"], rep)
    for rep in reports[:2]:  # 2048 bf16 over 128 threads: two 16-byte vectors per thread per block
        assert rep["ptx_vec4_loads"] == 2, rep
