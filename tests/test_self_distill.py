"""Self-distillation data helpers (mtpspec.training.self_distill) and their flag checks."""

import itertools

import pytest

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
    empty = docs_from_token_lists([], max_len=4)
    assert len(empty) == 0 and empty.dropped == 0


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
    (dict(self_distill_prompts=10), "needs --init-from"),
    (dict(self_distill_prompts=10, init_from="m", distill_fraction=0.0), "--freeze-target"),
    (dict(self_distill_prompts=10, init_from="m", self_distill_share=2.0), "self-distill-share"),
    (dict(self_distill_prompts=10, init_from="m", self_distill_seconds=0.0), "self-distill-seconds"),
    (dict(self_distill_prompts=-1), "self-distill-prompts must be >= 0"),
])
def test_flag_errors_before_anything_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig(**kw))
