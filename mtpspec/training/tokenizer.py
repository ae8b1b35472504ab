"""Byte-level BPE tokenizer trained with Hugging Face ``tokenizers``.

Byte-level BPE (Radford et al. 2019, GPT-2 paper section 2.2; Sennrich et al. 2016 for BPE):
text is mapped to bytes, so any string round-trips. Digits are split one per token before BPE
(as in PaLM and LLaMA), which makes the arithmetic of word problems learnable by a tiny model.
The end-of-text token :data:`EOT` is a special token that is never merged or split.

The vocabulary size (including the special token) is made *not* a multiple of 8, so that the
engine's padded vocab shards (``ceil(V / (64 * tp)) * 64`` rows per rank) always have padding.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mtpspec.data.gsm8k import EOT

DEFAULT_VOCAB_SIZE = 10_007
# GPT-2's pre-tokenization regex with numbers split into single digits (" 48" -> " 4", "8").
SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _train_once(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE tokenizer on ``texts``.

    Args:
        texts: training strings (documents without the EOT marker are fine; :data:`EOT` inside a
            text is treated as the special token).
        vocab_size: requested size including :data:`EOT`; 8,000 to 32,000 and not a multiple of 8.

    Returns:
        A ``tokenizers.Tokenizer`` whose ``get_vocab_size()`` is not a multiple of 8 and at most
        ``vocab_size`` (smaller only if the texts support fewer merges; if that smaller size is a
        multiple of 8 one merge fewer is learned).

    Raises:
        ValueError: ``vocab_size`` out of range or a multiple of 8.
    """
    if not 8_000 <= vocab_size <= 32_000 or vocab_size % 8 == 0:
        raise ValueError(f"vocab_size must be in [8000, 32000] and not a multiple of 8, got {vocab_size}")
    texts = list(texts)
    tok = _train_once(texts, vocab_size)
    if tok.get_vocab_size() % 8 == 0:
        tok = _train_once(texts, tok.get_vocab_size() - 1)
    if tok.get_vocab_size() % 8 == 0:
        raise RuntimeError(f"BPE training gave a vocabulary of {tok.get_vocab_size()} (a multiple of 8) twice")
    return tok


def eot_id(tok: Tokenizer) -> int:
    """The id of :data:`EOT`. Raises ``ValueError`` if the tokenizer lacks it."""
    i = tok.token_to_id(EOT)
    if i is None:
        raise ValueError(f"tokenizer has no {EOT!r} token")
    return i


def save_tokenizer(tok: Tokenizer, directory: str | os.PathLike) -> str:
    """Write ``directory/tokenizer.json``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` (a file or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(str(path))


def batched(texts: Iterable[str], size: int) -> Iterator[list]:
    """Chunks of ``size`` texts (for ``Tokenizer.encode_batch``)."""
    buf: list = []
    for t in texts:
        buf.append(t)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf
