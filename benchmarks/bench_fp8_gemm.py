"""Benchmark the FP8 block-scaled GEMM (mtpspec.ops.fp8_gemm) at DeepSeek-V3 shapes vs torch bf16.

Shapes (``N x K``, weight ``[N, K]``; DeepSeek-V3: hidden 7168, q-lora 1536, 128 heads, expert
intermediate 2048): ``q_b_proj`` 1536 -> 24576, ``o_proj`` 16384 -> 7168, ``kv_a_proj``
7168 -> 576, expert ``gate_up`` 7168 -> 2 x 2048, expert ``down`` 2048 -> 7168; tokens
M in {1, 8, 64, 256, 8192}. Each case:

* ``fp8``: :func:`mtpspec.ops.fp8_gemm.fp8_block_linear` as dispatched (``fp8_path``: ``swap``
  up to ``SWAP_AB_MAX_M`` rows, else ``tile``): bf16 activations quantised per token and
  128-channel group, fp8 x fp8 tensor-core dots, fp32 accumulation, bf16 out;
* up to 64 rows, the other ``small_m`` paths too, each as ``fp8_<path>_ms``: ``tile``, the
  ``[BLOCK_M, BLOCK_N]`` output-tile kernel (activations quantised inside its K loop, split-K)
  that ran before the swap-AB path; ``swap``, the swap-AB kernel (weight tiles as stored times
  the activations transposed, quantised in a pass of their own, split-K, a fixed-order split
  sum); ``swap_fused``, the same quantising in its K loop (one launch fewer);
  ``swap_over_tile`` / ``swap_fused_over_tile``: their times over the tile time;
* ``fp8_inloop``: the tile kernel with ``prequant=False`` (activations quantised inside every
  column tile's K loop; the default quantises them once, in a pass of their own);
* ``bf16``: ``torch.nn.functional.linear`` on bf16 weights of the same shape (cuBLAS).

Timing: ``triton.testing.do_bench`` median (it also flushes L2 before each call); inputs rotate
over copies whose total exceeds 2x the H200's 50 MB L2, so weights are read from HBM. Floors:
bytes (fp8 weight + fp32 scales + bf16 activations in and out; bf16: 2-byte weights) at
4.2 TB/s (H200 HBM3e) and FLOPs (2 M N K) at the H200 SXM's dense spec, 1979 TFLOP/s FP8 and
989 TFLOP/s BF16 (NVIDIA's sheet gives 3958 / 1979 with 2:4 sparsity; ``--fp8-tflops`` to
change, e.g. 1500). ``frac_of_floor`` = max(byte floor, FLOP floor) / measured time. The run also
measures its own ceilings (``measured_ceilings``: bf16 ``torch.mm`` and fp8 ``torch._scaled_mm``
at 8192^3, a 1 GiB copy) to set beside the spec ones. A
correctness check per shape compares the kernel against the dequantised bf16 matmul.

The whole run stays within ``--budget-s`` (default 100 s): cases left when it runs out are
listed as skipped. Prints JSON; ``--json OUT.json`` also writes it.

``--swap-max-m`` / ``--swap-programs-per-sm`` set ``SWAP_AB_MAX_M`` / ``SWAP_PROGRAMS_PER_SM`` for the run.

Usage: ``python3 benchmarks/bench_fp8_gemm.py --json OUT.json``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [("q_b_proj", 24576, 1536), ("o_proj", 7168, 16384), ("kv_a_proj", 576, 7168),
          ("expert_gate_up", 4096, 7168), ("expert_down", 7168, 2048)]
TOKENS = [1, 8, 64, 256, 8192]
HBM_BYTES_PER_S = 4.2e12
L2_BYTES = 50 << 20
BLOCK = (128, 128)
GRAPH_CALLS = 16  # --graph: calls per captured graph (each on the next rotated copy)


def _copies(nbytes_one: int) -> int:
    return max(2, min(16, -(-2 * L2_BYTES // max(1, nbytes_one))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--fp8-tflops", type=float, default=1979.0)
    ap.add_argument("--bf16-tflops", type=float, default=989.0)
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--graph", action="store_true",
                    help="time each arm as a CUDA graph of 16 calls (rotating inputs inside the graph), per call: "
                         "no launch cost, as the engine's graphed steps run them")
    ap.add_argument("--swap-max-m", type=int, default=None, help="SWAP_AB_MAX_M for this run")
    ap.add_argument("--swap-programs-per-sm", type=int, default=None, help="SWAP_PROGRAMS_PER_SM for this run")
    args = ap.parse_args()
    t0 = time.time()
    out = {"bench": "fp8_block_gemm", "block": list(BLOCK), "hbm_bytes_per_s": HBM_BYTES_PER_S,
           "fp8_peak_tflops": args.fp8_tflops, "bf16_peak_tflops": args.bf16_tflops, "cases": [], "skipped": [],
           "errors": []}

    def emit() -> None:
        out["total_s"] = round(time.time() - t0, 2)
        text = json.dumps(out, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)

    if not torch.cuda.is_available():
        out["errors"].append("no CUDA device: this benchmark needs a GPU")
        emit()
        return 1
    import triton
    import mtpspec.ops.fp8_gemm as fg
    from mtpspec.ops.fp8_gemm import dequantize_weight_blocks, fp8_block_linear, quantize_weight_blocks
    if args.swap_max_m is not None:
        fg.SWAP_AB_MAX_M = args.swap_max_m
    if args.swap_programs_per_sm is not None:
        fg.SWAP_PROGRAMS_PER_SM = args.swap_programs_per_sm
    out["swap_ab_max_m"] = fg.SWAP_AB_MAX_M
    out["timing"] = f"CUDA graph of {GRAPH_CALLS} calls, per call" if args.graph else "do_bench per call (launches included)"
    out["swap_programs_per_sm"] = fg.SWAP_PROGRAMS_PER_SM
    dev = torch.device("cuda")
    out["device"] = torch.cuda.get_device_name(dev)
    out["capability"] = list(torch.cuda.get_device_capability(dev))
    torch.manual_seed(0)
    out["measured_ceilings"] = ceilings(dev)
    for name, n, k in SHAPES:
        if time.time() - t0 > args.budget_s:
            out["skipped"] += [f"{name} M={m}" for m in TOKENS]
            continue
        try:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            q, s = quantize_weight_blocks(w, BLOCK)
            wb = dequantize_weight_blocks(q, s, *BLOCK, torch.bfloat16)
            del w
            nw8 = _copies(q.numel() + s.numel() * 4)
            q8 = [q.clone() for _ in range(nw8)]
            s8 = [s.clone() for _ in range(nw8)]
            nwb = _copies(wb.numel() * 2)
            wbs = [wb.clone() for _ in range(nwb)]
            x0 = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
            want = (x0 @ wb.t()).float()
            check = {p: ((fp8_block_linear(x0, q, s, *BLOCK, small_m=p).float() - want).norm() / want.norm()).item()
                     for p in fg.SMALL_M_PATHS}
        except Exception as exc:  # keep going: one shape's failure must not lose the others
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
            continue
        for m in TOKENS:
            if time.time() - t0 > args.budget_s:
                out["skipped"].append(f"{name} M={m}")
                continue
            try:
                nx = _copies(m * k * 2)
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(nx)]
                i8 = [0]
                ib = [0]

                def run_fp8():
                    j = i8[0] = i8[0] + 1
                    return fp8_block_linear(xs[j % nx], q8[j % nw8], s8[j % nw8], *BLOCK)

                def run_fp8_inloop():
                    j = i8[0] = i8[0] + 1
                    return fp8_block_linear(xs[j % nx], q8[j % nw8], s8[j % nw8], *BLOCK, prequant=False,
                                            small_m="tile")

                path = fg.small_m_path(m)
                others = [p for p in fg.SMALL_M_PATHS if p != path] if m <= fg.SWAP_MAX_BLOCK_T else []

                def run_fp8_path(p):
                    j = i8[0] = i8[0] + 1
                    return fp8_block_linear(xs[j % nx], q8[j % nw8], s8[j % nw8], *BLOCK, small_m=p)

                def run_bf16():
                    j = ib[0] = ib[0] + 1
                    return torch.nn.functional.linear(xs[j % nx], wbs[j % nwb])

                def timed(fn) -> float:
                    if not args.graph:
                        fn()
                        torch.cuda.synchronize()
                        return triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms,
                                                       return_mode="median")
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            fn()
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(GRAPH_CALLS):
                            fn()
                    return triton.testing.do_bench(g.replay, warmup=args.warmup_ms, rep=args.rep_ms,
                                                   return_mode="median") / GRAPH_CALLS

                ms8 = timed(run_fp8)
                msb = timed(run_bf16)
                ms8p = timed(run_fp8_inloop)
                arms = {f"fp8_{path}_ms": ms8}
                for p in others:
                    arms[f"fp8_{p}_ms"] = timed(functools.partial(run_fp8_path, p))
                flops = 2.0 * m * n * k
                act = m * k * 2 + m * n * 2
                bytes8 = n * k + s.numel() * 4 + act
                bytesb = n * k * 2 + act
                floor8 = max(bytes8 / HBM_BYTES_PER_S, flops / (args.fp8_tflops * 1e12)) * 1e3
                floorb = max(bytesb / HBM_BYTES_PER_S, flops / (args.bf16_tflops * 1e12)) * 1e3
                out["cases"].append({
                    "shape": name, "M": m, "N": n, "K": k, "fp8_ms": round(ms8, 5), "bf16_ms": round(msb, 5),
                    "fp8_inloop_ms": round(ms8p, 5), "fp8_path": path,
                    **{key: round(v, 5) for key, v in arms.items() if key != f"fp8_{path}_ms"},
                    **({"swap_over_tile": round(arms["fp8_swap_ms"] / arms["fp8_tile_ms"], 3),
                        "swap_fused_over_tile": round(arms["fp8_swap_fused_ms"] / arms["fp8_tile_ms"], 3)}
                       if others else {}),
                    "speedup_vs_bf16": round(msb / ms8, 3),
                    "fp8_bytes": bytes8, "fp8_byte_floor_ms": round(bytes8 / HBM_BYTES_PER_S * 1e3, 5),
                    "fp8_flop_floor_ms": round(flops / (args.fp8_tflops * 1e12) * 1e3, 5),
                    "fp8_frac_of_floor": round(floor8 / ms8, 3), "bf16_frac_of_floor": round(floorb / msb, 3),
                    "fp8_TBps": round(bytes8 / ms8 / 1e9, 3), "fp8_TFLOPs": round(flops / ms8 / 1e9, 2),
                    "bound": "bytes" if bytes8 / HBM_BYTES_PER_S > flops / (args.fp8_tflops * 1e12) else "flops",
                    "rel_err_vs_dequant_bf16": {p: round(v, 5) for p, v in check.items()}})
                del xs
            except Exception as exc:
                out["errors"].append(f"{name} M={m}: {type(exc).__name__}: {exc}")
        del q8, s8, wbs
        torch.cuda.empty_cache()
    emit()
    return 0 if not out["errors"] else 1


def ceilings(dev: torch.device) -> dict:
    """Measured in this run: bf16 ``torch.mm`` and fp8 ``torch._scaled_mm`` (per-tensor scales) at
    8192^3 (TFLOP/s), and a 1 GiB device copy (TB/s, reads + writes counted)."""
    import triton
    res = {}
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    res["bf16_mm_tflops"] = round(2 * n ** 3 / triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e9, 1)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                                     return_mode="median")
        res["fp8_scaled_mm_tflops"] = round(2 * n ** 3 / ms / 1e9, 1)
    except Exception as exc:  # noqa: BLE001 - report, keep going
        res["fp8_scaled_mm_error"] = f"{type(exc).__name__}: {exc}"[:200]
    x = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    res["copy_tbps"] = round(2 * x.numel() * 2 / ms / 1e9, 3)
    del a, b, x, y
    torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    sys.exit(main())
