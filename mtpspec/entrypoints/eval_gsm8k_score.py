"""GSM8K scoring exactly as lm-evaluation-harness's ``gsm8k`` task (task version 3).

From ``lm_eval/tasks/gsm8k/gsm8k.yaml``, ``lm_eval/filters/extraction.py`` (``RegexFilter``) and
``lm_eval/api/metrics.py`` (``exact_match_hf_evaluate``, ``mean_stderr``):

* ``strict-match``: the first match of ``#### (\\-?[0-9\\.\\,]+)`` in the completion (its group,
  stripped), else ``"[invalid]"``;
* ``flexible-extract``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` (its first non-empty
  group, stripped), else ``"[invalid]"``;
* ``exact_match`` of the extracted string against the reference answer after deleting, in
  order, the regexes ``","``, ``"\\$"``, ``"(?s).*#### "``, ``"\\.$"`` from both, then
  lower-casing both;
* standard error of a mean of 0/1 scores: ``sqrt(p (1 - p) / (n - 1))`` (sample standard
  deviation over ``sqrt(n)``).
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

INVALID = "[invalid]"
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE_RES = [",", r"\$", r"(?s).*#### ", r"\.$"]
STOP_SEQUENCES = ["Question:", "</s>", "<|im_end|>"]


def _extract(regex: re.Pattern, text: str, group_select: int) -> str:
    matches = regex.findall(text if isinstance(text, str) else "")
    if not matches:
        return INVALID
    m = matches[group_select]
    if isinstance(m, tuple):
        parts = [x for x in m if x]
        if not parts:
            return INVALID
        m = parts[0]
    return m.strip()


def strict_extract(completion: str) -> str:
    """``strict-match`` prediction of a completion."""
    return _extract(STRICT_RE, completion, 0)


def flexible_extract(completion: str) -> str:
    """``flexible-extract`` prediction of a completion."""
    return _extract(FLEXIBLE_RE, completion, -1)


def normalise(text: str) -> str:
    """Apply lm-eval's ``regexes_to_ignore`` in order, then lower-case."""
    for pattern in IGNORE_RES:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(prediction: str, reference_answer: str) -> bool:
    """Whether ``prediction`` equals the reference (the full GSM8K ``answer`` string) after normalising."""
    return normalise(prediction) == normalise(reference_answer)


def mean_stderr(scores: Sequence[float]) -> Tuple[float, Optional[float]]:
    """Mean and its standard error (``None`` below 2 samples)."""
    n = len(scores)
    if n == 0:
        return float("nan"), None
    mu = sum(scores) / n
    if n < 2:
        return mu, None
    var = sum((x - mu) ** 2 for x in scores) / (n - 1)
    return mu, math.sqrt(var / n)


def score_completions(completions: Sequence[str], answers: Sequence[str]) -> Dict[str, object]:
    """Both metrics over a set of completions.

    Returns:
        ``{"strict-match": {"accuracy", "stderr", "correct": [bool]}, "flexible-extract": {...},
        "n": int}`` plus the extracted predictions per metric.

    Raises:
        ValueError: different numbers of completions and answers.
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions for {len(answers)} answers")
    out: Dict[str, object] = {"n": len(completions)}
    for name, fn in (("strict-match", strict_extract), ("flexible-extract", flexible_extract)):
        preds: List[str] = [fn(c) for c in completions]
        correct = [exact_match(p, a) for p, a in zip(preds, answers)]
        acc, se = mean_stderr([1.0 if c else 0.0 for c in correct])
        out[name] = {"accuracy": acc, "stderr": se, "correct": correct, "predictions": preds}
    return out
