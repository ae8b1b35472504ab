"""Regression guard for the bundled demo model: acceptance on fixed GSM8K test prompts (CPU).

Acceptance length is the figure that silently decays when the draft path breaks (off-by-one
draft inputs, pre-norm recycling, wrong layer choice, padding leaks: known faults 1-5), so this
test fails when it drops below a floor set just under the value measured when the model was
bundled (2026-11-29, one run with a distilled MTP phase: 3.23 at k = 3 and 1.88 at k = 1 over the
first 32 test questions; the 8 questions used here measured 3.241 and 1.861, kept below as
FLOOR_*_MEASURED). It also checks that the
drafts change nothing: greedy completions with MTP equal the target's alone.
"""

import os

import pytest
import torch

from mtpspec import LLM, SamplingParams, demo_model_path
from mtpspec.data.gsm8k import bundled_gsm8k_dir, format_query, load_gsm8k

GSM8K_TEST = os.path.join(bundled_gsm8k_dir(), "test.jsonl")  # shipped in the package
NUM_PROMPTS = 8
MAX_TOKENS = 96
# Measured on these 8 prompts (fp32, CPU) when the model was bundled; the floors sit just under.
# k = 3: 3.241 counted the accepted drafts that the "Question:" stop then dropped; 3.220 counts
# emitted drafts only (issue 13). k = 1 is the same either way.
FLOOR_K3_MEASURED, FLOOR_K1_MEASURED = 3.220, 1.861
FLOOR_K3, FLOOR_K1 = 3.14, 1.82


def _prompts():
    rows = load_gsm8k(GSM8K_TEST)[:NUM_PROMPTS]
    return [format_query(r["question"]) for r in rows]


def _run(k: int):
    spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k, "use_local_argmax_reduction": True}
    llm = LLM(demo_model_path(), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=NUM_PROMPTS)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["Question:"]),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def plain():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return _run(0)[0]


@pytest.mark.parametrize("k", [1, 3])
def test_demo_model_acceptance_and_lossless(plain, k):
    tokens, metrics = _run(k)
    assert tokens == plain, "greedy speculative decoding must emit exactly the target's greedy tokens"
    acc = metrics["acceptance_length"]
    print(f"k={k}: acceptance length {acc:.3f}, per position {metrics['num_accepted_tokens_per_pos']}")
    floor = FLOOR_K3 if k == 3 else FLOOR_K1
    assert acc >= floor, f"acceptance length {acc:.3f} at k={k} fell below the floor {floor}"
