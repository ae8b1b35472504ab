"""GSM8K text format, exactly as lm-evaluation-harness's 5-shot ``gsm8k`` task prompts it.

From EleutherAI lm-evaluation-harness ``lm_eval/tasks/gsm8k/gsm8k.yaml`` (task version 3) and
the ``TaskConfig`` defaults in ``lm_eval/api/task.py``:

- ``doc_to_text: "Question: {{question}}\\nAnswer:"``, ``doc_to_target: "{{answer}}"``;
- ``target_delimiter`` (default) ``" "``, so a solved example reads
  ``"Question: " + question + "\\nAnswer: " + answer`` (the answer keeps its ``<<a*b=c>>``
  annotations and its final ``#### n`` line);
- ``fewshot_delimiter`` (default) ``"\\n\\n"`` between examples; ``num_fewshot: 5`` with
  examples drawn from the train split; the query ends with ``"Answer:"`` (no trailing space);
- generation stops at ``"Question:"``, ``"</s>"`` or ``"<|im_end|>"`` (greedy); scores:
  ``strict-match`` takes the first ``#### (\\-?[0-9\\.\\,]+)``, ``flexible-extract`` the last
  match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``.

Training text: every document ends with the end-of-text token :data:`EOT` (the engine stops
on it). A document is either one solved example, or a chain of solved examples joined by
``"\\n\\n"`` exactly as a k-shot prompt shows them followed by the query's solved answer, so
that both zero-shot and 5-shot prompts are in the training distribution.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

EOT = "<|endoftext|>"
FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "
ANSWER_PROMPT = "Answer:"


def _check(question: str, answer: str | None = None) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    if answer is not None and (not isinstance(answer, str) or "#### " not in answer):
        raise ValueError(f"answer must be a GSM8K solution string ending in a '#### n' line, got {answer!r}")


def format_query(question: str) -> str:
    """``"Question: {question}\\nAnswer:"`` (lm-eval's ``doc_to_text``)."""
    _check(question)
    return f"Question: {question}\n{ANSWER_PROMPT}"


def format_example(question: str, answer: str) -> str:
    """A solved example: ``format_query(question) + " " + answer``.

    Raises:
        ValueError: empty question, or an answer without a ``#### `` line.
    """
    _check(question, answer)
    return format_query(question) + TARGET_DELIMITER + answer


def fewshot_prompt(shots: Sequence[Dict[str, str]], question: str) -> str:
    """A k-shot prompt: solved ``shots`` joined by ``"\\n\\n"``, then the query.

    Args:
        shots: dicts with ``"question"`` and ``"answer"`` (GSM8K rows), in prompt order.
        question: the question to ask.
    """
    parts = [format_example(s["question"], s["answer"]) for s in shots]
    parts.append(format_query(question))
    return FEWSHOT_DELIMITER.join(parts)


def training_document(examples: Sequence[Dict[str, str]]) -> str:
    """One training document: ``examples`` (>= 1) as a k-shot chain, then :data:`EOT`.

    ``training_document(shots + [query])`` equals ``fewshot_prompt(shots, query["question"]) +
    " " + query["answer"] + EOT``.
    """
    if len(examples) < 1:
        raise ValueError("a training document needs at least one example")
    return FEWSHOT_DELIMITER.join(format_example(e["question"], e["answer"]) for e in examples) + EOT


def load_gsm8k(path: str | os.PathLike) -> List[Dict[str, str]]:
    """Rows ``{"question", "answer"}`` of a GSM8K JSON-lines file (read at run time).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a line without ``question``/``answer``.
    """
    rows: List[Dict[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{n}: expected keys 'question' and 'answer', got {sorted(row)}")
            rows.append({"question": row["question"], "answer": row["answer"]})
    return rows


def default_gsm8k_dir() -> str:
    """Where GSM8K's ``train.jsonl`` / ``test.jsonl`` are looked for: ``$MTPSPEC_GSM8K_DIR`` if set,
    else the first existing of ``shared/data/gsm8k`` beside the repository checkout, inside it,
    inside or beside the current directory (the first candidate when none exists)."""
    env = os.environ.get("MTPSPEC_GSM8K_DIR")
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rel = os.path.join("shared", "data", "gsm8k")
    cands = [os.path.join(os.path.dirname(repo), rel), os.path.join(repo, rel), os.path.join(os.getcwd(), rel),
             os.path.join(os.path.dirname(os.getcwd()), rel)]
    return next((c for c in cands if os.path.isfile(os.path.join(c, "train.jsonl"))), cands[0])
