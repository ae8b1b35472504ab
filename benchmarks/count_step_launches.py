"""Device launches a pure-decode engine step makes outside its CUDA graphs, counted on the CPU
(issue 18: at batch 1 the step's host time is what the overlap has to hide, and each eager op a
step dispatches costs the host a launch, ~3-10 us on a GPU machine).

Runs a tiny random GLM-4.5-style model (``tests/tiny_models.py``) through ``LLM`` with
``graph_mode="static"``: the graphed forward's path (padded static buffers, the units a CUDA
graph would replay) eagerly on the CPU. Every aten op dispatched during the timed pure-decode
steps is counted, except inside the graph units (``GraphedForward._run``: on a GPU those are one
graph replay each) and except ops that launch no kernel (views, metadata, allocation). Prints the
launches per step and the call sites (file:line) that make them, most first.

Counts, not times: what the GPU host pays per launch is in BENCHMARKS.md's profiles. Usage:
``PYTHONPATH=$PWD python benchmarks/count_step_launches.py [--batch 1] [--k 3] [--steps 10]``; ``--k 0``:
plain decoding; ``--adaptive0``: the adaptive engine held at k = 0 (what its k = 0 steps add);
``--forced-acceptance rate:P``: with the verifier ``bench arms`` installs for speculative arms.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import traceback
from typing import Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

#: aten ops that launch no device kernel (views, metadata, allocations).
NO_KERNEL = ("view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "detach", "alias", "t.",
             "transpose", "unsqueeze", "squeeze", "expand", "permute", "split", "unbind", "empty", "lift_fresh",
             "is_nonzero", "_local_scalar_dense", "sym_", "numel", "size", "stride", "dim", "_reshape_alias",
             "unfold", "narrow", "chunk", "item", "set_.")


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops by (op, first mtpspec call site) while :attr:`on`."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.sites: Dict[str, int] = collections.Counter()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if self.on and not any(w in name.split("aten.")[-1] for w in NO_KERNEL):
            frames = [f for f in traceback.extract_stack()[:-1] if "/mtpspec/" in f.filename]
            site = f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"
            self.sites[f"{name} @ {site}"] += 1
            self.total += 1
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens; 0: plain decoding (no proposer)")
    ap.add_argument("--adaptive0", action="store_true",
                    help="the adaptive engine (k > 0) held at k = 0 by a constant policy: what a k = 0 step "
                         "launches beyond plain decoding (--k 0)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--async-scheduling", action="store_true", help="count with async scheduling on")
    ap.add_argument("--forced-acceptance", help="e.g. rate:0.8: the verifier bench arms installs (k >= 1)")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    from tiny_models import make_tiny_checkpoint

    from mtpspec import LLM, SamplingParams
    from mtpspec.engine.forward import GraphedForward
    from mtpspec.layers.vocab_parallel_embedding import VocabParallelEmbedding

    counter = LaunchCounter()
    run = GraphedForward._run

    def graph_unit(self: Any, *a: Any, **kw: Any) -> Any:  # one replay on a GPU: not counted inside
        was, counter.on = counter.on, False
        try:
            return run(self, *a, **kw)
        finally:
            counter.on = was
    GraphedForward._run = graph_unit
    if args.adaptive0 and args.k < 1:
        ap.error("--adaptive0 needs --k >= 1 (the adaptive engine's num_speculative_tokens)")
    spec = None if args.k == 0 else {"num_speculative_tokens": args.k, "adaptive": args.adaptive0}
    if args.adaptive0:  # a cost table instead of timing steps at start-up (the policy is replaced anyway)
        table = os.path.join(tempfile.mkdtemp(), "costs.json")
        with open(table, "w") as f:
            b = str(max(4, args.batch))
            json.dump({"verify_ms": {str(j): {b: 1.0} for j in range(args.k + 1)},
                       "draft_ms": {str(j): {b: 0.0} for j in range(args.k + 1)}}, f)
        spec["adaptive_cost_table"] = table
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, seed=0, num_mtp_layers=1)
        with LLM(d, graph_mode="static", max_model_len=256, block_size=16, num_kv_blocks=256, seed=0,
                 max_num_seqs=max(4, args.batch), async_scheduling=args.async_scheduling,
                 speculative_config=spec) as llm:
            runner = llm.llm_engine.executor.runner
            if args.adaptive0:
                from bench_adaptive_fixed_k import ConstantK
                llm.llm_engine.spec_policy = ConstantK(0)
            if args.forced_acceptance:
                from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance
                enable_forced_acceptance(llm, ForcedAcceptance.parse(args.forced_acceptance))
            for model in (runner.target, runner.mtp):  # the CPU's id check syncs; a GPU's does not run
                if model is None:
                    continue
                for m in model.modules():
                    if isinstance(m, VocabParallelEmbedding):
                        m.validate_ids = False
            eng = llm.llm_engine
            sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=(args.steps + 8) * (args.k + 1))
            for i in range(args.batch):
                eng.add_request({"prompt_token_ids": [5 + i, 6, 7, 8, 9]}, sp, request_id=str(i))
            while any(s.is_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
                eng.step()
            for _ in range(2):
                eng.step()
            steps0 = runner.fwd.num_graph_steps
            with counter:
                counter.on = True
                for _ in range(args.steps):
                    eng.step()
                counter.on = False
            n = runner.fwd.num_graph_steps - steps0
    GraphedForward._run = run
    per = {k: v / max(n, 1) for k, v in counter.sites.most_common()}
    held = " (adaptive, held at 0)" if args.adaptive0 else ""
    print(f"batch {args.batch}, k = {args.k}{held}, async scheduling {'on' if args.async_scheduling else 'off'}: "
          f"{counter.total / max(n, 1):.1f} launches per pure-decode step outside graph units ({n} steps)")
    for site, c in per.items():
        print(f"  {c:5.1f}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "k": args.k, "adaptive0": args.adaptive0, "steps": n,
                       "per_step": counter.total / max(n, 1), "sites": per}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
