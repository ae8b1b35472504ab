"""Time a model's step costs for adaptive speculation length once and save them (issue 18).

``python3 benchmarks/calibrate_spec_costs.py --model M -k 3 --out costs.json [engine flags]`` builds
the engine with ``--adaptive-speculation`` (the ranks time verify + draft per padded batch size and
k at start-up: :func:`mtpspec.spec_decode.adaptive.measure_step_costs`), writes the table, and
prints it. Later runs read it instead of timing again:
``--speculative-config '{"num_speculative_tokens": 3, "adaptive": true, "adaptive_cost_table": "costs.json"}'``.
The table holds for the same model, GPU, tp, dtype, ``max_num_seqs`` and graph mode.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mtpspec.engine.arg_utils import EngineArgs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(p)
    p.add_argument("--out", required=True, help="where to write the step cost table (JSON)")
    args = p.parse_args(argv)
    args.adaptive_speculation = True
    from mtpspec import LLM
    kwargs = EngineArgs.from_cli_args(args).llm_kwargs()
    with LLM(**kwargs) as llm:
        costs = llm.llm_engine.spec_policy.costs
        costs.save(args.out)
    print(f"wrote {args.out}: k = {costs.ks}, batch sizes {sorted(costs.verify_ms[0])} ({costs.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
