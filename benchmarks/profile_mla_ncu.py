"""Run one MLA attention case a few times, for Nsight Compute to profile one launch of the kernel
(issue 14: where the dense Gluon kernel's cycles go at 128 heads: tensor-pipe activity, warp stall
reasons per SASS instruction). The case is :mod:`bench_mla_attention`'s (64 sequences x 8,192 tokens,
bf16 latent cache 512 + 64, blocks shuffled; ``--shared-blocks N``: keys in L2)::

    ncu --clock-control none --kernel-name regex:"_mla_(ws|seesaw)_kernel" --launch-skip 3 --launch-count 1 --set full \\
        --import-source no -o OUT/split_128x4 python3 benchmarks/profile_mla_ncu.py --heads 128 --q 4

``--schedule`` picks the dense Gluon schedule (``split``, ``seesaw``, ``seesaw-r1``); ``--impl`` the
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
    p.add_argument("--schedule", default="split", choices=("split", "seesaw", "seesaw-r1"))
    p.add_argument("--impl", default="gluon")
    p.add_argument("--shared-blocks", type=int, default=0)
    p.add_argument("--launches", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_mla_ncu.py needs a GPU")
    ns = argparse.Namespace(seqs=a.seqs, context=a.context, block_size=64, kv_lora_rank=512, rope=64, nope=128,
                            v_head_dim=128, shared_blocks=a.shared_blocks, kv_cache_dtype="auto")
    c = Case(ns, a.heads, a.q, torch.device("cuda"), torch.bfloat16)
    mla_gluon.DENSE_SCHEDULE = a.schedule
    fn = c.kernel(impl=a.impl)
    for _ in range(a.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{a.impl}:{a.schedule} {a.heads} heads x {a.q}: max abs err vs reference (2 sequences) "
          f"{c.check(2, impl=a.impl):.2e}")


if __name__ == "__main__":
    main()
