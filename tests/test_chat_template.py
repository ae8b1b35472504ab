"""Chat rendering: a tokenizer's own jinja chat template with vLLM's ``chat_template_kwargs``
(transformers renders it: the independent reference), and the plain template."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mtpspec import demo_model_path
from mtpspec.entrypoints.chat_template import RESERVED_TEMPLATE_KWARGS, render_chat, render_plain

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<no-think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def templated():
    import os

    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(demo_model_path(), "tokenizer.json"))
    hf.chat_template = TEMPLATE
    return SimpleNamespace(backend=hf)


def test_template_kwargs_reach_the_tokenizers_template(templated):
    msgs = [("system", "Be brief."), ("user", "2 + 3?")]
    conv = [{"role": r, "content": t} for r, t in msgs]
    plain, stops = render_chat(templated, msgs)
    assert plain == templated.backend.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert plain == "<system>Be brief.<user>2 + 3?<assistant>" and stops == []
    off, _ = render_chat(templated, msgs, True, {"enable_thinking": False})
    assert off == plain + "<no-think>"
    assert render_chat(templated, msgs, True, {"enable_thinking": True})[0] == plain
    assert render_chat(templated, msgs, False, {"enable_thinking": False})[0] == "<system>Be brief.<user>2 + 3?"


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "conversation"])
def test_template_kwargs_may_not_set_what_the_renderer_sets(templated, key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set {key} "):
        render_chat(templated, [("user", "x")], True, {key: True})
    assert key in RESERVED_TEMPLATE_KWARGS


def test_the_plain_template_ignores_template_kwargs():
    msgs = [("user", "What is 2 + 3?")]
    assert render_chat(None, msgs, True, {"enable_thinking": False}) == (render_plain(msgs), ["Question:"])
