"""Tokenizer loading and incremental detokenization (text grows token by token)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

#: Text prompts of at least this many characters are tokenized with the GIL released (and, in the
#: OpenAI server, in a worker thread): a ~16 K-character prompt takes ~10 ms on a CPU core.
LONG_TEXT_CHARS = 16384

# Tokens of the prompt kept as left context, so the first output token decodes with the right
# leading space / byte merges.
_CONTEXT_TOKENS = 5


class Tokenizer:
    """A uniform face over a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.

    Attributes:
        eos_token_id: the EOS id, or ``None``.
        chat_template: a Jinja chat template that replaces the backend's own (``serve
            --chat-template``; :func:`mtpspec.entrypoints.chat_template.load_chat_template`), or
            ``None``.
    """

    def __init__(self, backend: Any, eos_token_id: Optional[int] = None):
        self.backend = backend
        self.chat_template: Optional[str] = None
        self._is_fast_lib = backend.__class__.__module__.startswith("tokenizers")
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(backend, "eos_token_id", None)
        # A transformers fast tokenizer's own ``tokenizers.Tokenizer``, when calling it gives the
        # same ids as transformers' ``encode`` (skips ~0.1 ms of Python per call), else None.
        self._rust = None if self._is_fast_lib else _rust_backend(backend)
        #: The ``tokenizers.Tokenizer`` whose decoder gives :meth:`decode`'s text (the backend itself,
        #: or a transformers fast tokenizer's own when its decode adds nothing to it), which
        #: :class:`IncrementalDetokenizer` then drives through ``tokenizers``' ``DecodeStream``; else None.
        self.stream_backend = backend if self._is_fast_lib else _plain_decode_backend(backend)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of ``text``; ``add_special_tokens``: also the special tokens the tokenizer's
        post-processor adds (e.g. a BOS id: vLLM's default for text prompts of ``LLM.generate`` and
        ``/v1/completions``; chat templates write theirs into the text). Texts of
        :data:`LONG_TEXT_CHARS` or more characters go through ``tokenizers``' ``encode_batch`` (the
        same ids), which releases the GIL while it works: the OpenAI server tokenizes them in a
        worker thread, so a huge prompt does not stall the event loop and the engine thread
        (``encode`` holds the GIL throughout)."""
        if add_special_tokens and not self._is_fast_lib:  # transformers adds them its own way (e.g. add_bos_token)
            return list(self.backend.encode(text, add_special_tokens=True))
        rust = self.backend if self._is_fast_lib else self._rust
        if rust is not None and not self._is_fast_lib and not (
                rust.truncation is None and rust.padding is None
                and rust.encode_special_tokens == self.backend.split_special_tokens):
            rust = None  # settings transformers' encode would apply: its own path
        if rust is None:
            return list(self.backend.encode(text, add_special_tokens=False))
        if len(text) >= LONG_TEXT_CHARS:
            return rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return rust.encode(text, add_special_tokens=add_special_tokens).ids  # (transformers' encode: the same)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        """The vocabulary's size with the added tokens (transformers' ``len(tokenizer)``)."""
        b = self.backend
        return b.get_vocab_size(with_added_tokens=True) if self._is_fast_lib else len(b)

    def apply_chat_template(self, conversation: Sequence[Dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, chat_template: Optional[str] = None,
                            tools: Optional[List[Dict[str, Any]]] = None,
                            documents: Optional[List[Dict[str, Any]]] = None,
                            continue_final_message: bool = False, **kwargs: Any) -> Union[str, List[int]]:
        """transformers' method (vLLM users' ``llm.get_tokenizer().apply_chat_template(...)``, then
        ``llm.generate``), with its defaults: one conversation rendered as ``LLM.chat`` renders it
        (this tokenizer's chat template, else the plain ``Question:`` / ``Answer:`` template: pass
        its stop string ``"Question:"`` to ``generate`` yourself, or use ``LLM.chat``), ``kwargs``
        as more template variables; the text, or with ``tokenize`` its ids (a list, as with
        ``return_dict=False``; no special tokens added: the template writes its own).

        Raises:
            ValueError: a message that is not a dict with a ``role`` string, non-text content,
                ``return_dict=True``, or as :func:`mtpspec.entrypoints.chat_template.render_chat`.
        """
        from mtpspec.entrypoints.chat_template import render_chat, text_messages
        if kwargs.pop("return_dict", False):
            raise ValueError("apply_chat_template: return_dict=True is not supported (ids come as a list)")
        if isinstance(conversation, (str, bytes, dict)):
            raise ValueError("conversation must be a list of {'role', 'content'} message dicts")
        try:
            msgs = text_messages(conversation)
        except TypeError as exc:
            raise ValueError(f"conversation must be a list of {{'role', 'content'}} message dicts: {exc}") from None
        text, _ = render_chat(self, msgs, add_generation_prompt, kwargs, chat_template, continue_final_message,
                              tools, documents)
        return self.encode(text) if tokenize else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> List[str]:
        """Each id's token string in the vocabulary (``"Ġworld"``, not decoded text), as transformers'
        ``convert_ids_to_tokens``."""
        b = self.backend
        if hasattr(b, "convert_ids_to_tokens"):
            return list(b.convert_ids_to_tokens(list(ids)))
        return [b.id_to_token(t) for t in ids]


# Strings a transformers tokenizer and its ``tokenizers.Tokenizer`` must encode alike before the
# latter is called directly (spaces, newlines, digits, punctuation, non-ASCII).
_PROBES = ("", " ", "Question: Ann has 4 cats.\nAnswer: 4 + 3 = <<4+3=7>>7\n#### 7", "  leading\n\n\ttabs  ",
           "naïve café — 数字 123456789 🙂", "'s 've 're n't ... !!")


def _inner_rust(backend: Any) -> tuple:
    """``(rust, PreTrainedTokenizerBase, TokenizersBackend)``: the ``tokenizers.Tokenizer`` inside a
    transformers (v5) ``TokenizersBackend`` and the two transformers classes whose methods the callers
    compare against; ``(None, None, None)`` for any other backend or when either library is missing."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None, None, None
    rust = getattr(backend, "_tokenizer", None)
    if not isinstance(backend, TokenizersBackend) or not isinstance(rust, RustTokenizer):
        return None, None, None
    return rust, PreTrainedTokenizerBase, TokenizersBackend


def _rust_backend(backend: Any) -> Any:
    """The ``tokenizers.Tokenizer`` inside a transformers (v5) ``TokenizersBackend`` whose
    ``encode(text, add_special_tokens=False)`` is the library's own (no subclass overrides a step
    of it), checked on a few probe strings (and on its special tokens); ``None`` otherwise.

    transformers' ``encode`` then only clears the backend's truncation and padding (done here by
    a first call), sets ``encode_special_tokens`` from ``split_special_tokens`` and returns
    ``encode_batch([text])[0].ids``; :meth:`Tokenizer.encode` checks those settings per call.
    """
    rust, PreTrainedTokenizerBase, TokenizersBackend = _inner_rust(backend)
    if rust is None:
        return None
    cls = type(backend)
    same = [getattr(cls, m, None) is getattr(base, m) for m, base in (
        ("encode", PreTrainedTokenizerBase), ("_get_padding_truncation_strategies", PreTrainedTokenizerBase),
        ("_encode_plus", TokenizersBackend), ("set_truncation_and_padding", TokenizersBackend),
        ("_convert_encoding", TokenizersBackend))]
    if not all(same):
        return None
    try:
        probes = list(_PROBES) + [" ".join(str(t) for t in getattr(backend, "all_special_tokens", []))]
        for text in probes:
            want = list(backend.encode(text, add_special_tokens=False))
            if rust.truncation is not None or rust.padding is not None or \
                    rust.encode_special_tokens != backend.split_special_tokens or \
                    rust.encode(text, add_special_tokens=False).ids != want:
                return None
    except Exception:  # any surprise: keep transformers' own path
        return None
    return rust


def _plain_decode_backend(backend: Any) -> Any:
    """The ``tokenizers.Tokenizer`` inside a transformers (v5) ``TokenizersBackend`` whose ``decode``
    is the library's own and returns that tokenizer's text unchanged (no clean-up of spaces, or the
    clean-up transformers skips for BPE models); ``None`` otherwise (then the Python window below
    decodes through transformers)."""
    rust, PreTrainedTokenizerBase, TokenizersBackend = _inner_rust(backend)
    if rust is None:
        return None
    cls = type(backend)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode:
        return None
    try:
        clean = bool(backend.clean_up_tokenization_spaces)
        if clean and (type(rust.model).__name__ != "BPE" or getattr(
                backend, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
            return None
    except Exception:  # any surprise: keep transformers' own path
        return None
    return rust


def load_tokenizer(path: str) -> Optional[Tokenizer]:
    """The tokenizer in directory ``path`` or ``None`` when it holds none.

    Tries ``transformers.AutoTokenizer`` (when ``tokenizer_config.json`` exists), then a bare
    ``tokenizer.json`` through ``tokenizers``. The EOS id falls back to the first ``eos_token_id``
    of ``config.json`` (``generation_config.json``'s ids are the engine's to read, under
    ``--generation-config``: :mod:`mtpspec.engine.generation_config`).

    Raises:
        ValueError: ``tokenizer.json`` exists but cannot be parsed (the message names the file).
    """
    if not os.path.isdir(path):
        return None
    eos = None
    f = os.path.join(path, "config.json")
    if os.path.exists(f):
        with open(f) as fh:
            v = json.load(fh).get("eos_token_id")
        eos = v[0] if isinstance(v, list) and v else v
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        return Tokenizer(tok, tok.eos_token_id if tok.eos_token_id is not None else eos)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer as HFTokenizer
        f = os.path.join(path, "tokenizer.json")
        try:
            backend = HFTokenizer.from_file(f)
        except Exception as exc:  # tokenizers raises a bare Exception for a corrupt file
            raise ValueError(f"{f}: cannot load the tokenizer ({exc}); the file is corrupt or not a "
                             "tokenizers JSON") from None
        return Tokenizer(backend, eos)
    return None


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Each call decodes a short window ``ids[prefix:]`` and ``ids[prefix:read]`` and emits the
    difference; a delta ending in U+FFFD (an incomplete UTF-8 sequence) waits for more tokens
    (the prefix / read offsets of Hugging Face text-generation-inference's and vLLM's
    incremental detokenizers). Where the tokenizer has a :attr:`Tokenizer.stream_backend` and the
    prompt's last tokens decode to whole characters, the same algorithm runs inside ``tokenizers``
    (``tokenizers.decoders.DecodeStream`` seeded with those tokens): one call a token instead of two
    decodes through Python (~0.6 us a token instead of ~2 us on the CPU, the demo tokenizer), the same
    text (tests/test_detokenizer.py). A prompt context that ends inside a character (``DecodeStream``
    then also emits the context's text) keeps the window, and so does the rest of a sequence whose
    stream raised (e.g. ``tokenizers``' "Invalid prefix encountered").
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._stream, self._rust = None, getattr(tokenizer, "stream_backend", None)
        if getattr(type(tokenizer), "decode", None) is not Tokenizer.decode:
            self._rust = None  # a subclass with a decode of its own: the window decodes through it
        if self._rust is not None and not tokenizer.decode(self.ids, skip_special_tokens).endswith("\ufffd"):
            try:
                from tokenizers.decoders import DecodeStream
                self._stream = DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)
            except (ImportError, TypeError):  # tokenizers < 0.22 (no DecodeStream or no prompt ids): the window
                self._stream = None

    def add(self, token_id: int) -> str:
        """Append one output token; returns the new text (possibly ``""``) and grows ``text``."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._rust, token_id)
            except Exception:  # the window from the last emitted token on (its pending tokens included)
                self._stream = None
                self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
            else:
                if not delta:
                    return ""
                self.read_offset = len(self.ids)  # every token so far is in the text
                self.text += delta
                return delta
        dec = lambda a, b=None: self.tokenizer.decode(self.ids[a:b], self.skip_special_tokens)  # noqa: E731
        prefix_text = dec(self.prefix_offset, self.read_offset)
        new_text = dec(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
