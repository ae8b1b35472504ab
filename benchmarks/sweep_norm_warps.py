"""Warp-count sweep of fused_add_rms_norm at decode sizes, against torch.compile, with spread.

Why: bench_ops.py (2026-11-29) found the kernel 0.26 us behind torch.compile at 7168 x 1 token,
from one median. This measures every shape 5 times (CUDA-graph replays of 256 calls over rotating
inputs, median per replay) for num_warps in {2, 4, 8, 16} and compile, so the gap and its noise
are both visible. Usage: ``python3 benchmarks/sweep_norm_warps.py`` (GPU).
"""

import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
import importlib  # noqa: E402

rn = importlib.import_module("mtpspec.ops.rms_norm")  # the attribute mtpspec.ops.rms_norm is the function
from mtpspec.ops import triton_utils  # noqa: E402

CALLS, SETS, REPEATS = 256, 64, 5


def graph_us(fn, sets):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for a in sets[:3]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(*sets[i % len(sets)])
    times = []
    for _ in range(REPEATS):
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return times


def main():
    eps = 1e-6
    ref = lambda x, r, w: rn.fused_add_rms_norm_ref(x, r, w, eps)  # noqa: E731
    comp = torch.compile(ref)
    print("H     T  variant   median us  min..max us (5 replays of 256 calls)")
    for h in (6144, 7168):
        for t in (1, 4, 64):
            sets = [(torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                     torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                     torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(SETS)]
            rows = [("compile", graph_us(comp, sets))]
            for w in (2, 4, 8, 16):
                rn.row_launch = lambda n, c, e, w=w: triton_utils.row_launch(n, c, e)._replace(num_warps=w)
                rows.append((f"warps={w}", graph_us(lambda x, r, wt: rn.fused_add_rms_norm(x, r, wt, eps), sets)))
            rn.row_launch = triton_utils.row_launch
            default = triton_utils.row_launch(t, h, 2).num_warps
            for name, ts in rows:
                tag = " (default)" if name == f"warps={default}" else ""
                print(f"{h}  {t:3d}  {name:9s} {statistics.median(ts):9.3f}  {min(ts):.3f}..{max(ts):.3f}{tag}")


if __name__ == "__main__":
    main()
