"""Bytes per draft step of sampled (Gumbel-max) drafts vs a full-logits all-gather, on CPU ranks.

Issue 20's byte goal, counted by the engine's own collective counters
(``mtpspec.distributed.comm_stats``; shapes only, so CPU gloo ranks count what NCCL ranks send):
for each tp in ``--tp`` and vocab in ``--vocab`` (default GLM-5's 154880 and the bundled demo
model's 10007), ``--seqs`` sequences (default 64) through a bf16 ``ParallelLMHead``:

* ``full``: ``LogitsProcessor.compute_logits`` (the gathered path: all-gather of ``[seqs, vocab / tp]``);
* ``greedy``: ``get_top_tokens`` (``[seqs, 2]`` float64 pairs);
* ``sampled``: ``get_sampled_tokens`` at T = 1 (``[seqs, 4]`` float32 Gumbel-max rows, counted as
  ``all_gather_draft_sample``).

Also checks on every rank that the sampled ids equal tp 1's Gumbel-max draw from the gathered
logits (noise per global token id: bit-identical). Prints one JSON line per (tp, vocab)::

    PYTHONPATH=. python benchmarks/draft_sampling_bytes.py --tp 2 8
"""

from __future__ import annotations

import argparse
import json

import torch

from mtpspec.distributed import comm_stats, launch, reset_comm_stats
from mtpspec.layers.logits_processor import LogitsProcessor
from mtpspec.layers.vocab_parallel_embedding import ParallelLMHead
from mtpspec.sample.gumbel import row_hash, vocab_parallel_gumbel_sample


def measure(vocab: int, hidden: int, seqs: int):
    """On one rank: (bytes sent per path, sampled ids, tp-1 reference ids)."""
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, torch.randn(vocab, hidden, generator=g))
    h = torch.randn(seqs, hidden, generator=g).bfloat16()
    lp = LogitsProcessor(vocab)
    temp = torch.ones(seqs)
    rows = row_hash(torch.arange(seqs, dtype=torch.int64), torch.full((seqs,), 7), 2)
    out = {}
    reset_comm_stats()
    full = lp.compute_logits(head, h)
    out["full"] = sum(v["bytes_sent"] for v in comm_stats().values())
    reset_comm_stats()
    lp.get_top_tokens(head, h)
    out["greedy"] = sum(v["bytes_sent"] for v in comm_stats().values())
    reset_comm_stats()
    pick, _ = lp.get_sampled_tokens(head, h, temp, rows)
    stats = comm_stats()
    out["sampled"] = sum(v["bytes_sent"] for v in stats.values())
    out["sampled_ops"] = sorted(stats)
    import mtpspec.sample.gumbel as gm
    ref = gm.pick_gumbel(gm.local_gumbel_top(full, 0, vocab, temp, rows).unsqueeze(0)).token_ids
    return out, pick.token_ids, ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[8])
    ap.add_argument("--vocab", type=int, nargs="+", default=[154880, 10007])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    a = ap.parse_args()
    for tp in a.tp:
        for v in a.vocab:
            res = launch(measure, tp, v, a.hidden, a.seqs, timeout_s=600)
            b, ids, ref = res[0]
            assert all(torch.equal(r[1], ids) for r in res) and torch.equal(ids, ref), "ids differ"
            print(json.dumps(dict(tp=tp, vocab=v, seqs=a.seqs, bytes_full=b["full"], bytes_greedy=b["greedy"],
                                  bytes_sampled=b["sampled"], sampled_ops=b["sampled_ops"],
                                  sampled_over_full=b["sampled"] / b["full"])), flush=True)


if __name__ == "__main__":
    main()
