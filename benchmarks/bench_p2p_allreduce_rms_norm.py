"""Benchmark and check the one-shot peer-memory all-reduce + residual + RMSNorm backend.

``mtpspec.distributed.p2p_allreduce_rms_norm.P2PAllReduceRMSNorm`` against the exact fallback
(all-reduce + ``fused_add_rms_norm``) and the unfused arm (all-reduce, residual add in torch,
``rms_norm``), bf16, tokens 1 / 4 / 16 / 64 / 384 x hidden 4096 / 6144 / 7168, tp 2 and 4.

Modes (``--mode auto`` picks the first that fits the machine):

* ``multi-gpu``: tp ranks on tp GPUs of one host (NCCL for the fallback arms; the p2p kernel
  stores over NVLink through CUDA IPC mappings). Correctness, then latency of every arm,
  each captured in a CUDA graph of ``--iters`` calls (median over ``--repeats`` replays; the
  slowest rank's number is reported).
* ``shared-gpu``: tp ranks as processes on ONE GPU (NCCL refuses two ranks on one device, so
  gloo carries the fallback's all-reduce and the start-up handle exchange; the p2p buffers are
  shared with CUDA IPC). Proves the kernel correct on the GPU, eager and inside a CUDA graph.
  Kernels of different processes on one GPU are time-sliced (no MPS), so a rank's kernel spins
  until the scheduler runs the peers' kernels: the spin bound (``--timeout-s``, generous by
  default) and the error word make this safe (a stuck peer is an error, never a hang), but the
  p2p times printed in this mode measure the scheduler, not the kernel.
* ``--smoke``: tiny shapes, tp 2, on CPU under Triton's interpreter (or on the GPU if present),
  to prove the script runs.

Checks per shape: ``new_residual`` equals the fp32 rank-order reference bit for bit; ``normed``
within one bf16 ulp of the reference norm; both within bf16 rounding of the fallback ("fb"
columns: bf16 ulps of the magnitudes summed, since the fallback rounds once more); a rerun
bit-identical; every rank bit-identical (sha1 of the outputs); a CUDA graph replay (fresh inputs
copied into the captured tensors) bit-identical to eager; the error word clear. Finally a
fault test: the last rank never calls, the others must raise ``PeerTimeoutError`` after about
``--fault-timeout-s`` (the GPU clock bounds the wait), not hang.

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set before any rank starts; the kernel uses plain loads and stores.

Usage::

    python3 benchmarks/bench_p2p_allreduce_rms_norm.py                  # auto mode, tp 2 and 4
    python3 benchmarks/bench_p2p_allreduce_rms_norm.py --mode shared-gpu --tp 2 4
    python3 benchmarks/bench_p2p_allreduce_rms_norm.py --smoke          # CPU, seconds
    ... [--tokens 1 4 16 64 384] [--hidden 4096 6144 7168] [--out results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # inherited by the spawned ranks

import torch  # noqa: E402

if "--smoke" in sys.argv[1:] and not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels in Triton's interpreter on CPU

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.distributed as dist  # noqa: E402

from mtpspec.distributed import (get_tensor_model_parallel_rank, get_tp_group, launch,  # noqa: E402
                                 tensor_model_parallel_all_reduce)
from mtpspec.distributed.allreduce_rms_norm import NcclAllReduceThenAddRMSNorm  # noqa: E402
from mtpspec.distributed.p2p_allreduce_rms_norm import P2PAllReduceRMSNorm, PeerTimeoutError  # noqa: E402
from mtpspec.ops.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402

EPS = 1e-6
DTYPE = torch.bfloat16
BF16_ULP = 2.0 ** -7


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["auto", "multi-gpu", "shared-gpu"], default="auto")
    p.add_argument("--tp", type=int, nargs="+", default=None, help="tp sizes (default 2 4)")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, nargs="+", default=None)
    p.add_argument("--iters", type=int, default=None,
                   help="calls per captured graph (timing; default 50, 10 in shared-gpu mode)")
    p.add_argument("--repeats", type=int, default=None,
                   help="graph replays timed, median (default 20, 3 in shared-gpu mode)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="p2p spin bound (default 120 s shared-gpu, 10 s multi-gpu)")
    p.add_argument("--fault-timeout-s", type=float, default=0.5, help="spin bound of the fault test")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-fault-test", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, tp 2 (CPU interpreter without a GPU)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.tp = args.tp or [2]
        args.tokens = args.tokens or [1, 4, 6]
        args.hidden = args.hidden or [64, 96]
        args.iters, args.repeats = args.iters or 3, args.repeats or 2
    args.tp = args.tp or [2, 4]
    args.tokens = args.tokens or [1, 4, 16, 64, 384]
    args.hidden = args.hidden or [4096, 6144, 7168]
    return args


def pick_mode(args: argparse.Namespace, tp: int) -> str:
    """``multi-gpu`` / ``shared-gpu`` / ``cpu`` for this tp on this machine."""
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("no GPU: run with --smoke (CPU interpreter) or on a GPU machine")
        return "cpu"
    if args.mode != "auto":
        if args.mode == "multi-gpu" and torch.cuda.device_count() < tp:
            raise SystemExit(f"--mode multi-gpu needs {tp} GPUs, found {torch.cuda.device_count()}")
        return args.mode
    return "multi-gpu" if torch.cuda.device_count() >= tp else "shared-gpu"


# ------------------------------------------------------------------------------------------
# Rank side
# ------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sha(*ts: torch.Tensor) -> str:
    h = hashlib.sha1()
    for t in ts:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _inputs(seed: int, tp: int, n: int, hidden: int, device: torch.device):
    """All ranks' partial sums ``[tp, n, hidden]``, residual ``[n, hidden]``, weight ``[hidden]``
    (bf16, the same on every rank: generated on the CPU from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    parts = (torch.randn(tp, n, hidden, generator=g) * 3).to(DTYPE)
    residual = (torch.randn(n, hidden, generator=g) * 10).to(DTYPE)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(DTYPE)
    return parts.to(device), residual.to(device), weight.to(device)


def _exact(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    """fp32 sum in rank order + residual, rounded once; norm of the rounded sum (the contract)."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    s = (acc + residual.float()).to(parts.dtype)
    return rms_norm(s, weight, EPS), s


def _max_ulps(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """Largest ``|a - b|`` in bf16 ulps of ``scale`` (default ``|b|``); 0 when equal."""
    d = (a.float() - b.float()).abs()
    scale = b.float().abs() if scale is None else scale
    return float((d / (scale.clamp_min(1e-30) * BF16_ULP)).max().item()) if d.numel() else 0.0


def _fallback_errors(y, s, y_fb, s_fb, parts, residual, weight) -> tuple:
    """Differences from the fallback, in bf16 ulps of the magnitudes summed (the fallback rounds
    the all-reduced sum before the residual add: one more rounding of ``|sum|``, which under
    cancellation can be much larger than ``|s|``)."""
    mag = parts.float().abs().sum(0) + residual.float().abs()
    rstd = torch.rsqrt(s_fb.float().pow(2).mean(-1, keepdim=True) + EPS)
    return (_max_ulps(s, s_fb, mag),
            _max_ulps(y, y_fb, y_fb.float().abs() + rstd * weight.float().abs() * mag))


def _graph(fn: Callable[[], Any], iters: int):
    """Capture ``iters`` calls of ``fn`` (after a warm-up call on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(graph):
        for _ in range(iters):
            outs.append(fn())
    return graph, outs


def _time_graph(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``fn`` replayed in a CUDA graph of ``iters`` calls."""
    graph, _ = _graph(fn, iters)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def _time_eager(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call (host wall clock; CPU smoke only)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(samples)


def _rank_main(cfg: Dict[str, Any]) -> Dict[str, Any]:
    rank = get_tensor_model_parallel_rank()
    tp = get_tp_group().world_size
    device = get_tp_group().device
    gpu = device.type == "cuda"
    max_bytes = max(cfg["tokens"]) * max(cfg["hidden"]) * torch.tensor([], dtype=DTYPE).element_size()
    t0 = time.monotonic()
    p2p = P2PAllReduceRMSNorm(max_bytes, timeout_s=cfg["timeout_s"])
    out: Dict[str, Any] = {"rank": rank, "device": str(device), "setup_s": time.monotonic() - t0,
                           "error_word_on_host": p2p.error_word_on_host, "checks": [], "times": []}
    fallback = NcclAllReduceThenAddRMSNorm()

    # Correctness, eager and graphed.
    for hidden in cfg["hidden"]:
        for n in cfg["tokens"]:
            seed = 1000 * hidden + n
            parts, residual, weight = _inputs(seed, tp, n, hidden, device)
            x = parts[rank].clone()
            y, s = p2p(x, residual, weight, EPS)
            y2, s2 = p2p(x, residual, weight, EPS)
            y_ref, s_ref = _exact(parts, residual, weight)
            y_fb, s_fb = fallback(x, residual, weight, EPS)
            fb_s, fb_y = _fallback_errors(y, s, y_fb, s_fb, parts, residual, weight)
            rec = {"hidden": hidden, "tokens": n,
                   "residual_exact": bool(torch.equal(s, s_ref)),
                   "normed_ulps_vs_exact": _max_ulps(y, y_ref),
                   "residual_ulps_vs_fallback": fb_s,
                   "normed_ulps_vs_fallback": fb_y,
                   "rerun_identical": bool(torch.equal(y, y2) and torch.equal(s, s2)),
                   "sha": _sha(y, s)}
            if gpu and cfg["graphs"]:
                # Capture with static inputs, then replay on other inputs copied in.
                static_x, static_res = x.clone(), residual.clone()
                graph, outs = _graph(lambda: p2p(static_x, static_res, weight, EPS), 1)
                parts2, residual2, _ = _inputs(seed + 1, tp, n, hidden, device)
                static_x.copy_(parts2[rank])
                static_res.copy_(residual2)
                graph.replay()
                gy, gs = outs[0]
                ey, es = p2p(parts2[rank].clone(), residual2, weight, EPS)
                ry, rs = _exact(parts2, residual2, weight)
                _sync(device)
                rec["graph_identical"] = bool(torch.equal(gy, ey) and torch.equal(gs, es)
                                              and torch.equal(gs, rs))
            _sync(device)
            out["checks"].append(rec)
    p2p.check_error()
    out["guards_intact"] = p2p.guards_intact()
    out["calls"] = p2p.calls

    # Latency (graphed on GPU).
    if cfg["timing"]:
        for hidden in cfg["hidden"]:
            for n in cfg["tokens"]:
                parts, residual, weight = _inputs(7 + hidden + n, tp, n, hidden, device)
                x = parts[rank].clone()

                def unfused():
                    r = tensor_model_parallel_all_reduce(x)
                    return rms_norm(r + residual, weight, EPS)

                arms: Dict[str, Callable[[], Any]] = {"p2p": lambda: p2p(x, residual, weight, EPS)}
                if cfg["time_collectives"]:
                    arms["allreduce+fused_add_rms_norm"] = lambda: fallback(x, residual, weight, EPS)
                    arms["unfused"] = unfused
                row: Dict[str, Any] = {"hidden": hidden, "tokens": n}
                for name, fn in arms.items():
                    if gpu:
                        row[name] = _time_graph(fn, cfg["iters"], cfg["repeats"])
                    else:
                        row[name] = _time_eager(fn, cfg["iters"], cfg["repeats"])
                out["times"].append(row)
        p2p.check_error()

    # Fault test: the last rank never calls; the others must get PeerTimeoutError, not hang.
    if cfg["fault_test"]:
        # The GPU clock should end the wait after fault_timeout_s; the spin cap (>= 0.5 s at any
        # plausible spin rate) only keeps a broken clock from hanging the script.
        lonely = P2PAllReduceRMSNorm(max_bytes, timeout_s=cfg["fault_timeout_s"],
                                     max_spins=50_000_000 if gpu else 200)
        dist.barrier()
        fault: Dict[str, Any] = {"absent": rank == tp - 1}
        if rank != tp - 1:
            parts, residual, weight = _inputs(5, tp, 4, cfg["hidden"][0], device)
            t0 = time.monotonic()
            try:
                y, _ = lonely(parts[rank].clone(), residual, weight, EPS)
                lonely.check_error()  # CUDA: the kernel reports through the error word
                fault["raised"] = None
                fault["nan_outputs"] = bool(torch.isnan(y).all().item())
            except PeerTimeoutError as exc:
                fault["raised"] = str(exc)
            fault["seconds"] = time.monotonic() - t0
        dist.barrier()
        out["fault"] = fault
    _sync(device)
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------

def _run_tp(args: argparse.Namespace, tp: int) -> Dict[str, Any]:
    mode = pick_mode(args, tp)
    timeout_s = args.timeout_s if args.timeout_s is not None else (10.0 if mode == "multi-gpu" else 120.0)
    cfg = {"tokens": args.tokens, "hidden": args.hidden, "timeout_s": timeout_s,
           "graphs": mode != "cpu", "timing": not args.no_timing,
           # gloo collectives cannot be captured in CUDA graphs; time them only with NCCL (or CPU).
           "time_collectives": mode in ("multi-gpu", "cpu"),
           "iters": args.iters or (50 if mode == "multi-gpu" else 10),
           "repeats": args.repeats or (20 if mode == "multi-gpu" else 3),
           "fault_test": not args.no_fault_test,
           "fault_timeout_s": args.fault_timeout_s}
    backend = "nccl" if mode == "multi-gpu" else "gloo"
    t0 = time.monotonic()
    results = launch(_rank_main, tp, cfg, backend=backend, timeout_s=3600.0, dist_timeout_s=600.0)
    return {"tp": tp, "mode": mode, "backend": backend, "wall_s": time.monotonic() - t0,
            "timeout_s": timeout_s, "ranks": results}


def _summarise(run: Dict[str, Any]) -> Dict[str, Any]:
    """Correctness verdicts over all ranks and shapes; the slowest rank's times."""
    ranks = run["ranks"]
    rows, ok = [], True
    for i, rec in enumerate(ranks[0]["checks"]):
        same_ranks = len({r["checks"][i]["sha"] for r in ranks}) == 1
        worst = {k: max(r["checks"][i][k] for r in ranks)
                 for k in ("normed_ulps_vs_exact", "residual_ulps_vs_fallback", "normed_ulps_vs_fallback")}
        flags = {k: all(r["checks"][i].get(k, True) for r in ranks)
                 for k in ("residual_exact", "rerun_identical", "graph_identical")}
        good = (same_ranks and all(flags.values()) and worst["normed_ulps_vs_exact"] <= 1.0
                and worst["residual_ulps_vs_fallback"] <= 2.0 and worst["normed_ulps_vs_fallback"] <= 4.0)
        ok &= good
        rows.append(dict(hidden=rec["hidden"], tokens=rec["tokens"], ranks_identical=same_ranks,
                         **flags, **worst, ok=good))
    ok &= all(r["guards_intact"] for r in ranks)
    times = []
    for i, rec in enumerate(ranks[0]["times"]):
        row = {"hidden": rec["hidden"], "tokens": rec["tokens"]}
        for k in rec:
            if k not in ("hidden", "tokens"):
                row[k] = max(r["times"][i][k] for r in ranks)
        times.append(row)
    fault = [r.get("fault") for r in ranks]
    fault_ok = None
    if all(f is not None for f in fault):
        fault_ok = all(f["absent"] or (f["raised"] and "gave up waiting for rank" in f["raised"])
                       for f in fault)
    return {"ok": ok, "rows": rows, "times": times, "fault_ok": fault_ok, "fault": fault}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    report: Dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "runs": []}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
        report["gpus"] = torch.cuda.device_count()
    for tp in args.tp:
        run = _run_tp(args, tp)
        run["summary"] = _summarise(run)
        report["runs"].append(run)
        s = run["summary"]
        print(f"\n== tp {tp}: mode {run['mode']} (collectives: {run['backend']}), "
              f"{run['wall_s']:.1f} s, spin bound {run['timeout_s']:g} s, error word on host: "
              f"{all(r['error_word_on_host'] for r in run['ranks'])}")
        print(f"{'hidden':>6} {'tok':>4} {'s==exact':>8} {'y ulps':>6} {'fb s/y ulps':>11} "
              f"{'rerun':>5} {'ranks':>5} {'graph':>5} {'ok':>3}")
        for r in s["rows"]:
            print(f"{r['hidden']:>6} {r['tokens']:>4} {str(r['residual_exact']):>8} "
                  f"{r['normed_ulps_vs_exact']:>6.2f} {r['residual_ulps_vs_fallback']:>5.2f}/"
                  f"{r['normed_ulps_vs_fallback']:<5.2f} {str(r['rerun_identical']):>5} "
                  f"{str(r['ranks_identical']):>5} {str(r['graph_identical']) if run['mode'] != 'cpu' else '-':>5} "
                  f"{'yes' if r['ok'] else 'NO':>3}")
        if s["times"]:
            arms = [k for k in s["times"][0] if k not in ("hidden", "tokens")]
            note = "" if run["mode"] == "multi-gpu" else \
                "  (NOT kernel latency: " + ("CPU interpreter" if run["mode"] == "cpu" else
                                              "processes time-sliced on one GPU") + ")"
            print(f"latency, us per call, slowest rank{' (CUDA graphs)' if run['mode'] != 'cpu' else ''}{note}")
            print(f"{'hidden':>6} {'tok':>4} " + " ".join(f"{a:>28}" for a in arms)
                  + (f" {'p2p speedup':>11}" if len(arms) > 1 else ""))
            for r in s["times"]:
                line = f"{r['hidden']:>6} {r['tokens']:>4} " + " ".join(f"{r[a]:>28.1f}" for a in arms)
                if len(arms) > 1:
                    line += f" {r[arms[1]] / r['p2p']:>10.2f}x"
                print(line)
        if s["fault_ok"] is not None:
            secs = [f.get("seconds") for f in s["fault"] if not f["absent"]]
            print(f"fault test (last rank absent): {'PeerTimeoutError raised' if s['fault_ok'] else 'FAILED'}"
                  f" after {max(secs):.2f} s" + ("" if s["fault_ok"] else f": {s['fault']}"))
        print(f"correctness: {'PASS' if s['ok'] else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    ok = all(r["summary"]["ok"] and r["summary"]["fault_ok"] is not False for r in report["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
