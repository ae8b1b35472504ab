"""Tensor-parallel linears on gloo ranks (tp 1..4) against single-process float64 references.

Every layer loads the FULL checkpoint tensors through its ``weight_loader``; each rank's output
is compared with the slice of ``x.double() @ W.double().T + b`` that rank must produce. One
launch per tp size runs every check.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest
import torch

from mtpspec.distributed import get_tensor_model_parallel_rank, launch
from mtpspec.layers import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear)

IN, OUT, HEAD, HEADS = 24, 36, 4, 12
KV_CHOICES = [1, 2, 3, 4, 6, 12]
MERGED = [36, 12]


def _run(fn: Callable[..., Any], tp: int, *args: Any) -> List[Any]:
    """tp 1 runs in this process (no process group: the single-process contract); else gloo ranks."""
    return [fn(*args)] if tp == 1 else launch(fn, tp, *args)


def token_counts(tp: int) -> List[int]:
    """0, 1, tp - 1, tp + 1, 17 and B * (1 + k) batches of a draft/verify step."""
    return sorted({0, 1, tp - 1, tp + 1, 17, 3 * (1 + 2), 16 * (1 + 5), 7 * (1 + 1)})


def _case(seed: int, tp: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    c: Dict[str, Any] = {"seed": seed, "tp": tp}
    c["x"] = {n: r(n, IN) for n in token_counts(tp)}
    c["x_row"] = {n: r(n, OUT) for n in token_counts(tp)}
    c["rep"] = (r(20, IN), r(20))
    c["col"] = (r(OUT, IN), r(OUT))
    c["merged"] = [(r(s, IN), r(s)) for s in MERGED]
    c["qkv"] = {kv: (r(HEADS * HEAD, IN), r(kv * HEAD, IN), r(kv * HEAD, IN), r(HEADS * HEAD),
                     r(kv * HEAD), r(kv * HEAD)) for kv in KV_CHOICES}
    c["row"] = (r(20, OUT), r(20))
    return c


def _errors(tp: int) -> Dict[str, str]:
    """Construct / load / call with bad arguments; returns each error's type and message."""
    out: Dict[str, str] = {}

    def catch(name: str, f: Callable[[], Any]) -> None:
        try:
            f()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - we record the type for the parent to check
            out[name] = f"{type(e).__name__}: {e}"

    if tp > 1:
        catch("col_indivisible", lambda: ColumnParallelLinear(IN, tp * 5 + 1))
        catch("row_indivisible", lambda: RowParallelLinear(tp * 5 + 1, 8))
        catch("merged_indivisible", lambda: MergedColumnParallelLinear(IN, [tp * 4, tp * 4 + 1]))
        catch("qkv_heads_indivisible", lambda: QKVParallelLinear(IN, HEAD, tp * 2 + 1, 1))
        col = ColumnParallelLinear(IN, OUT)
        catch("col_load_shard_shape", lambda: col.weight.weight_loader(col.weight, torch.zeros(OUT // tp, IN)))
        row = RowParallelLinear(OUT, 8)
        catch("row_load_shard_shape", lambda: row.weight.weight_loader(row.weight, torch.zeros(8, OUT // tp)))
        catch("row_not_parallel_input", lambda: row(torch.zeros(2, OUT)))
    for kv in KV_CHOICES:
        catch(f"qkv_kv{kv}", lambda: QKVParallelLinear(IN, HEAD, HEADS, kv))
    catch("qkv_gqa_ratio", lambda: QKVParallelLinear(IN, HEAD, 12, 5))
    catch("bad_size", lambda: ColumnParallelLinear(IN, 0))
    m = MergedColumnParallelLinear(IN, MERGED)
    catch("merged_bad_id", lambda: m.weight.weight_loader(m.weight, torch.zeros(MERGED[0], IN), 2))
    catch("merged_wrong_block_shape", lambda: m.weight.weight_loader(m.weight, torch.zeros(MERGED[1], IN), 0))
    q = QKVParallelLinear(IN, HEAD, HEADS, 4 if tp != 3 else 3)
    catch("qkv_bad_id", lambda: q.weight.weight_loader(q.weight, torch.zeros(HEADS * HEAD, IN), "x"))
    catch("qkv_k_as_q_shape", lambda: q.weight.weight_loader(q.weight, torch.zeros(HEADS * HEAD, IN), "k"))
    rep = ReplicatedLinear(IN, 8)
    catch("rep_int_weight", lambda: rep.weight.weight_loader(rep.weight, torch.zeros(8, IN, dtype=torch.int64)))
    catch("rep_wrong_shape", lambda: rep.weight.weight_loader(rep.weight, torch.zeros(IN, 8)))
    catch("rep_input_dtype", lambda: rep(torch.zeros(2, IN, dtype=torch.float16)))
    catch("rep_input_shape", lambda: rep(torch.zeros(2, IN + 1)))
    return out


def _rank(c: Dict[str, Any]) -> Dict[str, Any]:
    tp, rank = c["tp"], get_tensor_model_parallel_rank()
    res: Dict[str, Any] = {"errors": _errors(tp)}

    rep = ReplicatedLinear(IN, 20, bias=True)
    rep.weight.weight_loader(rep.weight, c["rep"][0])
    rep.bias.weight_loader(rep.bias, c["rep"][1])
    col = ColumnParallelLinear(IN, OUT, bias=True)
    colg = ColumnParallelLinear(IN, OUT, bias=True, gather_output=True)
    colb = ColumnParallelLinear(IN, OUT, bias=True, params_dtype=torch.bfloat16)
    for layer in (col, colg, colb):
        layer.weight.weight_loader(layer.weight, c["col"][0])
        layer.bias.weight_loader(layer.bias, c["col"][1].double())  # float64 converts on load
    merged = MergedColumnParallelLinear(IN, MERGED, bias=True)
    for i, (w, b) in enumerate(c["merged"]):
        merged.weight.weight_loader(merged.weight, w, i)
        merged.bias.weight_loader(merged.bias, b, i)
    merged_fused = MergedColumnParallelLinear(IN, MERGED, bias=True)
    merged_fused.weight.weight_loader(merged_fused.weight, torch.cat([w for w, _ in c["merged"]]))
    merged_fused.bias.weight_loader(merged_fused.bias, torch.cat([b for _, b in c["merged"]]))
    qkv: Dict[int, Any] = {}
    for kv, (wq, wk, wv, bq, bk, bv) in c["qkv"].items():
        if not (tp % kv == 0 or kv % tp == 0):
            continue
        layer = QKVParallelLinear(IN, HEAD, HEADS, kv, bias=True)
        if kv % 2:  # fused checkpoint tensor
            layer.weight.weight_loader(layer.weight, torch.cat([wq, wk, wv]))
            layer.bias.weight_loader(layer.bias, torch.cat([bq, bk, bv]))
        else:
            for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
                layer.weight.weight_loader(layer.weight, w, sid)
                layer.bias.weight_loader(layer.bias, b, sid)
        qkv[kv] = layer
        res[f"qkv_sizes_{kv}"] = (layer.num_heads, layer.num_kv_heads, layer.q_size, layer.kv_size)
    rows = {}
    for par in (True, False):
        for red in (True, False):
            layer = RowParallelLinear(OUT, 20, bias=True, input_is_parallel=par, reduce_results=red)
            layer.weight.weight_loader(layer.weight, c["row"][0])
            layer.bias.weight_loader(layer.bias, c["row"][1])
            rows[(par, red)] = layer

    per_in = OUT // tp
    for n, x in c["x"].items():
        res[("rep", n)] = rep(x)
        res[("col", n)] = col(x)
        res[("colg", n)] = colg(x)
        res[("colb", n)] = colb(x.bfloat16())
        res[("merged", n)] = merged(x)
        res[("merged_fused", n)] = merged_fused(x)
        for kv, layer in qkv.items():
            res[("qkv", kv, n)] = layer(x)
        xr = c["x_row"][n]
        for (par, red), layer in rows.items():
            res[("row", par, red, n)] = layer(xr[:, rank * per_in:(rank + 1) * per_in] if par else xr)
    return res


def _lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T + b.double()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _expected_error(msg: str, kind: str, *needles: str) -> None:
    assert msg.startswith(kind), msg
    for s in needles:
        assert s in msg, (s, msg)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_parallel_linears_match_float64_reference(tp: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    c = _case(seed, tp)
    results = _run(_rank, tp, c)
    assert len(results) == tp
    col_per = OUT // tp
    for rank, res in enumerate(results):
        ctx = f"seed={seed} tp={tp} rank={rank}"
        for n, x in c["x"].items():
            y_col = _lin(x, *c["col"])
            _close(res[("rep", n)], _lin(x, *c["rep"]), f"{ctx} replicated n={n}")
            _close(res[("col", n)], y_col[:, rank * col_per:(rank + 1) * col_per], f"{ctx} column n={n}")
            _close(res[("colg", n)], y_col, f"{ctx} column gather n={n}")
            assert res[("colb", n)].dtype == torch.bfloat16
            _close(res[("colb", n)], y_col[:, rank * col_per:(rank + 1) * col_per], f"{ctx} column bf16 n={n}",
                   atol=0.15, rtol=0.03)
            exp = torch.cat([_lin(x, w, b)[:, rank * (s // tp):(rank + 1) * (s // tp)]
                             for (w, b), s in zip(c["merged"], MERGED)], dim=-1)
            _close(res[("merged", n)], exp, f"{ctx} merged n={n}")
            _close(res[("merged_fused", n)], exp, f"{ctx} merged fused-load n={n}")
            for kv, (wq, wk, wv, bq, bk, bv) in c["qkv"].items():
                if not (tp % kv == 0 or kv % tp == 0):
                    continue
                q_size = HEADS // tp * HEAD
                kv_heads = max(1, kv // tp)
                kv_head0 = rank // (tp // kv) if tp >= kv else rank * kv_heads
                assert res[f"qkv_sizes_{kv}"] == (HEADS // tp, kv_heads, q_size, kv_heads * HEAD)
                ks = slice(kv_head0 * HEAD, (kv_head0 + kv_heads) * HEAD)
                exp = torch.cat([_lin(x, wq, bq)[:, rank * q_size:(rank + 1) * q_size],
                                 _lin(x, wk, bk)[:, ks], _lin(x, wv, bv)[:, ks]], dim=-1)
                _close(res[("qkv", kv, n)], exp, f"{ctx} qkv kv={kv} n={n}")
            xr = c["x_row"][n]
            y_row = _lin(xr, *c["row"])
            for par in (True, False):
                _close(res[("row", par, True, n)], y_row, f"{ctx} row parallel_input={par} n={n}")
                part = xr[:, rank * col_per:(rank + 1) * col_per].double() @ \
                    c["row"][0][:, rank * col_per:(rank + 1) * col_per].double().T
                if rank == 0:
                    part = part + c["row"][1].double()  # the bias is added once, by rank 0
                _close(res[("row", par, False, n)], part, f"{ctx} row partial (unreduced) n={n}")
        for n in c["x"]:
            for par in (True, False):
                total = sum(r[("row", par, False, n)].double() for r in results)
                _close(total, _lin(c["x_row"][n], *c["row"]), f"{ctx} sum of row partials n={n}")

        e = res["errors"]
        if tp > 1:
            _expected_error(e["col_indivisible"], "ValueError", "output_size", "not divisible", str(tp))
            _expected_error(e["row_indivisible"], "ValueError", "input_size", "not divisible")
            _expected_error(e["merged_indivisible"], "ValueError", "output_sizes[1]", "not divisible")
            _expected_error(e["qkv_heads_indivisible"], "ValueError", "total_num_heads", "not divisible")
            _expected_error(e["col_load_shard_shape"], "ValueError", str([OUT, IN]), str([OUT // tp, IN]))
            _expected_error(e["row_load_shard_shape"], "ValueError", str([8, OUT]), str([8, OUT // tp]))
            _expected_error(e["row_not_parallel_input"], "ValueError", str(OUT // tp))
        for kv in KV_CHOICES:
            if tp % kv == 0 or kv % tp == 0:
                assert e[f"qkv_kv{kv}"] == "no error", e[f"qkv_kv{kv}"]
            else:
                _expected_error(e[f"qkv_kv{kv}"], "ValueError", f"total_num_kv_heads={kv}", str(tp))
        _expected_error(e["qkv_gqa_ratio"], "ValueError", "not a multiple")
        _expected_error(e["bad_size"], "ValueError", "output_size", ">= 1")
        _expected_error(e["merged_bad_id"], "ValueError", "unknown loaded_shard_id 2")
        _expected_error(e["merged_wrong_block_shape"], "ValueError", str([MERGED[0], IN]), str([MERGED[1], IN]))
        _expected_error(e["qkv_bad_id"], "ValueError", "'x'", "'q'")
        _expected_error(e["qkv_k_as_q_shape"], "ValueError", str([HEADS * HEAD, IN]))
        _expected_error(e["rep_int_weight"], "TypeError", "floating point", "int64")
        _expected_error(e["rep_wrong_shape"], "ValueError", str([8, IN]), str([IN, 8]))
        _expected_error(e["rep_input_dtype"], "TypeError", "float16", "float32")
        _expected_error(e["rep_input_shape"], "ValueError", str(IN))


def test_weight_loader_converts_dtype_and_keeps_param_dtype() -> None:
    layer = ColumnParallelLinear(8, 6, bias=True, params_dtype=torch.float16)
    w = torch.randn(6, 8, dtype=torch.float64)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.weight.dtype == torch.float16
    assert torch.equal(layer.weight.data, w.to(torch.float16))
    b = torch.randn(6, dtype=torch.bfloat16)
    layer.bias.weight_loader(layer.bias, b)
    assert torch.equal(layer.bias.data, b.to(torch.float16))
