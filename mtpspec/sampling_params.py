"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    Attributes:
        temperature: softmax temperature, a finite float >= 0. ``0`` means greedy (argmax of
            the raw logits; ``top_p``, ``top_k`` and ``seed`` are then ignored).
        top_p: nucleus sampling, in ``(0, 1]``: keep the smallest set of most-likely tokens
            whose probability sums to at least ``top_p`` (always at least one). ``1`` = off.
        top_k: keep the ``top_k`` most-likely tokens (ties broken by sort order); ``0`` or
            ``-1`` = off, otherwise an int >= 1.
        seed: an int makes the request's random draws reproducible: token ``i`` of the
            sequence is decided by draws that depend only on ``(seed, i)``, so the same
            request gives the same tokens whatever else is in the batch, after preemption,
            and on every tensor-parallel rank. ``None``: the engine picks a random seed.
        max_tokens: most tokens to generate, an int >= 1, or ``None`` for "until the context
            (``max_model_len``) is full".
        stop: strings that end generation when they appear in the output text; the text is
            cut before the stop string (the token that completed it stays in ``token_ids``).
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in text).
        ignore_eos: keep generating past the model's EOS token.
        skip_special_tokens: drop special tokens when detokenizing.

    Raises:
        ValueError / TypeError: on construction, for any value out of range, non-finite or of
        the wrong type; the message names the field, the value and what was expected.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    _stop_list: List[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        self._stop_list = self._check_stop(self.stop)
        ids = self.stop_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r} in {list(ids)!r}")
            self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @staticmethod
    def _check_stop(stop: object) -> List[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, Sequence):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        out = []
        for s in items:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            out.append(s)
        return out

    @property
    def stop_strings(self) -> List[str]:
        """``stop`` as a (possibly empty) list."""
        return list(self._stop_list)

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0.0
