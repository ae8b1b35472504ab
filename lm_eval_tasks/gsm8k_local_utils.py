"""Local GSM8K for lm-evaluation-harness (``gsm8k_local.yaml``): no hub access, no dataset cache.

The files are found by :func:`mtpspec.data.gsm8k.resolve_gsm8k`, the one rule every mtpspec
command uses: ``--metadata '{"data_dir": ...}'`` (a folder with ``train.jsonl`` / ``test.jsonl``),
else ``$MTPSPEC_GSM8K_DIR``, else the copy bundled with mtpspec (``mtpspec/data/gsm8k``). When
lm_eval runs in an environment without mtpspec installed, this checkout's copy of the package is
used.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _resolve(split: str, data_dir: Any = None) -> str:
    try:
        from mtpspec.data.gsm8k import resolve_gsm8k
    except ImportError:  # mtpspec not installed where lm_eval runs: this checkout's package
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from mtpspec.data.gsm8k import resolve_gsm8k
    return resolve_gsm8k(split, str(data_dir) if data_dir else None, "--metadata data_dir")


def _rows(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"question": r["question"], "answer": r["answer"]} for r in rows]


def load_gsm8k_local(data_dir: Any = None, **_: Any) -> Any:
    """``DatasetDict`` with ``train`` and ``test`` from ``<data_dir>/{train,test}.jsonl``.

    Raises:
        FileNotFoundError: a split file is missing (the message names the setting and the path).
    """
    import datasets

    splits = {split: datasets.Dataset.from_list(_rows(_resolve(split, data_dir))) for split in ("train", "test")}
    return datasets.DatasetDict(splits)
