"""Draft-step collectives at tp > 1: full-logits argmax vs ``get_top_tokens``, unfused vs fused MTP tail.

Issue 7's draft-step micro-benchmark. For each tp in ``--tp`` (default 2 4 8; one GPU per rank,
NCCL) and each sequence count in ``--seqs`` (default 1 64), bf16, vocab ``--vocab`` (151552),
hidden ``--hidden`` (4096):

* logits: a ``ParallelLMHead`` with random weights loaded through its ``weight_loader``;
  ``LogitsProcessor.compute_logits(lm_head, h).argmax(-1)`` (all-gather of every rank's
  ``[seqs, vocab / tp]`` logits) against ``LogitsProcessor.get_top_tokens(lm_head, h)`` (all-gather
  of ``[seqs, 2]`` float64 pairs). Both include the local LM-head matmul.
* tail: the MTP layer's tail, ``RMSNorm(tensor_model_parallel_all_reduce(h), residual)`` (the
  baseline arm) against ``fused_allreduce_rms_norm(h, residual, norm)`` with the backend the
  dispatcher picks (the NCCL fallback unless one is registered), and on GPUs also with the
  one-shot peer-memory backend ``P2PAllReduceRMSNorm`` registered (``--no-p2p`` drops it).

Before timing, on every rank: the two logits paths' ids are exactly equal and equal on every
rank; each tail path's ``new_residual`` is within bf16 rounding of the float64 sum of the ranks'
partials plus the residual (``(tp + 1)`` roundings of at most ``2**-8`` of the summed magnitudes:
NCCL reduces bf16 in steps), and its ``normed`` within two bf16 roundings of the float64 RMSNorm of
that ``new_residual``. Any failure raises.

Timing: eager (CUDA events around ``--iters`` back-to-back calls; median of ``--repeats``) and
CUDA-graphed (every rank captures a graph of ``--iters`` calls with NCCL inside, then all ranks
replay in lockstep after a barrier; median of ``--repeats`` replays). The slowest rank's median is
reported. ``NCCL floor``: the bare ``torch.distributed`` collective the path issues, at exactly its
size (all-gather of the logits shard / of the pairs; all-reduce of ``[seqs, hidden]`` bf16), timed
the same way (graphed on GPU). ``bytes/rank``: bytes this rank sent in one call, from
``mtpspec.distributed.comm_stats()`` (the P2P backend bypasses the counters: its bytes are
``(tp - 1) * seqs * hidden * 2`` pushed to peers, shown with a ``*``).

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set before any rank starts. Asking for more ranks than GPUs is
refused at once (exit 2) rather than left to hang.

``--smoke`` proves the script on CPU: gloo ranks (tp 2 and 3), vocab 1000, hidden 64, no graphs,
torch references for the kernels; times there are CPU times, not GPU latencies.

Usage::

    python3 benchmarks/bench_draft_collectives.py [--tp 2 4 8] [--seqs 1 64] [--hidden 4096]
        [--vocab 151552] [--iters 50] [--repeats 30] [--no-p2p] [--out result.json]
    python3 benchmarks/bench_draft_collectives.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # inherited by the spawned ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mtpspec.distributed import (comm_stats, get_tensor_model_parallel_rank, get_tp_group,  # noqa: E402
                                 launch, reset_comm_stats, tensor_model_parallel_all_gather,
                                 tensor_model_parallel_all_reduce, total_comm_bytes)
from mtpspec.layers import LogitsProcessor, ParallelLMHead  # noqa: E402
from mtpspec.layers.layernorm import RMSNorm  # noqa: E402
from mtpspec.distributed.allreduce_rms_norm import (fused_allreduce_rms_norm,  # noqa: E402
                                            register_allreduce_rms_norm_backend, select_backend,
                                            unregister_allreduce_rms_norm_backend)

DTYPE = torch.bfloat16
EPS = 1e-5
BF16_HALF_ULP = 2.0 ** -8  # relative rounding error of one bf16 rounding


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=None, help="tp sizes (default 2 4 8; smoke 2 3)")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="sequences per draft step (default 1 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocab size (default 151552; smoke 1000)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096; smoke 64)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed run / captured graph (default 50)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median (default 30)")
    p.add_argument("--no-p2p", action="store_true", help="skip the peer-memory fused backend (GPU only anyway)")
    p.add_argument("--smoke", action="store_true", help="CPU gloo ranks, tiny shapes, no graphs")
    p.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit per tp size")
    p.add_argument("--out", help="write every row as JSON to this path")
    args = p.parse_args(argv)
    args.tp = args.tp or ([2, 3] if args.smoke else [2, 4, 8])
    args.seqs = args.seqs or [1, 64]
    args.vocab = args.vocab or (1000 if args.smoke else 151552)
    args.hidden = args.hidden or (64 if args.smoke else 4096)
    args.iters = args.iters or (5 if args.smoke else 50)
    args.repeats = args.repeats or (3 if args.smoke else 30)
    for name in ("tp", "seqs"):
        if any(v < 1 for v in getattr(args, name)):
            p.error(f"--{name} values must be >= 1, got {getattr(args, name)}")
    for name in ("vocab", "hidden", "iters", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def check_gpus(tps: Sequence[int], smoke: bool) -> Optional[str]:
    """Why the run cannot start (GPU mode needs a GPU per rank), or ``None`` when it can."""
    if smoke:
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return "no CUDA GPU found; use --smoke for the CPU run"
    too_big = [t for t in tps if t > n]
    if too_big:
        return (f"tp {too_big} needs that many GPUs (one per rank, NCCL) but this machine has {n}; "
                f"pass --tp with values <= {n}")
    return None


# ---------------------------------------------------------------------------------------------
# Timing (runs inside every rank; all ranks make the same calls in the same order).

def _barrier(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()
    dist.barrier()
    if gpu:
        torch.cuda.synchronize()


def time_eager(fn: Callable[[], Any], gpu: bool, iters: int, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` runs of ``iters`` back-to-back calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        _barrier(gpu)
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(samples)


def time_graph(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``fn`` captured ``iters`` times in one CUDA graph.

    Every rank captures (collectives included) and then replays in lockstep: a barrier before
    each replay, so a replay's time is not another rank's start-up skew.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    _barrier(True)
    graph.replay()
    samples = []
    for _ in range(repeats):
        _barrier(True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    _barrier(True)
    del graph
    return statistics.median(samples)


def measure(fn: Callable[[], Any], gpu: bool, cfg: Dict[str, Any]) -> Tuple[float, Optional[float]]:
    """``(eager us, graph us or None)`` for one path."""
    eager = time_eager(fn, gpu, cfg["iters"], cfg["repeats"])
    graphed = time_graph(fn, cfg["iters"], cfg["repeats"]) if gpu else None
    return eager, graphed


def bytes_of(fn: Callable[[], Any]) -> Tuple[int, Dict[str, Dict[str, int]]]:
    """Bytes this rank sends in one call of ``fn`` (``comm_stats`` counters) and the counters."""
    reset_comm_stats()
    fn()
    stats = comm_stats()
    reset_comm_stats()
    return total_comm_bytes(stats), stats


# ---------------------------------------------------------------------------------------------
# Raw NCCL / gloo collectives at the paths' sizes: the floor.

def all_gather_floor(local: torch.Tensor) -> Callable[[], Any]:
    """A bare all-gather of ``local`` (dim 0 concatenation), preallocated output."""
    g = get_tp_group()
    if g.backend == "nccl":
        out = torch.empty((g.world_size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                          device=local.device)
        return lambda: dist.all_gather_into_tensor(out, local, group=g.device_group)
    parts = [torch.empty_like(local) for _ in range(g.world_size)]
    return lambda: dist.all_gather(parts, local, group=g.device_group)


def all_reduce_floor(x: torch.Tensor) -> Callable[[], Any]:
    """A bare in-place all-reduce of a copy of ``x``."""
    buf = x.clone()
    return lambda: dist.all_reduce(buf, group=get_tp_group().device_group)


# ---------------------------------------------------------------------------------------------
# Correctness checks.

def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def check_ids(full_ids: torch.Tensor, top_ids: torch.Tensor, what: str) -> None:
    """Both paths' ids equal on this rank and equal on every rank. Raises ``AssertionError``."""
    if not torch.equal(full_ids, top_ids):
        bad = (full_ids != top_ids).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: get_top_tokens != compute_logits(...).argmax(-1) at rows {bad[:8]}: "
                             f"{top_ids[bad[:8]].tolist()} vs {full_ids[bad[:8]].tolist()}")
    every = tensor_model_parallel_all_gather(top_ids.unsqueeze(0), dim=0)
    if not bool((every == every[:1]).all()):
        raise AssertionError(f"{what}: ranks disagree on the ids: {every.tolist()}")


