"""Run one MLA attention case a few times, for Nsight Compute to profile one launch of the kernel
(issue 14: where the dense Gluon kernel's cycles go at 128 heads: tensor-pipe activity, warp stall
reasons per SASS instruction). The case is :mod:`bench_mla_attention`'s (64 sequences x 8,192 tokens,
bf16 latent cache 512 + 64, blocks shuffled; ``--shared-blocks N``: keys in L2)::

    ncu --clock-control none --kernel-name regex:"_mla_(ws|seesaw)_kernel" --launch-skip 3 --launch-count 1 --set full \\
        --import-source no -o OUT/split_128x4 python3 benchmarks/profile_mla_ncu.py --heads 128 --q 4

``--sparse``: the sparse kernel (issue 15) on :mod:`bench_sparse_mla`'s case instead (64 sequences x 32,768
tokens, ``index_topk`` 2,048 random causal positions a row; kernel regex ``_sparse_mla_ws_kernel`` for gluon).
``--schedule`` picks the dense Gluon schedule (``split``, ``split-pv``, ``seesaw``, ``seesaw-r1``); ``--impl`` the
kernel (``gluon`` by default; ``triton``). Launches ``--launches`` times (default 5) and checks the last
output against the torch reference on the first 2 sequences (prints the max abs error). GPU only.
``benchmarks/run_goals_h200.sh mla-ncu OUT`` runs the profiles and prints their summaries.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_mla_attention import Case  # noqa: E402
from mtpspec.ops import mla_gluon  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--q", type=int, default=4, help="query rows per sequence (1 + k)")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--schedule", default="split", choices=("split", "split-pv", "seesaw", "seesaw-r1"))
    p.add_argument("--impl", default="gluon")
    p.add_argument("--shared-blocks", type=int, default=0)
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--l2-ahead", type=int, default=0, help="dense: the producer's L2 prefetch distance (tiles)")
    p.add_argument("--sparse", action="store_true", help="the sparse MLA kernel (bench_sparse_mla's case)")
    p.add_argument("--topk", type=int, default=2048)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_mla_ncu.py needs a GPU")
    if a.sparse:
        return sparse(a)
    ns = argparse.Namespace(seqs=a.seqs, context=a.context, block_size=64, kv_lora_rank=512, rope=64, nope=128,
                            v_head_dim=128, shared_blocks=a.shared_blocks, kv_cache_dtype="auto")
    c = Case(ns, a.heads, a.q, torch.device("cuda"), torch.bfloat16)
    mla_gluon.DENSE_SCHEDULE, mla_gluon.L2_AHEAD = a.schedule, a.l2_ahead
    fn = c.kernel(impl=a.impl)
    for _ in range(a.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{a.impl}:{a.schedule}@{a.l2_ahead} {a.heads} heads x {a.q}: max abs err vs reference (2 sequences) "
          f"{c.check(2, impl=a.impl):.2e}")


def sparse(a: argparse.Namespace) -> None:
    """The sparse kernel on ``bench_sparse_mla``'s paged case (``--context`` default there: 32,768)."""
    from bench_sparse_mla import Paged, random_selection
    from mtpspec.ops import sparse_mla_attention as sp
    device, dtype = torch.device("cuda"), torch.bfloat16
    ns = argparse.Namespace(seqs=a.seqs, context=a.context, block_size=64, topk=a.topk)
    g = torch.Generator(device="cpu").manual_seed(2)
    pg = Paged(ns, a.q, device)
    cache = (torch.randn(pg.num_blocks, 64, 576, generator=g) * 0.5).to(dtype).to(device)
    ql = torch.randn(pg.t, a.heads, 512, generator=g).to(dtype).to(device)
    qp = torch.randn(pg.t, a.heads, 64, generator=g).to(dtype).to(device)
    slots = random_selection(ns, pg, device)
    args = (ql, qp, cache, slots, (128 + 64) ** -0.5)
    for _ in range(a.launches):
        out = sp.sparse_mla_attention(*args, impl=a.impl)
    torch.cuda.synchronize()
    n = 2 * a.q
    ref = sp.sparse_mla_attention_ref(ql[:n], qp[:n], cache, slots[:n], args[4]).float()
    print(f"sparse {a.impl} {a.heads} heads x {a.q}, topk {a.topk}: max abs err vs reference (2 sequences) "
          f"{(out[:n].float() - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
