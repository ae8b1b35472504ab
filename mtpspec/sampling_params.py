"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and defaults)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

logger = logging.getLogger(__name__)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# Most completions one request may ask for (``n`` / ``best_of``): vLLM's default VLLM_MAX_N_SEQUENCES.
MAX_N_SEQUENCES = 16384
#: a temperature in (0, this) is raised to it, with a warning (vLLM's ``_MAX_TEMP``)
_MIN_TEMPERATURE = 1e-2

#: Fields of vLLM's ``SamplingParams`` that mtpspec does not implement, with what to use instead:
#: passing one raises a ``TypeError`` that says so (not only "unexpected keyword argument"), unless
#: its value asks for nothing (:func:`_asks_nothing`: ``min_p=0``, as Qwen's recommended settings
#: spell it, ``guided_decoding=None``, ``spaces_between_special_tokens=True``, ...), which is accepted and dropped.
VLLM_ONLY_FIELDS = {
    "min_p": "top_k / top_p",
    "logits_processors": "logit_bias",
    "allowed_token_ids": "logit_bias",
    "bad_words": "logit_bias",
    "guided_decoding": None,
    "structured_outputs": None,
    "truncate_prompt_tokens": "a shorter prompt",
    "output_kind": None,
    "spaces_between_special_tokens": None,
    "extra_args": None,
}