def check_tail(name: str, normed: torch.Tensor, new_res: torch.Tensor, parts64: torch.Tensor,
               residual: torch.Tensor, weight: torch.Tensor, tp: int) -> Dict[str, float]:
    """``new_res`` within ``(tp + 1)`` bf16 roundings of the exact sum, ``normed`` within two of the
    float64 norm of ``new_res``. ``parts64``: ``[tp, seqs, hidden]`` float64, every rank's partial.
    Returns the worst error / bound ratios; raises ``AssertionError`` above 1."""
    res64 = residual.double()
    exact = parts64.sum(0) + res64
    mag = parts64.abs().sum(0) + res64.abs()
    bound_s = (tp + 1) * BF16_HALF_ULP * mag + 1e-30
    s64 = new_res.double()
    ratio_s = float(((s64 - exact).abs() / bound_s).max())
    ref_n = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    bound_n = 2 * BF16_HALF_ULP * ref_n.abs() + 1e-6
    ratio_n = float(((normed.double() - ref_n).abs() / bound_n).max())
    if not (ratio_s <= 1.0 and ratio_n <= 1.0):
        raise AssertionError(f"{name}: outside bf16 rounding (new_residual error/bound {ratio_s:.3g}, "
                             f"normed error/bound {ratio_n:.3g})")
    return {"residual_err_over_bound": ratio_s, "normed_err_over_bound": ratio_n}


