"""GSM8K: the bundled data (``mtpspec/data/gsm8k/*.jsonl``), where to find it, and its text format.

Data: :func:`resolve_gsm8k` picks one split file: an explicit path (a command's data flag: a
JSONL file, or a folder holding ``train.jsonl`` / ``test.jsonl``), else the folder in
``$MTPSPEC_GSM8K_DIR``, else the copy bundled with the package (MIT licence, verbatim from
openai/grade-school-math; see ``README.md`` beside this file). A path that is given but holds
no such file raises :class:`GSM8KNotFoundError` naming it; nothing is searched beyond.

Format: exactly as lm-evaluation-harness's 5-shot ``gsm8k`` task prompts it.

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
from typing import Dict, List, Sequence, Union

EOT = "<|endoftext|>"
FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "
ANSWER_PROMPT = "Answer:"

BUNDLED_DIR = os.path.dirname(os.path.abspath(__file__))
ENV_VAR = "MTPSPEC_GSM8K_DIR"
SPLITS = ("train", "test")


def check_example(question: str, answer: str | None = None) -> None:
    """A GSM8K row's fields: a non-empty question and (when given) an answer with its ``#### n`` gold line.

    Raises:
        ValueError: either is not so (the message names the field and shows the value).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    if answer is not None and (not isinstance(answer, str) or "#### " not in answer):
        raise ValueError(f"answer has no '#### n' line (a GSM8K solution ends in its gold number so; scoring reads "
                         f"it), got {answer!r}")


def format_query(question: str) -> str:
    """``"Question: {question}\\nAnswer:"`` (lm-eval's ``doc_to_text``)."""
    check_example(question)
    return f"Question: {question}\n{ANSWER_PROMPT}"


def format_example(question: str, answer: str) -> str:
    """A solved example: ``format_query(question) + " " + answer``.

    Raises:
        ValueError: empty question, or an answer without a ``#### `` line.
    """
    check_example(question, answer)
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
        ValueError: naming ``path:line``: a line that is not a JSON object with string ``question``
            and ``answer``; or a file with no rows at all.
    """
    rows: List[Dict[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg} at column {exc.colno}); expected one "
                                 "object with 'question' and 'answer' per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object with 'question' and 'answer', got "
                                 f"{type(row).__name__}")
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{n}: expected keys 'question' and 'answer', got {sorted(row)}")
            if not isinstance(row["question"], str) or not isinstance(row["answer"], str):
                raise ValueError(f"{path}:{n}: 'question' and 'answer' must be strings")
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise ValueError(f"{path}: no GSM8K rows (the file is empty); expected one JSON object with 'question' and "
                         "'answer' per line")
    return rows


class GSM8KNotFoundError(FileNotFoundError):
    """A GSM8K path was given (flag or ``$MTPSPEC_GSM8K_DIR``) but holds no GSM8K split file.

    ``str(err)`` is the whole message: which setting, the path and what was expected there.
    """


def bundled_gsm8k_dir() -> str:
    """The folder of the GSM8K copy shipped inside the package (``mtpspec/data/gsm8k``)."""
    return BUNDLED_DIR


def resolve_gsm8k(split: str = "test", path: Union[str, "os.PathLike[str]", None] = None,
                  source: str = "--data") -> str:
    """The GSM8K ``split`` file to read: ``path``, else ``$MTPSPEC_GSM8K_DIR``, else the bundled copy.

    Args:
        split: ``"train"`` or ``"test"``; names the file looked for in a folder.
        path: an explicit JSONL file (used as is, whatever its name) or a folder holding
            ``<split>.jsonl``; ``None`` or ``""`` means not given. ``$MTPSPEC_GSM8K_DIR`` must
            name a folder.
        source: how ``path`` was given (the flag's name), quoted in the error message.

    Returns:
        the path of an existing file (a string).

    Raises:
        ValueError: ``split`` is not ``"train"`` / ``"test"``.
        GSM8KNotFoundError: ``path`` (or ``$MTPSPEC_GSM8K_DIR`` when ``path`` is not given) is
            set but is neither a file nor a folder with ``<split>.jsonl``; the message names the
            setting and the path.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    explicit = path is not None and os.fspath(path) != ""
    if explicit:
        given, what = os.fspath(path), source
    elif os.environ.get(ENV_VAR):
        given, what = os.environ[ENV_VAR], f"${ENV_VAR}"
    else:
        given, what = BUNDLED_DIR, "the bundled GSM8K copy"
    if explicit and os.path.isfile(given):  # a file only as an explicit path: the variable names a folder
        return given
    expected = f"a folder holding {split}.jsonl"
    if explicit:
        expected = "a GSM8K JSONL file, or " + expected
    if os.path.isdir(given):
        f = os.path.join(given, f"{split}.jsonl")
        if os.path.isfile(f):
            return f
        raise GSM8KNotFoundError(f"{what}: no {split}.jsonl in the folder {given!r} (expected {expected})")
    raise GSM8KNotFoundError(f"{what}: no {'file or ' if explicit else ''}folder at {given!r} (expected {expected})")


def load_split(split: str = "test", path: Union[str, "os.PathLike[str]", None] = None,
               source: str = "--data") -> List[Dict[str, str]]:
    """``load_gsm8k(resolve_gsm8k(split, path, source))``: the rows of one split.

    Raises:
        GSM8KNotFoundError, ValueError: as :func:`resolve_gsm8k` and :func:`load_gsm8k`.
    """
    return load_gsm8k(resolve_gsm8k(split, path, source))
