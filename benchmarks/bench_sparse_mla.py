"""Benchmark DeepSeek Sparse Attention's GPU ops against their roofline floors: sparse MLA
decode / verify and the lightning indexer (logits + top-k).

Workload (issue 15): ``--seqs`` sequences (64) of ``--context`` tokens (32,768) in a paged cache
(``--block-size`` 64, MLA models' default; blocks shuffled), 1 and 4 (= 1 + k) query tokens per
sequence (the last ``q`` positions), bf16.

* Sparse MLA (:func:`mtpspec.ops.sparse_mla_attention.sparse_mla_attention`, split combine
  included), 16 heads (DeepSeek-V3.2 at tp 8) and 128 (tp 1), kv_lora_rank 512 + rope 64, each row
  with its own ``--topk`` (2,048) positions, drawn at random from its causal context (through
  :func:`indexer_topk` of random logits and :func:`positions_to_slots`: rows of one sequence
  share few positions, the worst case for L2). Floor = ``max(bytes / read bandwidth, FLOPs / bf16
  matmul rate)``: bytes = the gathered latent rows counted once PER QUERY ROW (2,048 x 1,152 B:
  each program gathers its own row's selection, rows of the 4 queries of a sequence are not
  assumed shared; ``unique_bytes`` beside it counts each sequence's union once, a floor only a
  kernel sharing rows across queries could reach) + queries, outputs and slots; FLOPs = ``2 *
  heads * (512 + 64 + 512)`` per (query row, selected entry). Side by side: the torch reference
  eagerly and under ``torch.compile`` (graph replay), and dense :func:`mla_attention` over the
  whole context (what the selection saves).
* Indexer (:func:`mtpspec.ops.indexer.indexer_logits`, then :func:`indexer_topk`),
  ``--index-heads`` 64 x ``--index-dim`` 128 (DeepSeek-V3.2): floor = ``max((key bytes of each
  sequence's context, read once + logits written + queries) / bandwidth, 2 * index_heads *
  index_dim per causal (row, key) pair / matmul rate)``; its torch reference eager and compiled.

Timings are medians of CUDA-graph replays (``benchmarks/_timing.Timer``), each synchronised, and
beside them (``queued_ms``) the mean of replays queued back to back (the graph launch's latency
hidden, as inside an engine step); bandwidth = the larger
of a 4 GiB ``x.sum()`` and a device copy's read rate, matmul rate = a bf16 8192^3 ``torch.mm``
(both from bench_mla_attention). Each kernel is checked against its torch reference first.

Usage: ``python3 benchmarks/bench_sparse_mla.py [--out sparse.json] [--sweep] [--no-compile]
[--no-dense] [--heads 16,128] [--query-lens 1,4]``; ``--smoke`` runs tiny shapes on the CPU
(kernels under Triton's interpreter, torch.compile with the eager backend).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton's interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import Timer, fmt, read_bandwidth  # noqa: E402
from benchmarks.bench_mla_attention import copy_read_bandwidth, git_commit, matmul_rate, time_graph  # noqa: E402
import mtpspec.ops.indexer as ix  # noqa: E402
import mtpspec.ops.mla_attention as mla  # noqa: E402
import mtpspec.ops.sparse_mla_attention as sp  # noqa: E402
from mtpspec.ops.argmax import num_sms  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence, query tokens included")
    p.add_argument("--topk", type=int, default=2048, help="index_topk")
    p.add_argument("--query-lens", default="1,4")
    p.add_argument("--heads", default="16,128")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim (softmax scale)")
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64, help="cache block size (MLA models: 64 by default)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--check-seqs", type=int, default=2, help="sequences checked against the torch reference")
    p.add_argument("--sweep", action="store_true", help="time the kernels over launch configurations")
    p.add_argument("--impls", default="triton,gluon,gluon-km",
                   help="sparse kernels timed side by side (sparse_mla_attention's impl=...; 'gluon' where supported, "
                        "'gluon-km' at <= 32 heads)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-indexer", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter) to test the script")
    a = p.parse_args(argv)
    if a.smoke:
        a.seqs, a.context, a.topk, a.heads, a.kv_lora_rank, a.rope = 2, 40, 16, "2,4", 32, 16
        a.index_heads, a.index_dim, a.iters, a.block_size = 4, 16, 1, 8
    return a


class Paged:
    """Shuffled block tables of ``seqs`` x ``context`` tokens and the decode / verify metadata."""

    def __init__(self, a: argparse.Namespace, q: int, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        b, s, bs = a.seqs, a.context, a.block_size
        per_seq = -(-s // bs)
        self.num_blocks = b * per_seq
        self.block_tables = torch.randperm(self.num_blocks, generator=g).view(b, per_seq).to(torch.int32).to(device)
        self.t = b * q
        self.query_start_loc = torch.arange(0, self.t + 1, q, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
        self.token_seq = torch.arange(b, device=device).repeat_interleave(q).to(torch.int32)
        self.positions = (s - q + torch.arange(q, device=device)).repeat(b)  # [T]
        self.q, self.s = q, s


def random_selection(a: argparse.Namespace, pg: Paged, device: torch.device) -> torch.Tensor:
    """Each row's ``topk`` random causal positions (top-k of random logits), as cache slots."""
    g = torch.Generator(device=device).manual_seed(1)
    logits = torch.rand(pg.t, pg.s, generator=g, device=device)
    logits[torch.arange(pg.s, device=device)[None, :] > pg.positions[:, None]] = float("-inf")
    pos = ix.indexer_topk(logits, a.topk)
    return sp.positions_to_slots(pos, pg.token_seq, pg.block_tables, a.block_size)


