"""Where a sparse MLA call's time goes (issue 15): a fixed cost per program against a cost per key tile.

Session 43 estimated from two of session 18's H200 figures that a program of the Gluon sparse kernel
(:func:`mtpspec.ops.mla_gluon.launch_sparse`) pays ~26 us beside ~2.4 us a 64-key tile, which
would make 16 heads x 1 row (DeepSeek-V3.2 at tp 8, every MTP draft step) 1.76x its floor with the
tiles themselves near the bandwidth's pace. This script measures it instead of inferring it:

* For each head count (``--heads``, 16 and 128), one query row per sequence (``--seqs`` 64,
  ``--context`` 32,768, bf16, blocks shuffled) and each ``index_topk`` in ``--topks`` and split count
  in ``--splits``, the whole op (:func:`~mtpspec.ops.sparse_mla_attention.sparse_mla_attention`
  with ``num_splits``: the kernel, the combine, and the combine's one-element fill) is captured in a
  CUDA graph, one graph per each of ``--rotate`` different random selections (so the rows gathered
  by consecutive replays differ and a small selection does not sit in L2), and timed three ways:
  ``sync_us``, each replay between two CUDA events with a host sync after it
  (``benchmarks/_timing.Timer.eager``, what the bench scripts report: the graph launch's latency
  included); ``queued_us``, ``--iters`` replays queued between two events (``Timer.queued``: launch
  latency hidden behind the previous replay); CUPTI per kernel (torch.profiler over ``--iters`` replays, the
  graphs in turn: the kernel, the combine, their busy union).
* A least-squares line per (heads, splits) of the kernel's CUPTI time against key tiles per
  program (``topk / splits / 64``): ``fixed_us + tile_us * tiles``, printed with the floor
  ``bytes / read bandwidth`` of the same tiles (1,152 B a key, the bandwidth measured in the run).
* An empty graph (one one-element kernel) timed the same ways: the timer's own launch cost.

Usage: ``python3 benchmarks/sparse_mla_costs.py [--heads 16,128] [--topks 512,1024,2048,4096]
[--splits 1,2,4] [--json out.json]``; ``--smoke``: tiny shapes on the CPU (the Triton kernel under
the interpreter; host timing only), to test the script.
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

from benchmarks._timing import Timer, cuda_kernel_times, kernel_counts, read_bandwidth  # noqa: E402
from benchmarks.bench_mla_attention import copy_read_bandwidth, git_commit  # noqa: E402
from benchmarks.bench_sparse_mla import Paged  # noqa: E402
import mtpspec.ops.sparse_mla_attention as sp  # noqa: E402

KEY_TILE = 64


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--heads", default="16,128")
    p.add_argument("--topks", default="512,1024,2048,4096")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--rotate", type=int, default=4, help="graphs with different selections, replayed in turn")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--impl", default=None, help="sparse_mla_attention's impl (default: its own choice)")
    p.add_argument("--km-stages", type=int, default=None, help="the keys-as-M kernel's key-tile slots (impl gluon-km)")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    a.kv_lora_rank, a.rope, a.nope = 512, 64, 128
    if a.smoke:
        a.seqs, a.context, a.heads, a.topks, a.splits, a.rotate, a.iters = 2, 96, "2", "16,32", "1,2", 2, 2
        a.kv_lora_rank, a.rope, a.block_size = 32, 16, 8
    return a


def time_calls(timer: Timer, fns: List[Callable[[], Any]], iters: int) -> Dict[str, Any]:
    """sync / queued / CUPTI microseconds of the calls ``fns`` (one graph each), replayed in turn."""
    if not timer.cuda:  # the smoke test: host time of the eager calls
        return {"host_us": timer.eager(fns[0]) * 1e3}
    graphs = []
    for fn in fns:
        g, why = timer.capture(fn)
        if g is None:
            raise RuntimeError(f"capture failed: {why}")
        graphs.append(g)
    from torch.profiler import ProfilerActivity, profile
    turn = itertools.cycle(graphs)
    replay = lambda: next(turn).replay()  # noqa: E731 - the graphs in turn
    sync_ms, queued_ms = timer.eager(replay), timer.queued(replay)  # (each warms up first)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):  # the graphs in turn (one graph's rows would sit in L2 for a small selection)
            graphs[i % len(graphs)].replay()
            torch.cuda.synchronize()
    busy_ms = cuda_kernel_times(prof)[0]
    kernels = {}
    for name, (us, _n) in kernel_counts(prof, iters).items():
        short = "combine" if "combine" in name else ("kernel" if "sparse" in name else name[:40])
        kernels[short] = kernels.get(short, 0.0) + us
    return {"sync_us": sync_ms * 1e3, "queued_us": queued_ms * 1e3,
            "busy_us": busy_ms / iters * 1e3, "kernels_us": kernels}


def fit(xs: List[float], ys: List[float]) -> Optional[Dict[str, float]]:
    """Least-squares ``y = fixed + per * x``, or None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    per = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    fixed = my - per * mx
    resid = max(abs(y - fixed - per * x) for x, y in zip(xs, ys))
    return {"fixed_us": fixed, "tile_us": per, "max_resid_us": resid}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if a.km_stages is not None:
        import mtpspec.ops.mla_gluon_km as km
        km.KM_STAGES = a.km_stages
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16
    timer = Timer(device, a.iters, warmup=0 if a.smoke else 3)
    bw = max(read_bandwidth(device, cpu_bytes=8 << 20),
             copy_read_bandwidth(device, (4 << 30) if device.type == "cuda" else (8 << 20)))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    print(f"device {name}, {sms} SMs: read {bw / 1e9:.0f} GB/s; commit {git_commit()}", flush=True)
    out: Dict[str, Any] = {"device": name, "sms": sms, "commit": git_commit(), "torch": torch.__version__,
                           "read_bandwidth": bw, "args": vars(a), "rows": [], "fits": []}
    if device.type == "cuda":
        x = torch.zeros(1, device=device)
        out["empty_graph"] = time_calls(timer, [lambda: x.add_(1)], a.iters)
        print(f"empty graph (one 1-element kernel): {json.dumps(out['empty_graph'])}", flush=True)
    key_bytes = (a.kv_lora_rank + a.rope) * 2
    t0 = time.time()
    for heads in [int(h) for h in a.heads.split(",")]:
        g = torch.Generator(device="cpu").manual_seed(2)
        pg = Paged(a, 1, device)
        cache = (torch.randn(pg.num_blocks, a.block_size, a.kv_lora_rank + a.rope, generator=g) * 0.5).to(dtype)
        cache = cache.to(device)
        ql = torch.randn(pg.t, heads, a.kv_lora_rank, generator=g).to(dtype).to(device)
        qp = torch.randn(pg.t, heads, a.rope, generator=g).to(dtype).to(device)
        scale = (a.nope + a.rope) ** -0.5
        for topk in [int(k) for k in a.topks.split(",")]:
            a.topk = topk
            sels = []
            for r in range(a.rotate):  # different random selections, every row its own draw
                torch.manual_seed(100 + r)
                pos = torch.stack([torch.randperm(pg.s, device=device)[:topk] for _ in range(pg.t)])
                sels.append(sp.positions_to_slots(pos.to(torch.int32), pg.token_seq, pg.block_tables,
                                                  a.block_size).contiguous())
            for splits in [int(s) for s in a.splits.split(",")]:
                if splits * KEY_TILE > topk and splits > 1:
                    continue
                fns = [(lambda s=s: sp.sparse_mla_attention(ql, qp, cache, s, scale, num_splits=splits,
                                                            impl=a.impl)) for s in sels]
                got = fns[0]().float()
                n = min(2, pg.t)
                ref = sp.sparse_mla_attention_ref(ql[:n], qp[:n], cache, sels[0][:n], scale).float()
                err = float((got[:n] - ref).abs().max())
                tiles = -(-topk // splits) / KEY_TILE
                programs = pg.t * -(-heads // 64) * splits
                row = dict(heads=heads, topk=topk, splits=splits, programs=programs, tiles_per_program=tiles,
                           max_abs_err=err, **time_calls(timer, fns, a.iters))
                # the bandwidth floor of the gathered rows (+ the queries and outputs)
                row["floor_us"] = (pg.t * topk * key_bytes + pg.t * heads * (2 * a.kv_lora_rank + a.rope) * 2) / bw * 1e6
                out["rows"].append(row)
                if "kernels_us" in row:
                    k = row["kernels_us"]
                    print(f"H={heads} topk={topk} splits={splits}: kernel {k.get('kernel', 0):.1f} us, combine "
                          f"{k.get('combine', 0):.1f}, busy {row['busy_us']:.1f}, queued {row['queued_us']:.1f}, sync "
                          f"{row['sync_us']:.1f}, floor {row['floor_us']:.1f}; err {err:.1e}", flush=True)
                else:
                    print(json.dumps(row), flush=True)
        del cache, ql, qp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        print("\nheads splits | kernel (CUPTI) = fixed + tile x tiles/program | floor's tile | queued - kernel", flush=True)
        for heads in sorted({r["heads"] for r in out["rows"]}):
            for splits in sorted({r["splits"] for r in out["rows"]}):
                rows = [r for r in out["rows"] if r["heads"] == heads and r["splits"] == splits]
                f = fit([r["tiles_per_program"] for r in rows], [r["kernels_us"].get("kernel", 0.0) for r in rows])
                if f is None:
                    continue
                # the bandwidth's pace for one tile of every (row, split) at once (128 heads' two head
                # blocks gather the same rows: counted once)
                floor_tile = rows[0]["programs"] // -(-heads // 64) * KEY_TILE * key_bytes / bw * 1e6
                extra = [round(r["queued_us"] - r["kernels_us"].get("kernel", 0.0), 1) for r in rows]
                out["fits"].append(dict(heads=heads, splits=splits, floor_tile_us=floor_tile, **f))
                print(f"{heads:5d} {splits:6d} | {f['fixed_us']:6.1f} us + {f['tile_us']:5.2f} us x tiles "
                      f"(resid <= {f['max_resid_us']:.1f}) | {floor_tile:5.2f} us | {extra}", flush=True)
    out["seconds"] = time.time() - t0
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
