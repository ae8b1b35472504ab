"""Training corpus: GSM8K train rows plus generated word problems, as token-id documents.

Documents (:func:`mtpspec.data.gsm8k.training_document`) are single solved examples
or k-shot chains (``num_shots`` solved examples and one more, joined by ``"\\n\\n"`` exactly as a
``num_shots``-shot evaluation prompt shows them), each ending with the end-of-text token.
Chains are drawn within one source (GSM8K with GSM8K, generated with generated), so a 5-shot
GSM8K prompt is exactly in the training distribution. GSM8K rows are re-chained in every
pass (``gsm8k_epochs`` passes), the generated problems once.

Each document is tokenised as one string (so tokens across the ``"\\n\\n"`` joins are the
ones a prompt gets). Documents longer than ``max_len`` tokens are dropped (counted).
"""

from __future__ import annotations

import multiprocessing as mp
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mtpspec.data.gsm8k import training_document
from mtpspec.training.word_problems import generate_problem


@dataclass
class TokenDocs:
    """Documents as one flat ``int32`` token array: document ``d`` is
    ``tokens[offsets[d]:offsets[d + 1]]``; ``source[d]`` is 0 (GSM8K), 1 (generated) or 2
    (self-distillation, :mod:`mtpspec.training.self_distill`). ``loss_start[d]`` (optional, int64):
    the first position of document ``d`` whose predictions count in the loss (none: all)."""

    tokens: np.ndarray
    offsets: np.ndarray
    source: np.ndarray
    dropped: int = 0
    loss_start: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]


def _gen_chunk(args: Tuple[int, int, int]) -> List[Dict[str, str]]:
    seed, start, stop = args
    return [{"question": p.question, "answer": p.answer}
            for p in (generate_problem(seed, i) for i in range(start, stop))]


def generate_examples(n: int, seed: int, workers: int = 1) -> List[Dict[str, str]]:
    """Generated problems ``0..n-1`` of stream ``seed`` as ``{"question", "answer"}`` dicts, in
    order (identical for any ``workers``)."""
    if workers <= 1 or n < 20_000:
        return _gen_chunk((seed, 0, n))
    step = (n + workers * 4 - 1) // (workers * 4)
    chunks = [(seed, s, min(n, s + step)) for s in range(0, n, step)]
    with mp.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_gen_chunk, chunks)
    return [x for part in parts for x in part]


def chain_documents(examples: Sequence[Dict[str, str]], rng: random.Random, single_prob: float,
                    num_shots: int) -> List[str]:
    """Every example exactly once, shuffled, grouped into documents of 1 example (probability
    ``single_prob``) or ``num_shots + 1`` examples (the last group may be shorter)."""
    if not 0.0 <= single_prob <= 1.0 or num_shots < 0:
        raise ValueError(f"need 0 <= single_prob <= 1 and num_shots >= 0, got {single_prob}, {num_shots}")
    order = list(range(len(examples)))
    rng.shuffle(order)
    docs, i = [], 0
    while i < len(order):
        n = 1 if rng.random() < single_prob else num_shots + 1
        docs.append(training_document([examples[j] for j in order[i:i + n]]))
        i += n
    return docs


def tokenize_documents(tok, docs: Sequence[str], source: Sequence[int], max_len: int,
                       batch_size: int = 4096) -> TokenDocs:
    """Encode ``docs`` (HF ``tokenizers`` ``encode_batch``, parallel in Rust); drop those longer
    than ``max_len`` tokens."""
    arrays, kept_src, dropped = [], [], 0
    for s in range(0, len(docs), batch_size):
        for enc, src in zip(tok.encode_batch(list(docs[s:s + batch_size])), source[s:s + batch_size]):
            ids = enc.ids
            if len(ids) > max_len:
                dropped += 1
                continue
            arrays.append(np.asarray(ids, dtype=np.int32))
            kept_src.append(src)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    return TokenDocs(tokens, offsets, np.asarray(kept_src, dtype=np.int8), dropped)


@dataclass
class CorpusPlan:
    """What to put in the training corpus (see the module docstring)."""

    gsm8k_rows: List[Dict[str, str]]
    synthetic: List[Dict[str, str]]
    gsm8k_epochs: int
    single_prob: float = 0.6
    num_shots: int = 5
    seed: int = 0
    max_len: int = 2048
    stats: Dict[str, int] = field(default_factory=dict)

    def documents(self) -> Tuple[List[str], List[int]]:
        """All training document strings and their sources (0 GSM8K, 1 generated)."""
        rng = random.Random(self.seed)
        docs, src = [], []
        for _ in range(self.gsm8k_epochs):
            d = chain_documents(self.gsm8k_rows, rng, self.single_prob, self.num_shots)
            docs += d
            src += [0] * len(d)
        d = chain_documents(self.synthetic, rng, self.single_prob, self.num_shots)
        docs += d
        src += [1] * len(d)
        return docs, src