def compiled(fn: Callable[..., Any], args: tuple, smoke: bool, timer: Timer) -> Dict[str, Any]:
    """torch.compile of a torch reference, graph replay; its error against the eager reference."""
    try:
        fn_c = torch.compile(fn, backend="eager" if smoke else "inductor", dynamic=False)
        call = lambda: fn_c(*args)  # noqa: E731
        got, ref = call().float(), fn(*args).float()
        fin = torch.isfinite(ref)
        out = time_graph(timer, call)
        out["max_abs_err_vs_ref"] = float((got[fin] - ref[fin]).abs().max()) if fin.any() else 0.0
        return out
    except Exception as exc:  # noqa: BLE001 - report, keep going (e.g. out of memory)
        return {"ms": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def best_of(timer: Timer, grid: List[Dict[str, Any]], make: Callable[..., Callable[[], Any]]) -> List[Dict[str, Any]]:
    rows = []
    for cfg in grid:
        try:
            fn = make(**cfg)
            fn()
            rows.append(dict(cfg, ms=time_graph(timer, fn)["ms"]))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
            rows.append(dict(cfg, ms=None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"))
    return rows


def bench_sparse(a, heads: int, q: int, device, dtype, timer: Timer, bw: float, mm: float) -> Dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(2)
    pg = Paged(a, q, device)
    r, rope = a.kv_lora_rank, a.rope
    cache = (torch.randn(pg.num_blocks, a.block_size, r + rope, generator=g) * 0.5).to(dtype).to(device)
    ql = torch.randn(pg.t, heads, r, generator=g).to(dtype).to(device)
    qp = torch.randn(pg.t, heads, rope, generator=g).to(dtype).to(device)
    slots = random_selection(a, pg, device)
    scale = (a.nope + rope) ** -0.5
    elem = cache.element_size()
    valid = int((slots >= 0).sum())
    unique = sum(int(torch.unique(slots[i * q:(i + 1) * q]).ge(0).sum()) for i in range(a.seqs))
    row: Dict[str, Any] = dict(heads=heads, q=q, rows=pg.t, topk=a.topk,
                               plan=sp.sparse_mla_attention_plan(pg.t, heads, a.topk, num_sms(device)))
    row["gathered_bytes"] = valid * (r + rope) * elem
    row["unique_bytes"] = unique * (r + rope) * elem
    row["io_bytes"] = pg.t * heads * (2 * r + rope) * elem + slots.numel() * 4
    row["flops"] = 2 * heads * valid * (2 * r + rope)
    n = min(a.check_seqs, a.seqs) * q
    args_n = (ql[:n], qp[:n], cache, slots[:n], scale)
    row["max_abs_err"] = float((sp.sparse_mla_attention(*args_n).float()
                                - sp.sparse_mla_attention_ref(*args_n).float()).abs().max())
    args = (ql, qp, cache, slots, scale)
    k = time_graph(timer, lambda: sp.sparse_mla_attention(*args))
    row["kernel_ms"], row["kernel_queued_ms"], row["kernel_timing"] = k["ms"], k["queued_ms"], k["timing"]
    mem_ms = (row["gathered_bytes"] + row["io_bytes"]) / bw * 1e3
    cmp_ms = row["flops"] / mm * 1e3
    row.update(mem_floor_ms=mem_ms, compute_floor_ms=cmp_ms, floor_ms=max(mem_ms, cmp_ms),
               bound="memory" if mem_ms >= cmp_ms else "compute", x_floor=row["kernel_ms"] / max(mem_ms, cmp_ms),
               unique_floor_ms=max((row["unique_bytes"] + row["io_bytes"]) / bw * 1e3, cmp_ms))
    row["impls"] = {}
    for impl in [x for x in a.impls.split(",") if x]:
        try:
            err = float((sp.sparse_mla_attention(*args_n, impl=impl).float()
                         - sp.sparse_mla_attention_ref(*args_n).float()).abs().max())
            tg = time_graph(timer, lambda: sp.sparse_mla_attention(*args, impl=impl))
            ms, qms = tg["ms"], tg["queued_ms"]
            row["impls"][impl] = dict(ms=ms, x_floor=ms / row["floor_ms"], queued_ms=qms,
                                      queued_x_floor=qms / row["floor_ms"], max_abs_err=err)
        except Exception as e:  # e.g. gluon on a GPU it does not support
            row["impls"][impl] = dict(error=f"{type(e).__name__}: {e}"[:300])
        print(f"  impl {impl}: {row['impls'][impl]}", flush=True)
    row["ref_eager_ms"] = timer.eager(lambda: sp.sparse_mla_attention_ref(*args))
    if not a.no_compile:
        row["compile_ref"] = compiled(sp.sparse_mla_attention_ref, args, a.smoke, timer)
    if not a.no_dense:
        dense_args = (ql, qp, cache, pg.query_start_loc, pg.seq_lens, pg.block_tables, scale, q, pg.s)
        row["dense_mla_ms"] = time_graph(timer, lambda: mla.mla_attention(*dense_args))["ms"]
    if a.sweep:
        bms = [m for m in (16, 32, 64) if m <= max(16, 1 << (heads - 1).bit_length())]
        grid = [dict(block_m=m, block_n=n, num_warps=w, num_splits=s)
                for m, n, w in itertools.product(bms, (32, 64), (4, 8))
                for s in sorted({row["plan"]["num_splits"], 2 * row["plan"]["num_splits"]})]
        row["sweep"] = best_of(timer, grid[:2] if a.smoke else grid,
                               lambda **cfg: (lambda: sp.sparse_mla_attention(*args, **cfg)))
    return row


def bench_indexer(a, q: int, device, dtype, timer: Timer, bw: float, mm: float) -> Dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(3)
    pg = Paged(a, q, device)
    nh, d = a.index_heads, a.index_dim
    cache = torch.randn(pg.num_blocks, a.block_size, d, generator=g).to(dtype).to(device)
    qx = torch.randn(pg.t, nh, d, generator=g).to(dtype).to(device)
    w = (torch.randn(pg.t, nh, generator=g) * nh ** -0.5 * d ** -0.5).to(device)
    meta = (pg.query_start_loc, pg.seq_lens, pg.block_tables, q, pg.s)
    elem = cache.element_size()
    pairs = a.seqs * sum(pg.s - q + j + 1 for j in range(q))
    row: Dict[str, Any] = dict(q=q, rows=pg.t, index_heads=nh, index_dim=d, topk=a.topk,
                               key_bytes=a.seqs * pg.s * d * elem, logits_bytes=pg.t * pg.s * 4,
                               q_bytes=pg.t * nh * (d * elem + 4), flops=2 * nh * d * pairs)
    n = min(a.check_seqs, a.seqs)
    meta_n = (pg.query_start_loc[:n + 1], pg.seq_lens[:n], pg.block_tables[:n], q, pg.s)
    got = ix.indexer_logits(qx[:n * q], w[:n * q], cache, *meta_n)
    ref = ix.indexer_logits_ref(qx[:n * q], w[:n * q], cache, *meta_n)
    fin = torch.isfinite(ref)
    row["max_abs_err"] = float((got[fin] - ref[fin]).abs().max())
    row["same_inf"] = bool(torch.equal(torch.isinf(got), torch.isinf(ref)))
    row["same_topk"] = bool(torch.equal(ix.indexer_topk(got, a.topk), ix.indexer_topk(ref, a.topk)))
    args = (qx, w, cache) + meta
    logits = ix.indexer_logits(*args)
    row["kernel_ms"] = time_graph(timer, lambda: ix.indexer_logits(*args))["ms"]
    row["topk_ms"] = time_graph(timer, lambda: ix.indexer_topk(logits, a.topk))["ms"]
    row["logits_topk_ms"] = time_graph(timer, lambda: ix.indexer_topk(ix.indexer_logits(*args), a.topk))["ms"]
    mem_ms = (row["key_bytes"] + row["logits_bytes"] + row["q_bytes"]) / bw * 1e3
    cmp_ms = row["flops"] / mm * 1e3
    row.update(mem_floor_ms=mem_ms, compute_floor_ms=cmp_ms, floor_ms=max(mem_ms, cmp_ms),
               bound="memory" if mem_ms >= cmp_ms else "compute", x_floor=row["kernel_ms"] / max(mem_ms, cmp_ms))
    row["ref_eager_ms"] = timer.eager(lambda: ix.indexer_logits_ref(*args))
    if not a.no_compile:
        row["compile_ref"] = compiled(ix.indexer_logits_ref, args, a.smoke, timer)
    if a.sweep:
        grid = [dict(keys_per_program=kp, block_n=n, num_warps=wp)
                for kp, n, wp in itertools.product((256, 512, 1024, 2048), (32, 64, 128), (4, 8)) if n <= kp]
        row["sweep"] = best_of(timer, grid[:2] if a.smoke else grid,
                               lambda **cfg: (lambda: ix.indexer_logits(*args, **cfg)))
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16
    timer = Timer(device, a.iters, warmup=0 if a.smoke else 3)
    t0 = time.time()
    bw_sum = read_bandwidth(device, cpu_bytes=8 << 20)
    bw_copy = copy_read_bandwidth(device, (4 << 30) if device.type == "cuda" else (8 << 20))
    bw = max(bw_sum, bw_copy)
    mm = matmul_rate(device, 8192 if device.type == "cuda" else 256)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}: read {bw_sum / 1e9:.0f} GB/s (x.sum), {bw_copy / 1e9:.0f} GB/s (copy reads); "
          f"bf16 matmul {mm / 1e12:.1f} TFLOP/s")

    def best(row: Dict[str, Any]) -> str:
        ok = [r for r in row.get("sweep", []) if r.get("ms") is not None]
        if not ok:
            return ""
        b = min(ok, key=lambda r: r["ms"])
        row["sweep_best"], row["sweep_best_x_floor"] = b, b["ms"] / row["floor_ms"]
        return f"; sweep best {fmt(b['ms'])} ms ({row['sweep_best_x_floor']:.2f}x) {b}"

    sparse, indexer = [], []
    for heads in [int(x) for x in a.heads.split(",")]:
        for q in [int(x) for x in a.query_lens.split(",")]:
            row = bench_sparse(a, heads, q, device, dtype, timer, bw, mm)
            sparse.append(row)
            print(f"sparse H={heads:4d} q={q}: kernel {fmt(row['kernel_ms'])} ms ({row['kernel_timing']}; queued "
                  f"{fmt(row['kernel_queued_ms'])}), floor "
                  f"{fmt(row['floor_ms'])} ms ({row['bound']}; mem {fmt(row['mem_floor_ms'])}, compute "
                  f"{fmt(row['compute_floor_ms'])}), x floor {row['x_floor']:.2f} (unique-rows floor "
                  f"{fmt(row['unique_floor_ms'])}); err {row['max_abs_err']:.2e}; ref eager "
                  f"{fmt(row['ref_eager_ms'])} ms, compiled {fmt((row.get('compile_ref') or {}).get('ms'))} ms; "
                  f"dense MLA {fmt(row.get('dense_mla_ms'))} ms" + best(row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not a.no_indexer:
        for q in [int(x) for x in a.query_lens.split(",")]:
            row = bench_indexer(a, q, device, dtype, timer, bw, mm)
            indexer.append(row)
            print(f"indexer q={q}: logits {fmt(row['kernel_ms'])} ms, floor {fmt(row['floor_ms'])} ms ({row['bound']}; "
                  f"mem {fmt(row['mem_floor_ms'])}, compute {fmt(row['compute_floor_ms'])}), x floor "
                  f"{row['x_floor']:.2f}; top-k {fmt(row['topk_ms'])} ms, both {fmt(row['logits_topk_ms'])} ms; err "
                  f"{row['max_abs_err']:.2e}, same -inf {row['same_inf']}, same top-k {row['same_topk']}; ref eager "
                  f"{fmt(row['ref_eager_ms'])} ms, compiled {fmt((row.get('compile_ref') or {}).get('ms'))} ms"
                  + best(row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in sparse + indexer:
        if (row.get("compile_ref") or {}).get("error"):
            print(f"  compile_ref: {row['compile_ref']['error']}")
    out = {"device": name, "smoke": a.smoke, "torch": torch.__version__, "commit": git_commit(), "args": vars(a),
           "read_bandwidth_sum": bw_sum, "read_bandwidth_copy": bw_copy, "read_bandwidth": bw, "bf16_matmul_flops": mm,
           "defaults": dict(sparse=dict(block_m=sp.BLOCK_M, block_n=sp.BLOCK_N, num_warps=sp.NUM_WARPS,
                                        num_stages=sp.NUM_STAGES),
                            indexer=dict(block_n=ix.BLOCK_N, keys_per_program=ix.KEYS_PER_PROGRAM,
                                         num_warps=ix.NUM_WARPS, num_stages=ix.NUM_STAGES)),
           "sparse": sparse, "indexer": indexer, "seconds": time.time() - t0}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
