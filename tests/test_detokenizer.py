"""Incremental detokenization: the ``tokenizers`` ``DecodeStream`` path gives the text of the Python window.

``IncrementalDetokenizer`` runs the prefix / read-offset algorithm either in Python (two decodes a
token) or inside ``tokenizers`` (``DecodeStream``) when the tokenizer's decode is the Rust
tokenizer's own. The references here: the Python window on the same ids, and ``decode`` of the whole
output where the output is plain text.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpspec.engine.detokenizer import IncrementalDetokenizer, Tokenizer, _plain_decode_backend, load_tokenizer
from mtpspec import demo_model_path

DEMO = demo_model_path()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = load_tokenizer(DEMO)
    assert t is not None and t.stream_backend is t.backend  # a bare tokenizer.json: the stream path
    return t


def _texts(tokenizer: Tokenizer, prompt, ids, skip=True, stream=True):
    """Deltas of ``ids`` one at a time, through the stream path (where it applies: the prompt's last
    tokens decode to whole characters; asserted then) or (``stream=False``) the window."""
    d = IncrementalDetokenizer(tokenizer, prompt, skip)
    if not stream:
        d._stream = None
    elif not tokenizer.decode(prompt[-5:], skip).endswith("\ufffd"):
        assert d._stream is not None
    deltas = [d.add(i) for i in ids]
    assert "".join(deltas) == d.text
    return deltas


def test_stream_equals_window_and_whole_decode_on_text(tok):
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "<<48/2=24>>24\n#### 72 naïve café — 数字 123 🙂 'll   spaces\n\n\ttab<|endoftext|>after")
    ids = tok.encode(text)
    for prompt in ([], ids[:3], tok.encode("Question: how many?\nAnswer:")):
        for skip in (True, False):
            s, w = _texts(tok, prompt, ids, skip), _texts(tok, prompt, ids, skip, stream=False)
            assert s == w
        assert "".join(_texts(tok, [], ids, False)) == tok.decode(ids, skip_special_tokens=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10_040), max_size=6), st.lists(st.integers(0, 10_040), min_size=1, max_size=40),
       st.booleans())
def test_stream_equals_window_on_any_ids(prompt, ids, skip):
    """Random ids, byte pieces that split UTF-8 characters, the special token and ids past the
    vocabulary (10,007 tokens; a padded LM head can emit them): the same deltas either way (a
    prompt ending inside a character keeps the window: ``DecodeStream`` would emit its text too)."""
    t = load_tokenizer(DEMO)
    assert _texts(t, prompt, ids, skip) == _texts(t, prompt, ids, skip, stream=False)


def test_transformers_fast_tokenizer_streams_only_when_its_decode_is_the_rust_one(tmp_path):
    shutil.copy(f"{DEMO}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "clean_up_tokenization_spaces": False}))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None and not tok._is_fast_lib and tok.stream_backend is tok.backend._tokenizer
    rng = random.Random(0)
    for _ in range(20):
        prompt, ids = [rng.randrange(10_007) for _ in range(5)], [rng.randrange(10_007) for _ in range(30)]
        assert _texts(tok, prompt, ids) == _texts(tok, prompt, ids, stream=False)
    ids = tok.encode("The answer is 18 , isn't it ? Yes .")
    assert "".join(_texts(tok, [], ids)) == tok.decode(ids)

    backend = tok.backend

    class Custom(type(backend)):  # a decode of its own: transformers' path
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()
    backend.__class__ = Custom
    assert _plain_decode_backend(backend) is None and Tokenizer(backend).stream_backend is None
    assert "".join(_texts(Tokenizer(backend), [], ids, stream=False)) == tok.decode(ids).upper()

    backend.__class__ = Custom.__mro__[1]  # clean-up forced on a BPE model: transformers' path
    backend.clean_up_tokenization_spaces = True
    backend.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert _plain_decode_backend(backend) is None


def test_special_tokens_added_on_request_as_the_backend_adds_them(tmp_path):
    """``encode(text, add_special_tokens=True)``: the ids the tokenizer itself gives with its special
    tokens (a BOS added by the ``tokenizer.json`` post-processor, as DeepSeek-V3's is), through
    ``tokenizers`` and through transformers alike; default without."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer
    rust = HFTokenizer.from_file(f"{DEMO}/tokenizer.json")
    rust.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                        special_tokens=[("<|endoftext|>", 0)])
    rust.save(str(tmp_path / "tokenizer.json"))
    text = "Question: 3 + 4 ?"
    t = Tokenizer(rust)
    plain = t.encode(text)
    assert plain == rust.encode(text, add_special_tokens=False).ids and t.encode(text, True) == [0] + plain
    assert t.encode(text * 2000, True)[0] == 0  # the long-text path (encode_batch) too
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert not tok._is_fast_lib
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode(text) == plain and tok.encode(text, add_special_tokens=True) == hf.encode(text) == [0] + plain


def test_a_stream_that_raises_continues_in_the_window(tok):
    """``tokenizers`` raising mid-sequence (its "Invalid prefix encountered"): the rest decodes
    through the window, tokens still pending in the stream included; the whole text is unchanged."""
    ids = tok.encode("café 数字 🙂 and more text after it")
    want = "".join(_texts(tok, [], ids, stream=False))
    for cut in range(1, len(ids)):
        d = IncrementalDetokenizer(tok, [], True)
        got = [d.add(i) for i in ids[:cut]]

        class Broken:
            def step(self, *args):
                raise Exception("Invalid prefix encountered")
        d._stream = Broken()
        got += [d.add(i) for i in ids[cut:]]
        assert "".join(got) == want == d.text and d._stream is None


def test_long_texts_encode_to_the_same_ids_with_the_gil_released(tok, tmp_path):
    """Texts of ``LONG_TEXT_CHARS`` or more go through ``encode_batch`` (which releases the GIL):
    the same ids as ``encode``, for a bare tokenizer.json and a transformers fast tokenizer."""
    import threading
    import time

    from mtpspec.engine.detokenizer import LONG_TEXT_CHARS
    text = ("Natalia sold 48 clips in April. 数字 🙂 <|endoftext|> " * 400)[:LONG_TEXT_CHARS + 7]
    shutil.copy(f"{DEMO}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = load_tokenizer(str(tmp_path))
    assert hf._rust is not None
    for t, ref in ((tok, lambda x: tok.backend.encode(x, add_special_tokens=False).ids),
                   (hf, lambda x: list(hf.backend.encode(x, add_special_tokens=False)))):
        assert t.encode(text) == ref(text) and t.encode(text[:100]) == ref(text[:100])
    # the GIL is free while a long text encodes: another thread keeps running
    big, ticks, done = "word " * 300_000, [], threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(big), done.set()))
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    assert len(ticks) >= 5, "the main thread was starved while a long prompt was tokenized"


def test_a_tokenizer_subclass_with_its_own_decode_keeps_the_window(tok):
    class Shouting(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return super().decode(ids, skip_special_tokens).upper()
    loud = Shouting(tok.backend)
    ids = tok.encode("quiet words here")
    d = IncrementalDetokenizer(loud, [], True)
    assert d._stream is None and "".join(d.add(i) for i in ids) == "QUIET WORDS HERE"
