"""Acceptance length with sampled vs greedy MTP drafts (issue 20), on the bundled demo model.

GSM8K test questions as zero-shot prompts (``format_query``), ``temperature`` (default 1.0), one
seed per prompt (the same in both arms), k = ``-k`` (default 3), ``--max-tokens`` (default 96;
stops at EOS / ``"Question:"``). Arms: ``speculative_config["draft_sampling"]`` ``"greedy"`` and
``"auto"``. Prints one JSON line per arm (acceptance length = 1 + accepted / drafts, per-position
acceptance rates, output tokens). CPU is enough::

    PYTHONPATH=. python benchmarks/acceptance_draft_sampling.py --prompts 64
"""

from __future__ import annotations

import argparse
import json

from mtpspec import LLM, SamplingParams, demo_model_path
from mtpspec.data.gsm8k import format_query, load_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    rows = load_split("test")[:a.prompts]
    prompts = [format_query(r["question"]) for r in rows]
    params = [SamplingParams(temperature=a.temperature, seed=1000 + i, max_tokens=a.max_tokens, stop=["Question:"])
              for i in range(len(prompts))]
    for mode in ("greedy", "auto"):
        spec = {"num_speculative_tokens": a.k, "use_local_argmax_reduction": True, "draft_sampling": mode}
        with LLM(a.model or demo_model_path(), tensor_parallel_size=a.tp, speculative_config=spec,
                 device=a.device, max_num_seqs=32, seed=0) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.get_metrics()
        print(json.dumps(dict(draft_sampling=mode, temperature=a.temperature, k=a.k, prompts=len(prompts),
                              acceptance_length=m["acceptance_length"], acceptance_rate=m["acceptance_rate"],
                              accepted_per_pos=m["num_accepted_tokens_per_pos"], num_drafts=m["num_drafts"],
                              output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                              comm_bytes_per_step=m["comm_bytes_per_step"])), flush=True)


if __name__ == "__main__":
    main()
