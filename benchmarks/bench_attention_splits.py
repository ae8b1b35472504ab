"""GQA paged decode / verify attention at small batches: time per key split count (issue 18).

At one sequence the attention kernel has only ``num_kv_heads x splits`` programs, so its time is
the latency of one program's key loop, not bandwidth; the split count (``attention_plan``:
``MIN_KEYS_PER_SPLIT`` keys at least per split) sets that loop's length. This sweeps
``num_splits`` at GLM-4.5-Air's heads (96 query / 8 kv heads of 128), bf16, against the floor
(KV bytes read once at the measured read bandwidth), with the plan's own choice marked. Every
figure is a CUDA-graph replay median over ``--sets`` layers' caches (more than L2), per call.

    python3 benchmarks/bench_attention_splits.py [--batch-sizes 1,4,16] [--context 1024] [--out splits.json]
    python3 benchmarks/bench_attention_splits.py --smoke      # CPU, Triton interpreter, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _timing import Timer, read_bandwidth  # noqa: E402

from mtpspec.ops import paged_attention as pa  # noqa: E402
from mtpspec.ops.argmax import num_sms  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--query-lens", default="1,4", help="query tokens per sequence (1 + k in verification)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=None, help="the plan's bound (default context + 273, as a "
                   "graph captured for max_model_len 1297 sees)")
    p.add_argument("--splits", default="1,2,4,6,8,12,16,24,32")
    p.add_argument("--sets", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    if a.smoke:
        a.batch_sizes, a.query_lens, a.context, a.splits, a.sets, a.iters = "1,2", "1,4", 40, "1,2,4", 2, 1
    dev = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    nh, nkv, d, bs = (8, 2, 16, 16) if a.smoke else (96, 8, 128, 16)
    max_seq = a.max_seq_len or a.context + (8 if a.smoke else 273)
    bw = read_bandwidth(dev)
    timer = Timer(dev, a.iters)
    sms = num_sms(dev) if dev.type == "cuda" else 4
    rows = []
    for b in map(int, a.batch_sizes.split(",")):
        for ql in map(int, a.query_lens.split(",")):
            ctx = a.context + ql
            blocks_per = -(-ctx // bs)
            caches = [(torch.randn(b * blocks_per, bs, nkv, d, device=dev, dtype=dtype),
                       torch.randn(b * blocks_per, bs, nkv, d, device=dev, dtype=dtype)) for _ in range(a.sets)]
            tables = torch.randperm(b * blocks_per, device=dev).view(b, blocks_per).to(torch.int32)
            q = torch.randn(b * ql, nh, d, device=dev, dtype=dtype)
            qsl = torch.arange(0, b * ql + 1, ql, device=dev, dtype=torch.int32)
            lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
            floor_ms = b * ctx * 2 * nkv * d * q.element_size() / bw * 1e3
            planned = pa.attention_plan(b, ql, nh, nkv, max_seq, sms)["num_splits"]
            row = dict(batch=b, query_len=ql, context=ctx, floor_ms=floor_ms, planned_splits=planned, ms={})
            ref = None
            for s in sorted(set(map(int, a.splits.split(","))) | {planned}):
                def run(s=s):
                    for kc, vc in caches:
                        out = pa.paged_attention(q, kc, vc, qsl, lens, tables, d ** -0.5, ql, max_seq, num_splits=s)
                    return out
                out = run()
                ref = out if ref is None else ref
                torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                ms = (timer.eager(run) if not timer.cuda else timer.graph(run)[0]) / a.sets
                row["ms"][s] = ms
            best = min(row["ms"], key=row["ms"].get)
            row.update(best_splits=best, best_ms=row["ms"][best], planned_ms=row["ms"][planned])
            rows.append(row)
            print(f"B={b:3d} q={ql} ctx={ctx}: floor {floor_ms * 1e3:6.1f} us, planned {planned} splits "
                  f"{row['planned_ms'] * 1e3:6.1f} us, best {best} splits {row['best_ms'] * 1e3:6.1f} us | "
                  + " ".join(f"{s}:{v * 1e3:.1f}" for s, v in row["ms"].items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name()) if timer.cuda else "cpu", read_gbps=bw / 1e9,
                           heads=(nh, nkv, d), max_seq_len=max_seq, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
