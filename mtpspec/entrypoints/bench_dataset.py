"""Benchmark prompts: real GSM8K text by default, random token ids on request (synthetic).

Real-text prompts are in-distribution text for a GSM8K-trained draft model, so acceptance is
realistic. Each prompt is a chain of solved GSM8K examples in lm-evaluation-harness's format
(:mod:`mtpspec.data.gsm8k`; the data: ``--dataset``, else ``$MTPSPEC_GSM8K_DIR``, else the bundled
copy) ending with an unsolved query ``"Question: ...\\nAnswer:"``;
prompt ``i`` starts its chain at a different row, so prompts differ.

* Without ``input_len``: 5 solved examples + the query, sent as text (natural lengths).
* With ``input_len``: token ids of exactly ``input_len`` tokens: the query's ids, preceded by
  as many solved examples' ids as needed, left-truncated to fit (the prompt may start
  mid-example; the text stays real). Token ids come from the server's ``/tokenize``, so the
  client needs no tokenizer.

Random prompts (``random_prompts(...)``): uniform token ids in ``[0, vocab_size)``. They distort
acceptance (no draft model predicts noise), so every report marks them synthetic.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from mtpspec.data.gsm8k import (FEWSHOT_DELIMITER, fewshot_prompt, format_example, format_query, load_gsm8k,
                                resolve_gsm8k)

Prompt = Union[str, List[int]]


def dataset_path(dataset: Optional[str] = None) -> str:
    """The GSM8K file the prompts come from: ``dataset`` (a JSONL file or a folder holding
    ``test.jsonl``), else ``$MTPSPEC_GSM8K_DIR/test.jsonl``, else the bundled test split.

    Raises:
        mtpspec.data.gsm8k.GSM8KNotFoundError (a ``FileNotFoundError``): nothing there; the
            message names ``--dataset`` (or the variable) and the path.
    """
    return resolve_gsm8k("test", dataset, "--dataset")


def load_dataset(dataset: Optional[str] = None, min_rows: int = 1) -> List[Dict[str, str]]:
    """The rows of :func:`dataset_path` (``{"question", "answer"}``), at least ``min_rows`` of them
    (text prompts need 6: 5 shots + the query; token prompts 1).

    Raises:
        FileNotFoundError: as :func:`dataset_path`; ValueError: a malformed line or fewer than
            ``min_rows`` rows (the message names the file).
    """
    path = dataset_path(dataset)
    rows = load_gsm8k(path)
    if len(rows) < min_rows:
        raise ValueError(f"GSM8K dataset {path!r}: need at least {min_rows} rows, got {len(rows)}")
    return rows


def gsm8k_text_prompts(rows: Sequence[Dict[str, str]], num_prompts: int, num_shots: int = 5) -> List[str]:
    """``num_prompts`` k-shot prompts: prompt ``i`` asks row ``i mod n`` with the next ``num_shots`` rows solved.

    Raises:
        ValueError: fewer than ``num_shots + 1`` rows.
    """
    n = len(rows)
    if n < num_shots + 1:
        raise ValueError(f"need at least {num_shots + 1} GSM8K rows, got {n}")
    out = []
    for i in range(num_prompts):
        q = rows[i % n]
        shots = [rows[(i + 1 + j) % n] for j in range(num_shots)]
        out.append(fewshot_prompt(shots, q["question"]))
    return out


def gsm8k_token_prompts(rows: Sequence[Dict[str, str]], num_prompts: int, input_len: int,
                        tokenize: Callable[[str], List[int]]) -> List[List[int]]:
    """``num_prompts`` prompts of exactly ``input_len`` token ids (see the module docstring).

    Args:
        rows: GSM8K rows (question / answer).
        num_prompts: how many prompts.
        input_len: tokens per prompt (>= 1).
        tokenize: text -> token ids (e.g. the server's ``/tokenize``).

    Raises:
        ValueError: ``input_len < 1`` or no rows.
    """
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if not rows:
        raise ValueError("no GSM8K rows")
    n = len(rows)
    solved: Dict[int, List[int]] = {}
    delim = tokenize(FEWSHOT_DELIMITER)

    def solved_ids(j: int) -> List[int]:
        if j not in solved:
            solved[j] = tokenize(format_example(rows[j]["question"], rows[j]["answer"])) + delim
        return solved[j]

    out = []
    for i in range(num_prompts):
        query = tokenize(format_query(rows[i % n]["question"]))
        prefix: List[int] = []
        j = 1
        while len(prefix) + len(query) < input_len and j <= n:
            prefix = solved_ids((i + j) % n) + prefix
            j += 1
        while len(prefix) + len(query) < input_len:  # tiny datasets: repeat what there is
            prefix = prefix + prefix if prefix else solved_ids((i + 1) % n)
        ids = (prefix + query)[-input_len:]
        out.append(ids)
    return out


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0,
                   avoid: Sequence[int] = ()) -> List[List[int]]:
    """Uniform random token ids (SYNTHETIC), ``avoid`` excluded (e.g. EOS ids)."""
    rng = random.Random(seed)
    bad = set(avoid)
    allowed = [t for t in range(vocab_size) if t not in bad]
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num_prompts)]


def build_prompts(kind: str, num_prompts: int, input_len: Optional[int], vocab_size: int,
                  tokenize: Callable[[str], List[int]], dataset: Optional[str] = None, seed: int = 0) -> List[Prompt]:
    """Prompts for a run: ``kind`` is ``"gsm8k"`` or ``"random"`` (``input_len`` default 1024 there).

    Raises:
        ValueError: unknown kind or a bad dataset; FileNotFoundError: no dataset file
            (see :func:`dataset_path`).
    """
    if kind == "random":
        return random_prompts(num_prompts, input_len or 1024, vocab_size, seed)  # type: ignore[return-value]
    if kind != "gsm8k":
        raise ValueError(f"unknown prompt kind {kind!r}; expected 'gsm8k' or 'random'")
    rows = load_dataset(dataset, 6 if input_len is None else 1)
    if input_len is None:
        return gsm8k_text_prompts(rows, num_prompts)  # type: ignore[return-value]
    return gsm8k_token_prompts(rows, num_prompts, input_len, tokenize)  # type: ignore[return-value]


def describe(prompts: Sequence[Any]) -> str:
    kinds = {type(p).__name__ for p in prompts}
    return f"{len(prompts)} prompts ({'/'.join(sorted(kinds))})"
