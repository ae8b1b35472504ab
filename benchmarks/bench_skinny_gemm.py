"""Few-row bf16 GEMMs: cuBLAS (``F.linear``) vs the swap-AB kernel (``mtpspec.ops.skinny_gemm``) vs
their weight-read floor (issue 18: decode-size linear layers).

Shapes: the dense projections of a GLM-4.5-Air step (qkv with bias, o_proj, the dense layer's
gate_up / down, the LM head) and of DeepSeek-V3 (q_b, o, kv_a), at 1, 4 and 16 rows. Each figure
is a CUDA-graph replay median per call over ``sets`` copies of the weight (more than 200 MB in all:
no L2 hits); floor = the weight's bytes over the read bandwidth measured in the same run.
``--sweep`` also times every launch shape of the kernel (``BLOCK_N x BLOCK_K x warps x stages``,
and splits auto / 1). Outputs are checked against cuBLAS's.

    python3 benchmarks/bench_skinny_gemm.py [--rows 1,4,16] [--sweep] [--out skinny.json]
    python3 benchmarks/bench_skinny_gemm.py --smoke      # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _timing import Timer, read_bandwidth  # noqa: E402

from mtpspec.ops.skinny_gemm import skinny_linear  # noqa: E402

#: name: (N, K, bias)
SHAPES = {
    "air.qkv": (14336, 4096, True), "air.o_proj": (4096, 12288, False), "air.dense_gate_up": (21888, 4096, False),
    "air.dense_down": (4096, 10944, False), "air.lm_head": (151552, 4096, False),
    "dsv3.q_b": (24576, 1536, False), "dsv3.o_proj": (7168, 16384, False), "dsv3.kv_a": (576, 7168, False),
}
SMOKE = {"smoke.a": (100, 200, True), "smoke.b": (64, 520, False)}
SWEEP = [(bn, bk, w, st) for bn, bk in itertools.product((32, 64, 128), (64, 128, 256)) for w, st in
         ((4, 3), (4, 4), (4, 6), (8, 4))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    shapes = SMOKE if a.smoke else {s: SHAPES[s] for s in a.shapes.split(",")}
    if a.smoke:
        a.rows, a.iters = "1,5", 1
    dev = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float16 if a.smoke else torch.bfloat16
    bw = read_bandwidth(dev)
    timer = Timer(dev, a.iters)
    rows = []
    for name, (n, k, has_bias) in shapes.items():
        elem = torch.tensor([], dtype=dtype).element_size()
        sets = 1 if a.smoke else max(2, -(-200 * 2 ** 20 // (n * k * elem)))
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(sets)]
        b = torch.randn(n, device=dev, dtype=dtype) if has_bias else None
        floor_ms = n * k * elem / bw * 1e3
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = F.linear(x.float(), ws[0].float(), None if b is None else b.float())

            def timed(fn):
                def run():
                    for w in ws:
                        out = fn(w)
                    return out
                run()
                return (timer.eager(run) if not timer.cuda else timer.graph(run)[0]) / sets

            out = skinny_linear(x, ws[0], b)
            err = (out.float() - ref).abs().max().item() / max(1e-6, ref.abs().max().item())
            row = dict(shape=name, n=n, k=k, rows=m, floor_ms=floor_ms, err=err,
                       cublas_ms=timed(lambda w: F.linear(x, w, b)), skinny_ms=timed(lambda w: skinny_linear(x, w, b)))
            if a.sweep and not a.smoke:
                row["sweep"] = {}
                for (bn, bk, warps, st), splits in itertools.product(SWEEP, (None, 1)):
                    key = f"{bn},{bk},{warps},{st},{'auto' if splits is None else splits}"
                    try:
                        row["sweep"][key] = timed(lambda w: skinny_linear(x, w, b, bn, bk, warps, st, splits))
                    except Exception as exc:  # a shape that does not fit (shared memory): recorded
                        row["sweep"][key] = None
                        row.setdefault("sweep_errors", {})[key] = str(exc).splitlines()[0][:120]
                ok = {kk: v for kk, v in row["sweep"].items() if v is not None}
                row["best"] = min(ok, key=ok.get) if ok else None
                row["best_ms"] = ok[row["best"]] if ok else None
            rows.append(row)
            print(f"{name:18s} M={m:2d}: floor {floor_ms * 1e3:7.1f} us  cuBLAS {row['cublas_ms'] * 1e3:7.1f} "
                  f"({row['cublas_ms'] / floor_ms:.2f}x)  skinny {row['skinny_ms'] * 1e3:7.1f} "
                  f"({row['skinny_ms'] / floor_ms:.2f}x)  err {err:.1e}"
                  + (f"  best {row['best']} {row['best_ms'] * 1e3:.1f} us" if row.get("best") else ""), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if timer.cuda else "cpu", read_gbps=bw / 1e9,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
