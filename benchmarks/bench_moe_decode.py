"""Routed experts (`moe_experts`) at decode and verify sizes against their memory floor (issue 18).

At 1 to 16 tokens the expert GEMMs are memory-bound: the floor is the bytes of the experts the
batch routes to (each read once: gate, up and down rows, ``3 x H x I x elem``) over the measured
read bandwidth. Every figure is a CUDA-graph replay median; one graph replays ``--sets`` calls with
different random routings (so consecutive calls read different experts, far more than L2), and the
time per call is the replay over the sets. Side by side in one process: the kernels with the
pairs grouped by torch ops (the path before the one-program align), with the current defaults,
the torch reference (expert weights gathered, batched matmuls) eager-in-a-graph and under
``torch.compile``, and, with ``--sweep``, every launch shape of each kernel (the other at its
default).

    python3 benchmarks/bench_moe_decode.py --out moe.json            # H200: both shapes
    python3 benchmarks/bench_moe_decode.py --sweep --tokens 1,4,16   # launch shapes
    python3 benchmarks/bench_moe_decode.py --smoke                   # CPU, Triton interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Timer, read_bandwidth  # noqa: E402

from mtpspec.ops import moe_gemm  # noqa: E402

#: name: (experts, hidden, intermediate per rank, top_k)
SHAPES = {
    "air": (128, 4096, 1408, 8),  # GLM-4.5-Air, tp 1
    "dsv3": (256, 7168, 2048, 8),  # DeepSeek-V3, tp 1
    "dsv3-tp8": (256, 7168, 256, 8),  # DeepSeek-V3, one rank of tp 8
    "smoke": (8, 64, 48, 2),
}
SWEEP = [(bn, bk, w, st) for bn, bk in itertools.product((16, 32, 64), (64, 128, 256))
         for w, st in ((4, 3), (4, 4), (4, 5), (2, 4))]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="air,dsv3,dsv3-tp8")
    p.add_argument("--tokens", default="1,2,4,8,16,64")
    p.add_argument("--sets", type=int, default=8, help="routings per graph replay")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="time every launch shape of each kernel")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (Triton interpreter)")
    p.add_argument("--out", help="write results as JSON to this path")
    return p.parse_args(argv)


def per_call_ms(timer: Timer, fn: Callable[[int], Any], sets: int) -> Optional[float]:
    """Median ms per call of ``fn(set)`` over ``sets`` routings, replayed as one graph (eager on CPU)."""
    def all_sets() -> None:
        for s in range(sets):
            fn(s)
    if not timer.cuda:
        return timer.eager(all_sets) / sets
    ms, why = timer.graph(all_sets)
    return None if ms is None else ms / sets


def run_shape(name: str, a: argparse.Namespace, dev: torch.device, bw: float, timer: Timer) -> List[Dict]:
    e, h, i, k = SHAPES[name]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, dtype=dtype, device=dev) / h ** 0.5)
    w2 = (torch.randn(e, h, i, dtype=dtype, device=dev) / i ** 0.5)
    expert_bytes = 3 * h * i * w13.element_size()
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        ids = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev) for _ in range(a.sets)]
        tw = [torch.rand(t, k, generator=g).to(dev) for _ in range(a.sets)]
        xs = [torch.randn(t, h, generator=g).to(dtype).to(dev) for _ in range(a.sets)]
        unique = sum(int(x.unique().numel()) for x in ids) / a.sets
        floor_ms = (unique * expert_bytes + 2 * t * h * w13.element_size()) / bw * 1e3
        want = moe_gemm.moe_experts_ref(xs[0], w13, w2, tw[0], ids[0]).float()

        def op(**kw: Any) -> Callable[[int], Any]:
            return lambda s: moe_gemm.moe_experts(xs[s], w13, w2, tw[s], ids[s], **kw)

        def check(fn: Callable[[int], Any]) -> float:
            return float((fn(0).float() - want).abs().max())

        row: Dict[str, Any] = dict(shape=name, tokens=t, unique_experts=unique, floor_ms=floor_ms)
        keep = moe_gemm.ALIGN_KERNEL_MAX_PAIRS
        moe_gemm.ALIGN_KERNEL_MAX_PAIRS = 0  # the torch-ops grouping
        row["err_torch_align"] = check(op())
        row["torch_align_ms"] = per_call_ms(timer, op(), a.sets)
        row["align_torch_only_ms"] = per_call_ms(
            timer, lambda s: moe_gemm.moe_align(ids[s], e, moe_gemm.moe_block_m(t * k, e)), a.sets)
        moe_gemm.ALIGN_KERNEL_MAX_PAIRS = keep
        row["align_kernel_only_ms"] = per_call_ms(
            timer, lambda s: moe_gemm.moe_align(ids[s], e, moe_gemm.moe_block_m(t * k, e)), a.sets)
        row["err"] = check(op())
        row["kernel_ms"] = per_call_ms(timer, op(), a.sets)
        ref = lambda s: moe_gemm.moe_experts_ref(xs[s], w13, w2, tw[s], ids[s])  # noqa: E731
        if t * k * expert_bytes <= (8 << 30):  # the reference gathers every pair's expert weights
            row["ref_ms"] = per_call_ms(timer, ref, a.sets)
            if not a.no_compile and dev.type == "cuda":
                comp = torch.compile(moe_gemm.moe_experts_ref, dynamic=False)
                try:
                    row["ref_compiled_ms"] = per_call_ms(
                        timer, lambda s: comp(xs[s], w13, w2, tw[s], ids[s]), a.sets)
                except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                    row["ref_compiled_ms"] = None
                    row["ref_compiled_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        if a.sweep:
            bm = moe_gemm.moe_block_m(t * k, e)
            for kern in ("gate_up", "down"):
                res = {}
                for cfg in SWEEP:
                    kw = {f"launch_{kern}": cfg}
                    try:
                        res[",".join(map(str, cfg))] = per_call_ms(timer, op(**kw), a.sets)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                        res[",".join(map(str, cfg))] = f"{type(exc).__name__}"
                row[f"sweep_{kern}"] = res
                best = min((v, c) for c, v in res.items() if isinstance(v, float))
                row[f"best_{kern}"] = dict(cfg=best[1], ms=best[0],
                                           default=",".join(map(str, moe_gemm.LAUNCH[kern, bm])))
        rows.append(row)
        print(" ".join(f"{kk}={v:.4f}" if isinstance(v, float) else f"{kk}={v}" for kk, v in row.items()
                       if not kk.startswith("sweep_")), flush=True)
    del w13, w2
    return rows


def table(rows: List[Dict]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"
    out = ["| shape | tokens | experts read | floor ms | kernels, torch align ms | kernels ms | x floor | "
           "align torch / kernel us | torch ref ms | torch.compile ref ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['tokens']} | {r['unique_experts']:.1f} | {f(r['floor_ms'])} | "
                   f"{f(r['torch_align_ms'])} | **{f(r['kernel_ms'])}** | "
                   f"{(r['kernel_ms'] or 0) / r['floor_ms']:.2f} | "
                   f"{(r['align_torch_only_ms'] or 0) * 1e3:.1f} / {(r['align_kernel_only_ms'] or 0) * 1e3:.1f} | "
                   f"{f(r.get('ref_ms'))} | {f(r.get('ref_compiled_ms'))} |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        a.shapes, a.tokens, a.sets, a.iters, a.no_compile = "smoke", "1,3", 2, 2, True
    timer = Timer(dev, a.iters)
    bw = read_bandwidth(dev)
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, read bandwidth "
          f"{bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in a.shapes.split(","):
        rows += run_shape(name, a, dev, bw, timer)
    print(table(rows))
    bad = [r for r in rows if max(r["err"], r["err_torch_align"]) > (0.05 if dev.type == "cuda" else 1e-4)]
    if a.out:
        with open(a.out, "w") as fh:
            launch = {f"{k[0]},{k[1]}": v for k, v in moe_gemm.LAUNCH.items()}
            json.dump(dict(device=str(dev), read_gbps=bw / 1e9, launch=launch, rows=rows), fh, indent=1)
    if bad:
        print(f"FAILED: {len(bad)} rows differ from the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
