"""Self-distillation data helpers (mtpspec.training.self_distill) and their flag checks."""

import itertools

import pytest
import torch

from mtpspec.data.gsm8k import fewshot_prompt
from mtpspec.training.self_distill import SELF_DISTILL_SOURCE, MixedBatches, docs_from_token_lists, self_distill_prompts
from mtpspec.training.train import TrainConfig, check_config

ROWS = [{"question": f"q{i}?", "answer": f"a{i} #### {i}"} for i in range(8)]


def test_prompts_are_the_evaluations_with_train_questions():
    got = self_distill_prompts(ROWS, 5)
    assert got == [fewshot_prompt(ROWS[:5], ROWS[i]["question"]) for i in (5, 6, 7)]
    with pytest.raises(ValueError, match="num_shots = 8"):
        self_distill_prompts(ROWS, 8)


def test_docs_drop_the_too_long_and_keep_order():
    docs = docs_from_token_lists([[1, 2, 3], [4] * 9, [5, 6]], max_len=4)
    assert len(docs) == 2 and docs.dropped == 1
    assert docs.doc(0).tolist() == [1, 2, 3] and docs.doc(1).tolist() == [5, 6]
    assert (docs.source == SELF_DISTILL_SOURCE).all()
    with_prompts = docs_from_token_lists([[1, 2, 3], [4] * 9, [5, 6]], max_len=4, prompt_lens=[2, 5, 1])
    assert with_prompts.loss_start.tolist() == [1, 0]  # the last prompt position; the long one dropped
    with pytest.raises(ValueError, match="prompt length 4 of sequence 0"):
        docs_from_token_lists([[1, 2, 3]], max_len=4, prompt_lens=[4])
    with pytest.raises(ValueError, match="one prompt length per sequence"):
        docs_from_token_lists([[1, 2, 3]], max_len=4, prompt_lens=[1, 2])
    empty = docs_from_token_lists([], max_len=4)
    assert len(empty) == 0 and empty.dropped == 0


def test_batches_carry_loss_start_and_validation_counts_only_from_it():
    """``make_batch`` keeps each row's ``loss_start``; ``Batch.loss_from`` is the flat index."""
    import numpy as np
    import torch
    from mtpspec.training.packing import make_batch
    docs = docs_from_token_lists([[1, 2, 3, 4], [5, 6, 7]], max_len=8, prompt_lens=[3, 1])
    b = make_batch(docs, np.array([1, 0]), pad_id=0, max_len=8, pad_multiple=4)
    assert b.loss_start.tolist() == [0, 2]
    assert b.loss_from(torch.device("cpu")).tolist() == [0] * 4 + [6] * 4
    plain = make_batch(docs_from_token_lists([[1, 2, 3]], max_len=8), np.array([0]), 0, 8)
    assert plain.loss_start is None and plain.loss_from(torch.device("cpu")) is None


def test_mixed_batches_share():
    base, other = itertools.repeat("base"), itertools.repeat("self")
    assert {next(MixedBatches(base, other, 0.0, 0)) for _ in range(50)} == {"base"}
    assert {next(MixedBatches(base, other, 1.0, 0)) for _ in range(50)} == {"self"}
    m = MixedBatches(base, other, 0.3, 0)
    draws = [next(m) for _ in range(4000)]
    assert abs(draws.count("self") / 4000 - 0.3) < 0.03
    m2 = MixedBatches(base, other, 0.3, 0)
    assert [next(m2) for _ in range(4000)] == draws  # seeded
    with pytest.raises(ValueError, match="self-distill-share"):
        MixedBatches(base, other, 1.5, 0)


@pytest.mark.parametrize("kw, match", [
    (dict(self_distill_prompts=10, freeze_target=True), "needs --init-from"),
    (dict(self_distill_prompts=10, init_from="m", distill_fraction=0.0), "--freeze-target"),
    (dict(self_distill_prompts=10, init_from="m", self_distill_share=2.0), "self-distill-share"),
    (dict(self_distill_prompts=10, init_from="m", self_distill_seconds=0.0), "self-distill-seconds"),
    (dict(self_distill_prompts=-1), "self-distill-prompts and --self-distill-synthetic must be >= 0"),
    (dict(self_distill_synthetic=-1), "self-distill-synthetic must be >= 0"),
    (dict(self_distill_synthetic=10, freeze_target=True), "needs --init-from"),
    (dict(freeze_target=True), "--freeze-target needs --init-from"),
    (dict(mtp_distill=1.5), r"--mtp-distill must be in \[0, 1\], got 1.5"),
    (dict(mtp_distill=float("nan")), "--mtp-distill must be in"),
    (dict(lr=-1.0), "--lr must be > 0"),
    (dict(distill_depth=0), "--distill-depth must be >= 1"),
    (dict(mtp_depth=0), "--mtp-depth must be >= 1"),
    (dict(mtp_lambda=-1.0), "--mtp-lambda must be >= 0"),
    (dict(max_steps=-5), "--max-steps must be >= 0"),
    (dict(tokens_per_batch=0), "--tokens-per-batch must be > 0"),
    (dict(self_distill_synthetic=10, init_from="m", distill_fraction=0.0), "--freeze-target"),
])
def test_flag_errors_before_anything_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig(**kw))


def test_stats_count_the_prompts_written_when_the_time_budget_runs_out(monkeypatch):
    """The generated problems come last, so a budget that runs out drops them first: the stats
    count what was written (held-out, GSM8K, generated apart) and a warning says so."""
    import mtpspec.training.self_distill as sd
    from mtpspec.training.train import self_distill_data

    def first_wave_only(model, prompts, max_tokens, max_seconds, kw, wave, log):
        n = 5  # 2 held-out + 2 GSM8K + 1 of the 3 generated
        return [[1, 2, 3]] * n, [2] * n, {"prompts_done": n, "prompts_offered": len(prompts)}

    monkeypatch.setattr(sd, "generate_documents", first_wave_only)
    logs = []
    cfg = TrainConfig(init_from="m", freeze_target=True, gsm8k_limit=300, holdout=20, eval_docs=2,
                      self_distill_prompts=2, self_distill_synthetic=3)
    docs, val_docs, st = self_distill_data(cfg, torch.device("cpu"), log=logs.append)
    assert (len(docs), len(val_docs)) == (3, 2)
    assert (st["held_out_prompts"], st["gsm8k_prompts_done"], st["gsm8k_prompts_offered"],
            st["generated_prompts_done"], st["generated_prompts_offered"]) == (2, 2, 2, 1, 3)
    assert any("ran out after 3 of 5 prompts (1 of 3 generated" in m for m in logs)
