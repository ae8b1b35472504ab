"""Local GSM8K for lm-evaluation-harness (``gsm8k_local.yaml``): no hub access, no dataset cache."""

from __future__ import annotations

import json
import os
from typing import Any


def _data_dir(data_dir: Any = None) -> str:
    if os.environ.get("MTPSPEC_GSM8K_DIR"):
        return os.environ["MTPSPEC_GSM8K_DIR"]
    if data_dir:
        return str(data_dir)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(os.path.dirname(repo), "shared", "data", "gsm8k")


def _rows(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"question": r["question"], "answer": r["answer"]} for r in rows]


def load_gsm8k_local(data_dir: Any = None, **_: Any) -> Any:
    """``DatasetDict`` with ``train`` and ``test`` from ``<data_dir>/{train,test}.jsonl``.

    Raises:
        FileNotFoundError: a split file is missing (the message names the folder tried).
    """
    import datasets

    folder = _data_dir(data_dir)
    splits = {}
    for split in ("train", "test"):
        path = os.path.join(folder, f"{split}.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GSM8K {split} split not found at {path}; set MTPSPEC_GSM8K_DIR or "
                                    "--metadata '{\"data_dir\": ...}'")
        splits[split] = datasets.Dataset.from_list(_rows(path))
    return datasets.DatasetDict(splits)
