"""How fast TMA copies move key tiles from L2 (and from HBM) into shared memory, every SM at once
(issue 14: is the 128-head dense MLA kernel bound by the L2 -> SM path rather than the tensor cores?).

The dense MLA kernel's programs each stream the whole latent cache of their sequence through two
72 KiB shared-memory slots; at 128 heads two (1 query row) to eight (4 rows) programs read the same
keys, so the L2 -> SM traffic is 2-8x the HBM traffic. Measured in BENCHMARKS.md (2026-12-04) the
kernel pulls 4.8-5.1 TB/s from L2 into the SMs whatever its schedule, and the 1.25x goal needs
~5.2 TB/s: if this ceiling is near that, only fewer bytes per FLOP (two programs sharing one load,
TMA multicast in a cluster) can reach the goal.

One program per SM, one warp each: a ring of ``--slots`` shared-memory slots of one ``[64, 256]``
bf16 box (32 KiB, the kernel's half-tile), each refilled as soon as its copy landed, over a region
of ``rows`` cache rows of 576 bf16 values (the MLA cache's row): 8,192 rows (9.4 MB, L2-resident),
16,384 (18.9 MB) and all of ``--rows-hbm`` (far beyond L2). Prints GB/s copied into shared memory
(bytes landed / time, CUDA events, median of ``--iters``) beside the device's bf16 matmul rate
(8192^3, the MLA floor's) and what the 128-head MLA goal would need.

    PYTHONPATH=$PWD python3 benchmarks/bench_tma_l2.py [--json OUT.json]

Needs a compute-capability-9 GPU and Triton's Gluon (no CPU path: it measures the hardware).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton, or none
    HAS_GLUON = False

ROW = 576  # bf16 values per cache row (kv_lora_rank 512 + rope 64)
BOX_ROWS, BOX_COLS = 64, 256  # one copy: a half tile of the dense kernel's left / right value half
BOX_BYTES = BOX_ROWS * BOX_COLS * 2

if HAS_GLUON:
    @gluon.jit
    def _stream(desc, n_copies, region_rows, SLOTS: gl.constexpr):
        """Program ``p`` copies boxes ``p * n_copies + i`` (two per 64-row tile: its left and right
        256 columns) of a region of ``region_rows`` rows, ``SLOTS`` copies in flight."""
        p = gl.program_id(0)
        buf = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, 64, 256], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(SLOTS):
            mbarrier.init(bars.index(j), count=1)
        for i in range(n_copies):
            s = i % SLOTS
            if i >= SLOTS:  # the slot's last copy landed: reuse it
                mbarrier.wait(bars.index(s), ((i // SLOTS) - 1) & 1)
            t = p * n_copies + i
            mbarrier.expect(bars.index(s), 64 * 256 * 2)
            _tma_load(desc, [((t // 2) * 64) % region_rows, (t % 2) * 256], bars.index(s), buf.index(s))
        for i in range(n_copies, n_copies + SLOTS):  # drain
            mbarrier.wait(bars.index(i % SLOTS), ((i // SLOTS) - 1) & 1)


def _time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--copies", type=int, default=1200, help="32-KiB copies per program")
    ap.add_argument("--slots", default="2,4,6", help="copies in flight per program (comma-separated)")
    ap.add_argument("--rows-hbm", type=int, default=1 << 21, help="rows of the HBM-sized region (2**21: 2.4 GB)")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args()
    if not (HAS_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("bench_tma_l2: needs a compute-capability-9 GPU and Triton's Gluon", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_properties(0)
    sms = dev.multi_processor_count
    cache = torch.empty(args.rows_hbm, ROW, device="cuda", dtype=torch.bfloat16).normal_()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [BOX_ROWS, BOX_COLS], layout)
    out = {"device": torch.cuda.get_device_name(), "sms": sms, "copies_per_program": args.copies, "tma": []}
    for rows in (8192, 16384, args.rows_hbm):
        for slots in (int(x) for x in args.slots.split(",")):
            ms = _time_ms(lambda: _stream[(sms,)](desc, args.copies, rows, slots, num_warps=1), args.iters)
            gbs = sms * args.copies * BOX_BYTES / ms / 1e6
            out["tma"].append({"region_rows": rows, "region_mb": rows * ROW * 2 / 1e6, "slots": slots, "ms": ms,
                               "gb_per_s": gbs})
            print(f"region {rows:>8} rows ({rows * ROW * 2 / 1e6:8.1f} MB), {slots} slots in flight: "
                  f"{gbs:8.0f} GB/s into shared memory ({ms:.3f} ms)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ a, args.iters)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    out["matmul_tflops"] = tflops
    # the 128-head dense MLA kernel's L2 -> SM bytes per FLOP: 64 rows share a 72 KiB tile of 64 keys,
    # 2 x 64 x 64 x (576 + 512) FLOPs
    need = tflops / 1.25 * 1e12 * (64 * ROW * 2) / (2 * 64 * 64 * (ROW + 512)) / 1e9
    out["mla128_goal_needs_gb_per_s"] = need
    print(f"bf16 matmul 8192^3: {tflops:.1f} TFLOP/s; the 128-head MLA goal (1.25x of the FLOP floor) needs "
          f"{need:.0f} GB/s from L2 into the SMs with 64-row programs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