def _asks_nothing(name: str, value: object) -> bool:
    """Whether a :data:`VLLM_ONLY_FIELDS` value is vLLM's "off": ``None``, an empty list (not an empty
    ``allowed_token_ids``: no token allowed, which vLLM refuses), ``min_p`` 0, ``spaces_between_special_tokens``
    true."""
    if value is None or (isinstance(value, (list, tuple, dict)) and not value and name != "allowed_token_ids"):
        return True
    if name == "min_p":
        return _is_real(value) and value == 0
    return name == "spaces_between_special_tokens" and value is True


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    Attributes:
        n: completions to return for the prompt (vLLM's parallel sampling), an int in
            ``[1, 16384]``. The engine runs ``n`` sequences that share the prompt, each with its
            own random stream: with a ``seed`` completion ``i`` is seeded ``seed + i`` (vLLM's
            rule, so completion 0 is what ``n = 1`` gives), without one each draws its own
            engine seed. Greedy decoding (``temperature == 0``) needs ``n == 1``, as in vLLM.
        best_of: completions to generate, of which the ``n`` with the highest
            ``cumulative_logprob`` are returned (OpenAI's / vLLM V0's ``best_of``); an int in
            ``[n, 16384]``, or ``None`` (= ``n``). ``best_of > 1`` needs sampling
            (``temperature > 0``).
        temperature: softmax temperature, a finite float >= 0. ``0`` means greedy (argmax of
            the raw logits; ``top_p``, ``top_k`` and ``seed`` are then ignored); below ``1e-5``
            (vLLM's ``_SAMPLING_EPS``) it is set to ``0``, greedy, as vLLM treats it.
        top_p: nucleus sampling, in ``(0, 1]``: keep the smallest set of most-likely tokens
            whose probability sums to at least ``top_p`` (always at least one). ``1`` = off.
        top_k: keep the ``top_k`` most-likely tokens (ties broken by sort order); ``0`` or
            ``-1`` = off, otherwise an int >= 1.
        seed: an int makes the request's random draws reproducible: token ``i`` of the
            sequence is decided by draws that depend only on ``(seed, i)``, whatever else is
            in the batch, after preemption and on every tensor-parallel rank, so the same
            request gives the same tokens wherever its logits are the same (a row's logits can
            differ in the last bits with the batch's row count, even in float32: a draw near a
            tie of two tokens may then differ; docs/serving.md). ``None``: the engine picks a
            random seed.
        max_tokens: most tokens to generate, an int >= 1, or ``None`` for "until the context
            (``max_model_len``) is full".
        stop: strings that end generation when they appear in the output text; the text is
            cut before the stop string (the token that completed it stays in ``token_ids``).
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in text unless
            ``include_stop_str_in_output``).
        include_stop_str_in_output: keep the matched stop string at the end of the text (vLLM's
            flag; the text is then cut after it), and the text of a stop token id or EOS (as vLLM's
            detokenizer; an EOS special token is still dropped by ``skip_special_tokens``). Default ``False``.
        ignore_eos: keep generating past the model's EOS token.
        skip_special_tokens: drop special tokens when detokenizing.
        detokenize: ``False`` (vLLM's): no text is made, saving the per-token decoding on the host:
            ``text`` is ``""`` and the logprob entries' ``decoded_token`` is ``None``; the token ids
            are the same. Stop strings need it ``True`` (a ``ValueError``, vLLM's message).
        presence_penalty: subtracted from the logit of every token that occurs in the output so
            far, in ``[-2, 2]`` (vLLM / OpenAI). ``0`` = off.
        frequency_penalty: subtracted once per occurrence in the output so far, in ``[-2, 2]``.
            ``0`` = off.
        repetition_penalty: for every token that occurs in the prompt or the output so far, a
            positive logit is divided by it and a negative one multiplied (vLLM's definition), a
            finite number > 0. ``1`` = off.
        min_tokens: the model's EOS ids and ``stop_token_ids`` cannot be generated (their logits
            are masked to ``-inf``) before ``min_tokens`` tokens were; stop strings are not
            checked before then either (vLLM). An int in ``[0, max_tokens]``.
        logit_bias: ``{token_id: bias}`` added to the raw logits before the penalties and the
            temperature (ids >= 0; the engine checks them against the vocabulary). Finite biases;
            the OpenAI server clamps them to ``[-100, 100]`` as vLLM does.
        logprobs: return the log-probability of every generated token plus the ``logprobs``
            most likely alternatives at its position (vLLM's semantics: the raw model
            distribution, ``log_softmax`` of the logits before penalties, temperature, top-k and
            top-p); ``0`` = just the generated token, ``None`` = none, ``-1`` = the whole
            vocabulary (subject to the engine's maximum, 20).
        prompt_logprobs: the same for every prompt token after the first, from the prefill's
            logits (first entry ``None``).

    Speculative decoding changes none of these: every parameter acts on the target's
    distribution of each verified row, with counts that include the drafts the row is
    conditioned on, so greedy outputs and seeded samples equal plain decoding's.

    Raises:
        ValueError / TypeError: on construction, for any value out of range, non-finite or of
        the wrong type; the message names the field, the value and what was expected. ``stop``
        with ``detokenize=False`` is a ValueError (vLLM's "stop strings are only supported when
        detokenize is True").
        TypeError: an unknown field, or a vLLM field mtpspec does not implement
        (:data:`VLLM_ONLY_FIELDS`) set to a value other than vLLM's "off" (``min_p=0``,
        ``guided_decoding=None``, ...: accepted and dropped).
    """

    n: int = 1
    best_of: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Optional[Dict[int, float]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    _stop_list: List[str] = field(default_factory=list, init=False, repr=False, compare=False)
    _stop_src: object = field(default=None, init=False, repr=False, compare=False)  # the stop _stop_list came from

    def __post_init__(self) -> None:
        self._check_num_sequences()
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        # as vLLM: a tiny temperature is raised to 0.01 (a float32 temperature tensor held 1e-46 as 0, which
        # sampled at temperature 1); only 0 is greedy
        self.temperature = float(self.temperature)
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which may cause numerical errors: set to %s",
                           self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (64 bits), got {self.seed}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        self._stop_list, self._stop_src = self._check_stop(self.stop), self.stop
        ids = self.stop_token_ids
        if ids is not None:
            if getattr(ids, "ndim", None) == 1 and hasattr(ids, "tolist"):  # a 1-D numpy array of ids
                ids = ids.tolist()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
            for t in ids:  # numpy integers too (ids taken from an array), kept as Python ints
                if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r} in {list(ids)!r}")
            self.stop_token_ids = [int(t) for t in ids]
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self._stop_list and not self.detokenize:  # vLLM's message
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:  # NaN fails the range test
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}.")
            setattr(self, name, float(v))
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp):
            raise ValueError(f"repetition_penalty must be a finite number, got {rp!r}.")
        if rp <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {rp!r}.")
        self.repetition_penalty = float(rp)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or (v < 0 and v != -1)):
                raise ValueError(f"{name} must be non-negative or -1, got {v!r}.")
        if self.temperature == 0.0:  # vLLM's _verify_greedy_sampling: greedy copies would be identical
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
            if self.best_of is not None and self.best_of > 1:
                raise ValueError(f"best_of must be 1 when using greedy sampling, got {self.best_of}.")

    def check(self) -> None:
        """Check every field again, as construction does (a field set after construction is checked
        when the request is submitted: ``LLMEngine.validate_request`` calls this).

        Raises:
            ValueError / TypeError: as construction, naming the field.
        """
        self.__post_init__()

    def _check_num_sequences(self) -> None:
        """``n`` and ``best_of`` (vLLM's messages)."""
        for name in ("n", "best_of"):
            v = getattr(self, name)
            if v is None and name == "best_of":
                continue
            if not _is_int(v):
                raise TypeError(f"{name} must be an int, but is of type {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}.")
            if v > MAX_N_SEQUENCES:
                raise ValueError(f"{name} must be at most {MAX_N_SEQUENCES}, got {v}.")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")

    @staticmethod
    def _check_logit_bias(bias: object) -> Optional[Dict[int, float]]:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out = {}
        for t, b in bias.items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not _is_real(b) or not math.isfinite(b):
                raise ValueError(f"logit_bias values must be finite numbers, got {b!r} for token {t}")
            out[int(t)] = float(b)
        return out or None

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
        """``stop`` as a (possibly empty) list (checked again when ``stop`` was set after construction).

        Raises:
            ValueError / TypeError: a ``stop`` set later that is not a string or a list of them."""
        if self.stop is not self._stop_src:
            self._stop_list, self._stop_src = self._check_stop(self.stop), self.stop
        return list(self._stop_list)

    @property
    def uses_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is set."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for the request: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0.0


def _checked_init(generated: Callable[..., None]) -> Callable[..., None]:
    """The dataclass ``__init__`` behind a check that names a keyword which is not a field
    (vLLM-only fields: :data:`VLLM_ONLY_FIELDS`, with what to use instead) and lists the fields,
    where the generated ``__init__`` would say only "unexpected keyword argument". A subclass
    whose own ``__init__`` takes more keywords, or a dataclass subclass, is not affected;
    ``inspect.signature`` still shows the fields (``functools.wraps``)."""
    fields = [f.name for f in dataclasses.fields(SamplingParams) if f.init]

    @functools.wraps(generated)
    def __init__(self: "SamplingParams", *args: Any, **kwargs: Any) -> None:
        for name in list(kwargs):
            if name in VLLM_ONLY_FIELDS and _asks_nothing(name, kwargs[name]):
                del kwargs[name]  # vLLM's default value: nothing to implement
            elif name not in fields:
                what = type(self).__name__
                if name in VLLM_ONLY_FIELDS:
                    use = VLLM_ONLY_FIELDS[name]
                    raise TypeError(f"{what}: {name!r} is a vLLM field mtpspec does not implement"
                                    + (f" (use {use})" if use else "") + f"; the fields are: {', '.join(fields)}")
                raise TypeError(f"{what} got an unknown field {name!r}; the fields are: {', '.join(fields)}")
        generated(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _checked_init(SamplingParams.__init__)  # type: ignore[method-assign]
