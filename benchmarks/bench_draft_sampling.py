"""Time of a draft token: greedy (``get_top_tokens``) vs sampled (``get_sampled_tokens``, issue 20).

For the lead's GPU check that a sampled draft step stays within 1.1x of a greedy one: the LM-head
part of a draft step at tp 1 (bf16, ``--vocab`` 154880, ``--hidden`` 6144, ``--tokens`` 1 and 64),

* greedy: ``LogitsProcessor.get_top_tokens`` (matmul + Triton local argmax);
* sampled: ``LogitsProcessor.get_sampled_tokens`` at T = 1 as ``MTPProposer._sample_top`` calls
  it: the matmul into a persistent logits buffer, the row hashes (``NoiseRows``), the one-pass
  Gumbel-max kernel and the combine (``mtpspec.ops.gumbel_top``, tp-1 pick fused, ids / log q /
  LSE into persistent buffers);
* sampled, torch reference: ``local_gumbel_top_ref`` (about thirty passes) on precomputed row
  hashes, the torch pick and a copy of the local logits into the buffer.

Eager (CUDA events) and CUDA-graphed medians (``benchmarks/_timing.Timer``), and the ratio to
greedy. Before timing, greedy rows (T = 0) of the sampled path must equal ``get_top_tokens``.
The whole MTP draft step (layer + head) is what the goal compares; add the layer's time (from
``bench_engine_step.py``) to both sides. ``--smoke``: tiny shapes on the CPU.

    python benchmarks/bench_draft_sampling.py [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import Timer  # noqa: E402

import mtpspec.sample.gumbel as gm  # noqa: E402
from mtpspec.layers import LogitsProcessor, ParallelLMHead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.hidden, a.tokens, a.iters = 3000, 64, [1, 8], 3
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    head = ParallelLMHead(a.vocab, a.hidden, params_dtype=torch.bfloat16).to(dev)
    head.weight.data.normal_(0, 0.02)
    lp = LogitsProcessor(a.vocab)
    timer = Timer(dev, a.iters)
    for n in a.tokens:
        h = torch.randn(n, a.hidden, device=dev).bfloat16()
        noise = gm.NoiseRows(torch.arange(n, device=dev), torch.full((n,), 7, device=dev), 2, gm.STREAM_DRAFT)
        rows = noise.hashes()
        out = gm.GumbelPick(torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, device=dev),
                            torch.empty(n, device=dev))
        ones, zeros = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        buf = torch.empty(n, head.weight.shape[0], dtype=torch.bfloat16, device=dev)
        assert torch.equal(lp.get_sampled_tokens(head, h, zeros, rows)[0].token_ids, lp.get_top_tokens(head, h))

        def greedy():
            return lp.get_top_tokens(head, h)

        def sampled():
            return lp.get_sampled_tokens(head, h, ones, noise, out=out, logits_out=buf)[0].token_ids

        def sampled_ref():
            local = lp._local_logits(head, h)
            packed = gm.local_gumbel_top_ref(local, 0, a.vocab, ones, rows)
            buf.copy_(local)
            return gm.pick_gumbel(packed.unsqueeze(0)).token_ids

        res = {"tokens": n, "vocab": a.vocab, "hidden": a.hidden, "device": str(dev)}
        for name, fn in (("greedy", greedy), ("sampled", sampled), ("sampled_ref", sampled_ref)):
            res[name + "_ms"] = timer.eager(fn)
            if dev.type == "cuda":
                res[name + "_graph_ms"] = timer.graph(fn)[0]
        for key in ("sampled", "sampled_ref"):
            res[key + "_over_greedy"] = res[key + "_ms"] / res["greedy_ms"]
            if res.get(key + "_graph_ms") and res.get("greedy_graph_ms"):
                res[key + "_over_greedy_graph"] = res[key + "_graph_ms"] / res["greedy_graph_ms"]
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
