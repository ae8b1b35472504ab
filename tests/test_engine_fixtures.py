"""Shared helpers for the engine tests (no tests here).

* :func:`make_model` writes a tiny random GLM-4.5-family checkpoint (Hugging Face layout, plus
  random MTP layers) and a word-level tokenizer whose token ``i`` is the word ``w{i}``.
* :class:`OracleDrafts` is a ``draft_hook``: it proposes the true greedy continuation (from a
  plain-decoding reference run) with a deterministic fraction of the tokens corrupted, so
  verification sees every accepted length ``0 .. k`` (random MTP layers alone almost never
  agree with the target).
* :func:`repo_env` is the environment of a child process that imports this checkout's ``mtpspec``.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Dict, List, Sequence, Tuple

import torch

torch.set_num_threads(1)  # the CI box has 2 cores shared by several processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_env(**extra: str) -> Dict[str, str]:
    """``os.environ`` with ``extra`` set and the repository root first on ``PYTHONPATH`` (then the
    inherited entries, if any): for a child process (``subprocess``) that must import this checkout."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def make_model(path: str, seed: int = 0, num_mtp_layers: int = 1, tokenizer: bool = True, **overrides) -> Tuple:
    """Write the checkpoint (and tokenizer) to ``path``; returns ``(hf_model, config)``."""
    from tiny_models import make_tiny_checkpoint
    hf, cfg = make_tiny_checkpoint(path, seed=seed, num_mtp_layers=num_mtp_layers, **overrides)
    if tokenizer:
        write_word_tokenizer(path, cfg.vocab_size)
    return hf, cfg


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


def mixed_prompts(n: int, vocab: int, seed: int, max_len: int = 20) -> List[List[int]]:
    """``n`` prompts of lengths spread over ``1 .. max_len`` (ids avoid the EOS ids 1, 2)."""
    rng = random.Random(seed)
    lens = [1, max_len, 2, 7, 13, 4, 17, 9][:n] if n <= 8 else [rng.randint(1, max_len) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(m)] for m in lens]


def token_prompts(prompts: Sequence[Sequence[int]]) -> List[Dict[str, List[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


class OracleDrafts:
    """Draft hook: reference continuation with a deterministic share of corrupted drafts.

    Args:
        reference: prompt tuple -> greedy continuation (long enough to cover the drafts).
        vocab: vocabulary size.
        corrupt: probability that a draft token is replaced by a wrong one.
    """

    def __init__(self, reference: Dict[Tuple[int, ...], List[int]], vocab: int, corrupt: float = 0.3):
        self.reference = reference
        self.vocab = vocab
        self.corrupt = corrupt
        self.calls = 0

    def _u(self, *key: int) -> float:
        h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2.0 ** 64

    def __call__(self, seq, proposed: List[int]) -> List[int]:
        self.calls += 1
        ref = self.reference[tuple(seq.prompt_token_ids)]
        n_out = len(seq.output_token_ids)
        out = []
        for j in range(len(proposed)):
            i = n_out + j
            t = ref[i] if i < len(ref) else 3
            if self._u(len(seq.prompt_token_ids), seq.prompt_token_ids[0], i, j) < self.corrupt:
                t = 3 + (t + 1) % (self.vocab - 3)
            out.append(t)
        return out
