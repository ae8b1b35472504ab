"""Byte-level BPE tokenizer: size not a multiple of 8, EOT round-trips, digits split, any text round-trips."""

import os

import pytest
from hypothesis import given, settings, strategies as st

from mtpspec.training import tokenizer as tk
from mtpspec.data.gsm8k import EOT, bundled_gsm8k_dir, format_example, load_gsm8k, training_document
from mtpspec.training.word_problems import generate_problems


@pytest.fixture(scope="module")
def corpus():
    texts = [training_document([{"question": p.question, "answer": p.answer}]) for p in generate_problems(3000, 1)]
    texts += [training_document([r]) for r in load_gsm8k(os.path.join(bundled_gsm8k_dir(), "train.jsonl"))[:3000]]
    return texts


@pytest.fixture(scope="module")
def tok(corpus):
    return tk.train_tokenizer(corpus, vocab_size=8_007)


def test_vocab_size_not_multiple_of_8(tok):
    v = tok.get_vocab_size()
    assert v % 8 != 0 and 1000 < v <= 8_007


def test_eot_is_one_special_token_and_round_trips(tok, tmp_path):
    e = tk.eot_id(tok)
    doc = format_example("Is 2+2 = 4?", "2+2 = <<2+2=4>>4\n#### 4") + EOT
    ids = tok.encode(doc).ids
    assert ids[-1] == e and ids.count(e) == 1
    assert tok.decode(ids, skip_special_tokens=False) == doc
    assert tok.decode(ids, skip_special_tokens=True) == doc[: -len(EOT)]
    # EOT is never produced by plain text that merely resembles it in pieces
    assert e not in tok.encode("<|endof text|> endoftext").ids
    tk.save_tokenizer(tok, tmp_path)
    again = tk.load_tokenizer(tmp_path)
    assert again.encode(doc).ids == ids and tk.eot_id(again) == e
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf.encode(doc) == ids and len(hf) == tok.get_vocab_size()


def test_digits_are_single_tokens(tok):
    enc = tok.encode("He paid 12345 dollars and 0.75 cents")
    digits = [t.replace("\u0120", "") for t in enc.tokens if any(c.isdigit() for c in t)]
    assert digits == list("12345") + list("075")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_any_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_size_forced_off_multiple_of_8():
    # Find a small corpus whose natural (uncapped) vocabulary is a multiple of 8, then check that
    # train_tokenizer learns one merge fewer.
    words = [f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}q" for i in range(200)]
    for n in range(20, 200):
        texts = [" ".join(words[:n])] * 3
        natural = tk._train_once(texts, 32_001).get_vocab_size()
        if natural % 8 == 0:
            break
    else:
        pytest.fail("no corpus with a natural vocabulary that is a multiple of 8")
    got = tk.train_tokenizer(texts, vocab_size=31_999)
    assert got.get_vocab_size() == natural - 1


def test_bad_vocab_sizes():
    for v in (7_999, 8_008, 32_008, 40_001):
        with pytest.raises(ValueError, match="vocab_size"):
            tk.train_tokenizer(["abc"], vocab_size=v)
