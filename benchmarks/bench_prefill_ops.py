"""The two small ops of a prefix-cache hit's step that cost launches, not bytes (issue 17): RoPE
of the query and key, and the paged attention's split combine, each against what it replaced.

    python3 benchmarks/bench_prefill_ops.py [--rows 79,256,831] [--context 831] [--json OUT]

Shapes: Llama-3-70B's attention (64 query / 8 KV heads of 128) with GLM-4.5's partial rotary
(64 of 128 channels, neox), i.e. the ``dense-70b-16l`` dummy model of
``benchmarks/run_serving_goals.sh``; bf16. Rows: 79 (a hit's new tokens), 256 (64 decodes x
(1 + 3)), 831 (a miss's prompt).

* rope: ``rotary_embedding_ref`` (the torch form the layer ran before: ~20 launches) eager,
  the same under ``torch.compile``, and the Triton kernel (one launch), each eager and as a
  replayed CUDA graph (the engine replays graphs for hits and decodes). Floor: read q, k and
  write them (``2 x rows x 72 heads x 128 x 2 B``) at the measured copy bandwidth.
* attention: ``paged_attention`` for one sequence of ``rows`` queries over ``context`` keys,
  graphed, with the split combine taking one head per program (the kernel before) and the
  default (:func:`~mtpspec.ops.paged_attention.combine_block_h` heads), in one process.

Inputs are L2-resident (as in the step, where the previous GEMM has just written q and k):
these ops are latency-bound, the floors show how far from bytes they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import Timer, fmt  # noqa: E402
from bench_mla_attention import copy_read_bandwidth  # noqa: E402

from mtpspec.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from mtpspec.ops import paged_attention as pa  # noqa: E402
from mtpspec.ops.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402

NH, NKV, HS, ROT, BS = 64, 8, 128, 64, 16


def bench_rope(t: int, dev: torch.device, timer: Timer, bw: float) -> dict:
    rope = RotaryEmbedding(HS, ROT, 16384, 500000.0).to(dev)
    qkv = torch.randn(t, (NH + 2 * NKV) * HS, device=dev, dtype=torch.bfloat16)
    q, k, _ = qkv.split([NH * HS, NKV * HS, NKV * HS], dim=-1)
    pos = torch.randint(0, 16000, (t,), device=dev)
    cs = rope.cos_sin_cache
    ref = lambda: rotary_embedding_ref(pos, q, k, cs, HS, ROT, True)  # noqa: E731
    ker = lambda: rotary_embedding(pos, q, k, cs, HS, ROT, True)  # noqa: E731
    comp = torch.compile(lambda p, a, b: rotary_embedding_ref(p, a, b, cs, HS, ROT, True), dynamic=False)
    assert all(torch.equal(x, y) for x, y in zip(ker(), ref()))
    row = {"rows": t, "floor_ms": 2 * t * (NH + NKV) * HS * 2 / bw * 1e3}
    for name, fn in (("torch", ref), ("compile", lambda: comp(pos, q, k)), ("kernel", ker)):
        row[name + "_eager_ms"] = timer.eager(fn)
        row[name + "_graph_ms"] = timer.graph(fn)[0]
    return row


def bench_attention(t: int, ctx: int, dev: torch.device, timer: Timer) -> dict:
    nblk = (ctx + BS - 1) // BS
    kc = torch.randn(nblk, BS, NKV, HS, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(t, NH, HS, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    bt = torch.arange(nblk, dtype=torch.int32, device=dev)[None]
    fn = lambda: pa.paged_attention(q, kc, vc, qsl, sl, bt, HS ** -0.5, t, ctx)  # noqa: E731
    plan = pa.attention_plan(1, t, NH, NKV, ctx, pa.num_sms(dev))
    row = {"rows": t, "context": ctx, "num_splits": plan["num_splits"]}
    want = fn()
    real = pa.combine_block_h
    try:
        pa.combine_block_h = lambda *a: 1
        row["one_head_graph_ms"] = timer.graph(fn)[0]
        torch.testing.assert_close(fn(), want)  # the split sums' order differs: not bit-equal
    finally:
        pa.combine_block_h = real
    row["block_h"] = real(NH, 1 << (plan["num_splits"] - 1).bit_length(), HS) if plan["num_splits"] > 1 else None
    row["default_graph_ms"] = timer.graph(fn)[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="79,256,831")
    ap.add_argument("--context", type=int, default=831)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(dev, args.iters if dev.type == "cuda" else 5)
    bw = 2 * copy_read_bandwidth(dev, 1 << 30) if dev.type == "cuda" else 2e10  # reads + writes
    rows = [int(x) for x in args.rows.split(",")]
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "copy_bw_GBps": bw / 1e9,
           "rope": [bench_rope(t, dev, timer, bw) for t in rows],
           "attention": [bench_attention(t, max(args.context, t), dev, timer) for t in rows]}
    print(f"{out['device']}: copy bandwidth {bw / 1e9:.0f} GB/s (reads + writes)")
    print("rope (64 / 8 heads of 128, 64 rotated), ms:  rows | torch eager / graph | compile eager / graph | "
          "kernel eager / graph | floor")
    for r in out["rope"]:
        print(f"  {r['rows']:5d} | {fmt(r['torch_eager_ms'])} / {fmt(r['torch_graph_ms'])} | "
              f"{fmt(r['compile_eager_ms'])} / {fmt(r['compile_graph_ms'])} | {fmt(r['kernel_eager_ms'])} / "
              f"{fmt(r['kernel_graph_ms'])} | {fmt(r['floor_ms'], 4)}")
    print("paged attention, graphed ms:  rows x context (splits) | combine 1 head / program | default (heads)")
    for r in out["attention"]:
        print(f"  {r['rows']} x {r['context']} ({r['num_splits']}) | {fmt(r['one_head_graph_ms'])} | "
              f"{fmt(r['default_graph_ms'])} ({r['block_h'] or 'no combine'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
