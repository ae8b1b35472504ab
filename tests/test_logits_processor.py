"""LogitsProcessor: compute_logits and the local-argmax get_top_tokens contract.

Contract: ``get_top_tokens == torch.argmax(full unpadded logits, -1)`` for every input (ties to the
lowest id, also across shard boundaries; first NaN wins; +-inf; all -inf rows; mostly-padding and
empty last shards; V not divisible by tp; ids >= 2**24; fp32/bf16/fp16; 0 tokens), using one
``[num_tokens, 2]`` float64 all-gather per rank and never the logits.

Two levels:
* the pure reduction (``local_top_pairs`` per simulated rank + ``pick_top_tokens`` on the
  ``[tp, T, 2]`` stack) under hypothesis, hundreds of examples, padding columns filled with
  values that would win if they leaked;
* real gloo ranks (tp 1..4, one launch per tp) with the LM head loaded from full weights.
  Exact special values are injected with ``hidden_size = 1``: ``logits[t, v] = h[t] * w[v]`` is
  exact for ``h`` in {0, +-0.5, +-1, 2} in every dtype, so the reference ``torch.argmax`` of the
  single-process float64 logits is exact.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mtpspec.distributed import comm_stats, get_tensor_model_parallel_rank, launch, reset_comm_stats
from mtpspec.layers import LogitsProcessor, ParallelLMHead, local_top_pairs, pick_top_tokens

INF, NAN = float("inf"), float("nan")
ALPHABET = [-INF, INF, NAN, -3.0, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0]
SCALES = [1.0, -1.0, 0.5, 2.0, 0.0, -0.5]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BIG_V = 2**24 + 200


def _run(fn: Callable[..., Any], tp: int, *args: Any) -> List[Any]:
    return [fn(*args)] if tp == 1 else launch(fn, tp, *args)


def per_rank(v: int, tp: int) -> int:
    return math.ceil(v / (64 * tp)) * 64


def token_counts(tp: int) -> List[int]:
    return sorted({0, 1, tp - 1, tp + 1, 17, 2 * (1 + 1), 8 * (1 + 3), 16 * (1 + 5)})


# ---------------------------------------------------------------- pure reduction (in process)

def simulate_top_tokens(logits: torch.Tensor, tp: int, vocab_start_fill: float = INF) -> torch.Tensor:
    """Shard ``[T, V]`` logits as the ranks would (padding filled with a would-be winner), reduce, pick."""
    t, v = logits.shape
    per = per_rank(v, tp)
    padded = torch.full((t, per * tp), vocab_start_fill, dtype=logits.dtype)
    padded[:, :v] = logits
    pairs = [local_top_pairs(padded[:, r * per:(r + 1) * per], r * per, max(0, min(v - r * per, per)))
             for r in range(tp)]
    return pick_top_tokens(torch.stack(pairs))


@st.composite
def logits_cases(draw: st.DrawFn) -> Tuple[torch.Tensor, int, float]:
    tp = draw(st.integers(1, 8))
    v = draw(st.one_of(st.integers(1, 70), st.integers(120, 300), st.sampled_from([64 * tp + 1, 128 * tp - 1])))
    t = draw(st.integers(0, 5))
    arr = draw(hnp.arrays(np.float32, (t, v), elements=st.sampled_from(ALPHABET)))
    dtype = draw(st.sampled_from(DTYPES))
    fill = draw(st.sampled_from([INF, NAN, 1e4]))
    return torch.from_numpy(arr).to(dtype), tp, fill


@settings(max_examples=400, deadline=None)
@given(logits_cases())
def test_pure_pick_equals_torch_argmax(case: Tuple[torch.Tensor, int, float]) -> None:
    logits, tp, fill = case
    got = simulate_top_tokens(logits, tp, fill)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(logits, dim=-1)), (logits, tp)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 400), st.integers(0, 6), st.integers(0, 2**31 - 1))
def test_pure_pick_random_floats(tp: int, v: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g).round()  # coarse values: many ties
    assert torch.equal(simulate_top_tokens(logits, tp), torch.argmax(logits, dim=-1))


def test_pick_is_rank_major_not_row_major() -> None:
    # 2 ranks x 3 tokens with distinct values: a [T, tp] reading would pick other ids.
    pairs = torch.tensor([[[1.0, 10], [9.0, 11], [5.0, 12]],
                          [[2.0, 70], [3.0, 71], [5.0, 72]]], dtype=torch.float64)
    assert pick_top_tokens(pairs).tolist() == [70, 11, 12]
    # Sentinels (-inf, -1) never win, even against an all -inf row; NaN beats +inf, first NaN wins.
    pairs = torch.tensor([[[-INF, 0], [INF, 3], [1.0, 4]],
                          [[-INF, -1], [NAN, 90], [NAN, 91]],
                          [[-INF, -1], [NAN, 130], [-INF, -1]]], dtype=torch.float64)
    assert pick_top_tokens(pairs).tolist() == [0, 90, 91]


def test_local_top_pairs_exact_ids_and_sentinel() -> None:
    local = torch.tensor([[1.0, 7.0, 7.0, 9.0], [NAN, 2.0, NAN, 9.0]])
    p = local_top_pairs(local, 2**24 + 1, 3)  # column 3 is padding
    assert p.dtype == torch.float64
    assert p[0].tolist() == [7.0, 2**24 + 2] and p[1, 1].item() == 2**24 + 1 and math.isnan(p[1, 0])
    s = local_top_pairs(local, 512, 0)
    assert s.tolist() == [[-INF, -1.0], [-INF, -1.0]]
    with pytest.raises(ValueError, match="num_real"):
        local_top_pairs(local, 0, 5)
    with pytest.raises(ValueError, match="float64"):
        pick_top_tokens(torch.zeros(2, 3, 2))


# ---------------------------------------------------------------- real ranks

def large_weight(seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[BIG_V, 1]`` weight and ``[2, 1]`` hidden whose argmaxes sit above 2**24 (odd ids, and a tie).

    float32 (a CPU bf16 matmul over 2**24 rows is slow); the ids travel as int64 -> float64 whatever
    the logits' dtype, and the half dtypes are covered by the other cases.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(BIG_V, 1, generator=g) * 0.01
    w[2**24 + 1] = w[2**24 + 3] = 100.0  # tie: 2**24 + 1 (float32 would round it to 2**24)
    w[2**24 + 5] = -100.0  # the winner of the row with h = -1
    return w, torch.tensor([[1.0], [-1.0]])


def special_cases(tp: int, seed: int) -> List[Dict[str, Any]]:
    """Injected values (hidden_size 1): ties across boundaries, NaN, +-inf, all -inf, padding-heavy shards."""
    g = torch.Generator().manual_seed(seed)
    cases: List[Dict[str, Any]] = []

    def add(name: str, w: torch.Tensor, vocab: int | None = None, dtypes: List[torch.dtype] | None = None) -> None:
        h = torch.tensor(SCALES).unsqueeze(1)
        if dtypes is None:  # every dtype for the largest vocab, one (rotating) dtype for the others
            dtypes = DTYPES if w.shape[0] == 3 * 64 * tp + 1 else [DTYPES[len(cases) % 3]]
        for dtype in dtypes:
            cases.append(dict(name=f"{name}/{dtype}", V=w.shape[0], vocab=vocab or w.shape[0], dtype=dtype,
                              weight=w.unsqueeze(1), hidden=h))

    for v in (130, 1000, 64 * tp + 1, 3 * 64 * tp + 1):
        per = per_rank(v, tp)
        base = lambda: torch.randint(-3, 3, (v,), generator=g).float()  # noqa: E731
        w = base()
        w[w == 2.0] = 1.0
        for r in range(1, tp):  # the same maximum at the last id of rank r-1 and the first of rank r
            if r * per < v:
                w[r * per - 1] = w[r * per] = 2.0
        add(f"boundary_tie_v{v}", w)
        if tp > 1 and per < v:
            w = base()
            w[w >= 2.0] = 1.0
            w[per] = w[v - 1] = 2.0  # tie between rank 1's first id and the last id
            add(f"tie_rank1_vs_last_v{v}", w)
        w = base()
        w[v - 1] = NAN
        if per + 1 < v - 1:
            w[per + 1] = NAN  # first NaN on rank 1 beats a later one and a +inf before it
        w[0] = INF
        add(f"nan_v{v}", w)
        w = base()
        w[v // 2] = INF
        w[v - 1] = INF
        add(f"inf_v{v}", w)
        add(f"all_neg_inf_v{v}", torch.full((v,), -INF))  # padding logits (0) must not win
        add(f"all_pos_inf_v{v}", torch.full((v,), INF))  # h = -1 turns it into all -inf
        w = base()
        w[v - 1] = 50.0
        add(f"processor_vocab_smaller_v{v}", w, vocab=v - 1)  # id v-1 is outside the processor's vocab
    for _ in range(12):  # random draws from the special alphabet
        v = int(torch.randint(1, 4 * 64 * tp, (1,), generator=g))
        idx = torch.randint(0, len(ALPHABET), (v,), generator=g)
        add(f"alphabet_v{v}", torch.tensor(ALPHABET)[idx], dtypes=[DTYPES[int(idx[0]) % 3]])
    return cases


def random_cases(tp: int, seed: int) -> List[Dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for v in (1, 65, 130, 1000, 3 * 64 * tp + 1):
        w = torch.randn(v, 16, generator=g)
        for dtype in DTYPES:  # every token count in fp32; a subset of counts and vocabs in the half types
            counts = token_counts(tp) if dtype == torch.float32 else sorted({0, 1, tp + 1, 16 * (1 + 5)})
            if dtype != torch.float32 and v not in (130, 3 * 64 * tp + 1):
                continue
            for n in counts:
                cases.append(dict(name=f"random_v{v}/{dtype}/n{n}", V=v, vocab=v, dtype=dtype, weight=w,
                                  hidden=torch.randn(n, 16, generator=g)))
    return cases


def _catch(f: Callable[[], Any]) -> str:
    try:
        f()
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _rank(tp: int, cases: List[Dict[str, Any]], big_seed: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"rank": get_tensor_model_parallel_rank()}
    for c in cases:
        head = ParallelLMHead(c["V"], c["weight"].shape[1], params_dtype=c["dtype"])
        head.weight.weight_loader(head.weight, c["weight"])
        lp = LogitsProcessor(c["vocab"])
        h = c["hidden"].to(c["dtype"])
        reset_comm_stats()
        top = lp.get_top_tokens(head, h)
        s_top = comm_stats()
        reset_comm_stats()
        logits = lp.compute_logits(head, h)
        s_log = comm_stats()
        out[c["name"]] = (top, logits.clone(), s_top, s_log, head.num_embeddings_per_partition)
    w, h = large_weight(big_seed)
    head = ParallelLMHead(BIG_V, 1, params_dtype=torch.float32)
    head.weight.weight_loader(head.weight, w)
    lp = LogitsProcessor(BIG_V)
    top = lp.get_top_tokens(head, h)  # (gathering 2 x 2**24 logits on gloo is slow: tp 1 only)
    out["big"] = (top, lp.compute_logits(head, h).argmax(-1) if tp == 1 else top)
    out["bytes"] = _bytes_rank(151552, 4, 64) if tp > 1 else None
    head = ParallelLMHead(100, 8)
    out["err_shape"] = _catch(lambda: LogitsProcessor(100).get_top_tokens(head, torch.zeros(3, 9)))
    out["err_dtype"] = _catch(lambda: LogitsProcessor(100).get_top_tokens(head, torch.zeros(3, 8, dtype=torch.float16)))
    out["err_vocab"] = _catch(lambda: LogitsProcessor(101).compute_logits(head, torch.zeros(3, 8)))
    out["err_1d"] = _catch(lambda: LogitsProcessor(100).compute_logits(head, torch.zeros(8)))
    # into a given [T, tp * per_rank] buffer (the CUDA-graph units' shared one): the same logits, a view of it
    torch.manual_seed(3)
    head = ParallelLMHead(100, 8)
    full = torch.randn(100, 8)
    head.weight.weight_loader(head.weight, full)
    h = torch.randn(5, 8)
    buf = torch.full((5, tp * head.num_embeddings_per_partition), float("nan"))
    got = LogitsProcessor(97).compute_logits(head, h, out=buf)
    out["into_buffer"] = (torch.equal(got, LogitsProcessor(97).compute_logits(head, h)),
                          got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), got.clone())
    out["err_buffer"] = _catch(lambda: LogitsProcessor(97).compute_logits(
        head, h, out=torch.empty(5, head.num_embeddings_per_partition + 1)))
    return out


def _float64_logits(c: Dict[str, Any]) -> torch.Tensor:
    h = c["hidden"].to(c["dtype"]).double()
    w = c["weight"].to(c["dtype"]).double()
    return (h @ w.T)[:, :c["vocab"]]


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_get_top_tokens_contract_on_ranks(tp: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    special, rand = special_cases(tp, seed), random_cases(tp, seed + 1)
    results = _run(_rank, tp, tp, special + rand, seed + 2)
    itemsize = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    refs = {c["name"]: _float64_logits(c) for c in special + rand}
    w, h = large_weight(seed + 2)
    big_ref = torch.argmax(h.double() @ w.double().T, dim=-1)
    assert big_ref.tolist() == [2**24 + 1, 2**24 + 5]
    for rank, res in enumerate(results):
        ctx = f"seed={seed} tp={tp} rank={rank}"
        assert res["rank"] == rank
        for c in special + rand:
            top, logits, s_top, s_log, per = res[c["name"]]
            what = f"{ctx} {c['name']}"
            n = c["hidden"].shape[0]
            assert per == per_rank(c["V"], tp), what
            assert top.dtype == torch.int64 and top.shape == (n,), what
            assert logits.shape == (n, c["vocab"]) and logits.dtype == c["dtype"], what
            # Same local logits: the pick equals the argmax of the gathered logits, bit for bit.
            assert torch.equal(top, torch.argmax(logits, dim=-1)), what
            assert torch.equal(top, results[0][c["name"]][0]), f"{what}: ranks disagree"
            ref = refs[c["name"]]
            if c["name"].startswith("random"):
                tol = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 2e-2}[c["dtype"]]
                torch.testing.assert_close(logits.double(), ref, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
                if n:  # the pick is a float64 maximum up to the dtype's rounding of the logits
                    picked = ref.gather(1, top.unsqueeze(1)).squeeze(1)
                    assert (picked >= ref.max(-1).values - 2 * tol).all(), what
            else:  # injected values are exact in every dtype: the float64 argmax is the answer
                torch.testing.assert_close(logits.double(), ref, atol=0, rtol=0, equal_nan=True,
                                           msg=lambda m: f"{what}: {m}")
                assert torch.equal(top, torch.argmax(ref, dim=-1)), f"{what}: {top} vs {torch.argmax(ref, -1)}"
            assert (top >= 0).all() and (top < c["vocab"]).all(), what
            # Communication: one [T, 2] float64 all-gather, never the logits.
            if tp == 1:
                assert s_top == {} and s_log == {}, what
            else:
                assert set(s_top) == {"all_gather"} and s_top["all_gather"]["calls"] == 1, what
                assert s_top["all_gather"]["bytes_sent"] == (tp - 1) * n * 16, what
                assert s_log["all_gather"]["bytes_sent"] == (tp - 1) * n * per * itemsize[c["dtype"]], what
        assert res["big"][0].tolist() == big_ref.tolist() and res["big"][1].tolist() == big_ref.tolist(), ctx
        assert res["err_shape"].startswith("ValueError") and "[num_tokens, 8], got [3, 9]" in res["err_shape"]
        assert res["err_dtype"].startswith("TypeError") and "float16" in res["err_dtype"]
        assert res["err_vocab"].startswith("ValueError") and "101" in res["err_vocab"]
        assert res["err_1d"].startswith("ValueError")
        same, shared, into = res["into_buffer"]  # written into the given buffer, the same logits at every tp
        assert same and shared and torch.equal(into, results[0]["into_buffer"][2]), ctx
        assert res["err_buffer"].startswith("ValueError") and "out must be a contiguous" in res["err_buffer"], ctx
        if tp > 1:  # a draft step at 64 sequences, vocab 151552, bf16: pair bytes < 0.1% of logits bytes
            s_top, s_log, top, ref = res["bytes"]
            assert torch.equal(top, ref), ctx
            top_b, log_b = s_top["all_gather"]["bytes_sent"], s_log["all_gather"]["bytes_sent"]
            assert top_b == (tp - 1) * 64 * 16 and log_b == (tp - 1) * 64 * per_rank(151552, tp) * 2, ctx
            assert top_b / log_b < 1e-3, (top_b, log_b)


def _bytes_rank(v: int, hsz: int, n: int) -> Tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(v, hsz, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, torch.randn(v, hsz, generator=g))
    h = torch.randn(n, hsz, generator=g).bfloat16()
    lp = LogitsProcessor(v)
    reset_comm_stats()
    top = lp.get_top_tokens(head, h)
    s_top = comm_stats()
    reset_comm_stats()
    ref = lp.compute_logits(head, h).argmax(-1)
    return s_top, comm_stats(), top, ref


def test_compute_logits_into_a_given_buffer() -> None:
    """``out`` (the CUDA-graph units' shared logits buffer): the same logits, written into it (the
    result is a view of it, padding columns dropped); a buffer of the wrong shape, dtype or layout
    is a ValueError naming what was expected."""
    torch.manual_seed(0)
    head = ParallelLMHead(100, 8)  # tp 1: 100 rows, padded to the partition
    head.weight.data.normal_()
    lp, h = LogitsProcessor(97), torch.randn(5, 8)
    want = lp.compute_logits(head, h)
    buf = torch.full((5, head.num_embeddings_per_partition), float("nan"))
    got = lp.compute_logits(head, h, out=buf)
    assert torch.equal(got, want) and got.shape == (5, 97)
    assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(buf[:, :97], want)
    for bad in (torch.empty(4, head.num_embeddings_per_partition), torch.empty(5, 99),
                torch.empty(5, head.num_embeddings_per_partition, dtype=torch.float64),
                torch.empty(head.num_embeddings_per_partition, 5).t()):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            lp.compute_logits(head, h, out=bad)
    for bad in (torch.empty(5, head.num_embeddings_per_partition, device="meta"), [[0.0]]):
        with pytest.raises(ValueError, match=r"out must be a contiguous .* on cpu \(\d+: the vocab padded"):
            lp.compute_logits(head, h, out=bad)
    with pytest.raises(ValueError, match=r"expected hidden_states \[num_tokens, 8\]"):  # the hidden, not out
        lp.compute_logits(head, torch.zeros(8), out=buf)