# ---------------------------------------------------------------------------------------------
# One rank's run.

def _rank_main(cfg: Dict[str, Any]) -> Dict[str, Any]:
    rank = get_tensor_model_parallel_rank()
    group = get_tp_group()
    tp, device = group.world_size, group.device
    gpu = device.type == "cuda"
    vocab, hidden = cfg["vocab"], cfg["hidden"]
    rows: List[Dict[str, Any]] = []
    checks: List[Dict[str, Any]] = []

    # LM head with random weights, the same full tensor on every rank, loaded through weight_loader.
    with torch.device(device):
        head = ParallelLMHead(vocab, hidden, params_dtype=DTYPE)
    full_w = torch.randn(vocab, hidden, generator=_gen(device, 1), device=device, dtype=torch.float32)
    head.weight.weight_loader(head.weight, (full_w / hidden ** 0.5).to(DTYPE))
    del full_w
    lp = LogitsProcessor(vocab)
    norm = RMSNorm(hidden, eps=EPS, params_dtype=DTYPE).to(device)
    norm.weight.weight_loader(norm.weight, 0.5 + torch.rand(hidden, generator=_gen(device, 2), device=device))

    p2p = None
    if gpu and cfg["p2p"]:
        from mtpspec.distributed.p2p_allreduce_rms_norm import P2PAllReduceRMSNorm
        p2p = P2PAllReduceRMSNorm(max(cfg["seqs"]) * hidden * torch.finfo(DTYPE).bits // 8, timeout_s=10.0)

    for n in cfg["seqs"]:
        h = torch.randn(n, hidden, generator=_gen(device, 100 + n), device=device).to(DTYPE)  # same on all ranks
        # Every rank's partial sum (each rank builds all of them: the float64 reference needs them).
        parts = torch.randn(tp, n, hidden, generator=_gen(device, 200 + n), device=device).to(DTYPE)
        my_part = parts[rank].contiguous()
        residual = torch.randn(n, hidden, generator=_gen(device, 300 + n), device=device).to(DTYPE)

        def full_path() -> torch.Tensor:
            return lp.compute_logits(head, h).argmax(-1)

        def top_path() -> torch.Tensor:
            return lp.get_top_tokens(head, h)

        def unfused_tail() -> Tuple[torch.Tensor, torch.Tensor]:
            return norm(tensor_model_parallel_all_reduce(my_part), residual)

        def fused_tail() -> Tuple[torch.Tensor, torch.Tensor]:
            return fused_allreduce_rms_norm(my_part, residual, norm)

        check_ids(full_path(), top_path(), f"tp {tp}, {n} seqs")
        parts64 = parts.double()
        tail_paths: List[Tuple[str, Callable[[], Any]]] = [
            ("tail unfused: all_reduce + RMSNorm", unfused_tail),
            (f"tail fused ({select_backend(my_part).name})", fused_tail)]
        tail_err = {name: check_tail(name, *fn(), parts64, residual, norm.weight, tp) for name, fn in tail_paths}
        if p2p is not None and p2p.accepts(my_part):
            register_allreduce_rms_norm_backend(p2p)
            try:
                name = f"tail fused ({p2p.name})"
                tail_err[name] = check_tail(name, *fused_tail(), parts64, residual, norm.weight, tp)
                p2p.check_error()
                tail_paths.append((name, fused_tail))
            finally:
                unregister_allreduce_rms_norm_backend(p2p)
        checks.append({"seqs": n, "ids_equal": True, "tail": tail_err})

        local_logits = torch.nn.functional.linear(h, head.weight)
        pairs = torch.zeros(1, n, 2, dtype=torch.float64, device=device)
        floors = {"logits": all_gather_floor(local_logits), "pairs": all_gather_floor(pairs),
                  "tail": all_reduce_floor(my_part)}
        floor_us = {k: measure(f, gpu, cfg) for k, f in floors.items()}
        paths = [("full logits + argmax", full_path, "logits"), ("get_top_tokens", top_path, "pairs")]
        paths += [(name, fn, "tail") for name, fn in tail_paths]
        for name, fn, floor in paths:
            is_p2p = p2p is not None and p2p.name in name
            if is_p2p:
                register_allreduce_rms_norm_backend(p2p)
            try:
                nbytes, stats = bytes_of(fn)
                if is_p2p:  # the peer-memory kernel does not go through the counters
                    nbytes, stats = (tp - 1) * n * hidden * 2, {"p2p_push": {"calls": 1}}
                eager, graphed = measure(fn, gpu, cfg)
                if is_p2p:
                    p2p.check_error()
            finally:
                if is_p2p:
                    unregister_allreduce_rms_norm_backend(p2p)
            rows.append({"tp": tp, "seqs": n, "path": name, "eager_us": eager, "graph_us": graphed,
                         "floor": floor, "floor_eager_us": floor_us[floor][0], "floor_graph_us": floor_us[floor][1],
                         "bytes_per_rank": nbytes, "bytes_estimated": is_p2p,
                         "calls": {op: s["calls"] for op, s in stats.items()}})
    if p2p is not None:
        _barrier(gpu)
        p2p.close()
    return {"rank": rank, "rows": rows, "checks": checks,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu", "backend": group.backend}


def combine(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rank 0's rows with every time replaced by the slowest rank's (per-rank figures kept)."""
    rows = [dict(r) for r in results[0]["rows"]]
    for i, row in enumerate(rows):
        for key in ("eager_us", "graph_us", "floor_eager_us", "floor_graph_us"):
            vals = [res["rows"][i][key] for res in results]
            row[key] = None if vals[0] is None else max(vals)
            row[key + "_per_rank"] = vals
    return rows


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(rows: List[Dict[str, Any]]) -> str:
    """The compact markdown table."""
    lines = ["| tp | seqs | path | eager us | graph us | NCCL floor us (eager / graph) | bytes/rank |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        b = f"{r['bytes_per_rank']}{'*' if r['bytes_estimated'] else ''}"
        lines.append(f"| {r['tp']} | {r['seqs']} | {r['path']} | {_fmt(r['eager_us'])} | {_fmt(r['graph_us'])} | "
                     f"{r['floor']}: {_fmt(r['floor_eager_us'])} / {_fmt(r['floor_graph_us'])} | {b} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    why = check_gpus(args.tp, args.smoke)
    if why:
        print(f"bench_draft_collectives: refusing to start: {why}", file=sys.stderr)
        return 2
    backend = "gloo" if args.smoke else "nccl"
    cfg = {k: getattr(args, k) for k in ("seqs", "vocab", "hidden", "iters", "repeats")}
    cfg["p2p"] = not args.no_p2p and not args.smoke
    report: Dict[str, Any] = {"torch": torch.__version__, "backend": backend, "config": cfg, "runs": []}
    all_rows: List[Dict[str, Any]] = []
    for tp in args.tp:
        t0 = time.monotonic()
        results = launch(_rank_main, tp, cfg, backend=backend, timeout_s=args.timeout_s, dist_timeout_s=120.0)
        rows = combine(results)
        all_rows += rows
        report["device"] = results[0]["device"]
        report["runs"].append({"tp": tp, "wall_s": time.monotonic() - t0, "rows": rows,
                               "checks": [res["checks"] for res in results]})
        print(f"tp {tp}: checks passed on every rank (ids equal, tails within bf16 rounding); "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\ndraft-step collectives, {report['device']}, {backend}, bf16, vocab {args.vocab}, hidden {args.hidden}; "
          f"times: slowest rank's median of {args.repeats} x {args.iters} calls"
          + (" (CPU, not GPU latency)" if args.smoke else ""))
    print(table(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
