"""Chat rendering: a tokenizer's own jinja chat template with vLLM's ``chat_template_kwargs``
(transformers renders it: the independent reference), and the plain template."""

from __future__ import annotations

import functools
import json
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


# --chat-template (vLLM's serve flag) and LLM.chat(chat_template=...): a template that uses the EOS
# token, rendered by transformers' own tokenizer class as the reference
OVERRIDE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def _reference(messages, add_generation_prompt=True, template=OVERRIDE):
    import os

    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(demo_model_path(), "tokenizer.json"),
                                 eos_token="<|endoftext|>")
    conv = [{"role": r, "content": t} for r, t in messages]
    return hf.apply_chat_template(conv, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)


def test_load_chat_template_reads_a_file_or_the_template_itself(tmp_path):
    from mtpspec.entrypoints.chat_template import load_chat_template
    f = tmp_path / "t.jinja"
    f.write_text(OVERRIDE, encoding="utf-8")
    assert load_chat_template(str(f)) == OVERRIDE  # a file: its text, escapes untouched
    one_line = OVERRIDE.replace("\n", "\\n")  # the single-line form vLLM takes: "\n" escapes decoded
    assert "\n" not in one_line and load_chat_template(one_line) == OVERRIDE
    assert load_chat_template("{{ 'é中' }}") == "{{ 'é中' }}"  # non-ASCII kept
    with pytest.raises(ValueError, match="'no/such.jinja': no such file, and not a Jinja template"):
        load_chat_template("no/such.jinja")
    with pytest.raises(ValueError, match=r"not a valid Jinja template \(line 1: "):
        load_chat_template("{% for m in messages %}{{ m }}")  # no endfor
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))
    with pytest.raises(ValueError, match="must not be empty"):
        load_chat_template("")
    with pytest.raises(ValueError, match="is a directory"):
        load_chat_template(str(tmp_path))
    # compiled as transformers' renderer compiles it: its extensions (loop controls, the generation tag) pass
    for ok in ("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}",
               "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
               "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
               "{{ raise_exception('refuses every conversation') }}"):  # a refusal is not a syntax error
        assert load_chat_template(ok) == ok


def test_a_chat_template_override_on_a_bare_tokenizer_json_renders_as_transformers():
    """The bundled demo has only ``tokenizer.json`` (no template of its own): ``--chat-template``
    must still render as transformers' ``apply_chat_template`` does, ``eos_token`` included."""
    from mtpspec.engine.detokenizer import load_tokenizer
    tok = load_tokenizer(demo_model_path())
    msgs = [("system", "Be brief."), ("user", "2 + 3?"), ("assistant", "5"), ("user", "and 4 + 4?")]
    assert render_chat(tok, msgs) == (render_plain(msgs), ["Question:"])  # no override: the plain template
    for gen in (True, False):
        want = _reference(msgs, gen)
        assert "<|endoftext|>" in want
        assert render_chat(tok, msgs, gen, chat_template=OVERRIDE) == (want, [])  # LLM.chat's argument
        tok.chat_template = OVERRIDE  # serve --chat-template
        assert render_chat(tok, msgs, gen) == (want, [])
        tok.chat_template = None


def test_a_template_that_fails_is_the_conversations_error_not_the_engines(tmp_path):
    """A new-user pass (2026-12-06): a template raising an ordinary Python error (here a division by
    zero) was a 500 in the server and a bare ZeroDivisionError from ``LLM.chat``; a template that
    does not parse was called a refusal."""
    from mtpspec.engine.detokenizer import load_tokenizer
    from mtpspec.entrypoints.chat_template import load_chat_template
    tok = load_tokenizer(demo_model_path())
    with pytest.raises(ValueError, match="the chat template failed on this conversation: ZeroDivisionError"):
        render_chat(tok, [("user", "x")], chat_template="{{ 1 / 0 }}")
    with pytest.raises(ValueError, match=r"the chat template is not valid Jinja \(line 1: "):
        render_chat(tok, [("user", "x")], chat_template="{{ x }")
    f = tmp_path / "t.jinja"
    f.write_text(OVERRIDE)
    # LLM.chat's chat_template: a file or the template as given (no escapes decoded); a path that is
    # not a file is an error, not a one-line template (a review, 2026-12-06)
    load = functools.partial(load_chat_template, name="chat_template", decode_escapes=False)
    assert load(str(f)) == OVERRIDE and load(OVERRIDE) == OVERRIDE and load("{{ '\\n' }}") == "{{ '\\n' }}"
    for bad, why in (("templates/chatml.jinja", "chat_template 'templates/chatml.jinja': no such file"),
                     (str(tmp_path), "is a directory"), ("", "chat_template must not be empty")):
        with pytest.raises(ValueError, match=why):
            load(bad)


DIVIDES = "{% for m in messages %}{% if m['content'] == 'div' %}{{ 1 / 0 }}{% endif %}{% endfor %}" + OVERRIDE


def test_serve_chat_template_flag_reaches_chat_completions_and_tokenize():
    from fastapi.testclient import TestClient

    from mtpspec.engine.detokenizer import load_tokenizer
    from mtpspec.entrypoints.serve import build, parse_serve_flags
    base = ["--device", "cpu", "-k", "1", "--max-model-len", "256", "--max-num-seqs", "2"]
    for bad, why in (("no/such.jinja", "no such file"), ("{% if x %}", "not a valid Jinja template"),
                     ("", "must not be empty")):
        with pytest.raises(ValueError, match=why):  # refused before the model loads
            build(parse_serve_flags(base + ["--chat-template", bad]))
    app, engine, _ = build(parse_serve_flags(base + ["--chat-template", DIVIDES.replace("\n", "\\n")]))
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    want = load_tokenizer(demo_model_path()).encode(_reference([("user", "What is 2 + 3?")], template=DIVIDES))
    try:
        with TestClient(app) as client:
            r = client.post("/tokenize", json={"messages": msgs})
            assert r.status_code == 200 and r.json()["tokens"] == want, r.text
            r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
            # the template fails on one conversation: a 400 naming it, and the server goes on
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "div"}],
                                                          "max_tokens": 3})
            assert r.status_code == 400 and "ZeroDivisionError" in r.json()["error"]["message"], r.text
            r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


def test_llm_chat_takes_a_chat_template():
    from mtpspec import LLM, SamplingParams
    llm = LLM(demo_model_path(), device="cpu", max_model_len=256, max_num_seqs=2)
    try:
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        sp = SamplingParams(max_tokens=3, temperature=0)
        out = llm.chat(msgs, sp, use_tqdm=False, chat_template=OVERRIDE)[0]
        assert out.prompt == _reference([("user", "What is 2 + 3?")])
        assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
        assert llm.get_tokenizer().chat_template is None  # a call's template is that call's
        assert llm.chat(msgs, sp, use_tqdm=False)[0].prompt.endswith("Answer:")  # the plain template again
        with pytest.raises(ValueError, match="chat_template 'no/such.jinja': no such file"):
            llm.chat(msgs, sp, use_tqdm=False, chat_template="no/such.jinja")
    finally:
        llm.shutdown()


def test_a_chat_template_override_on_a_transformers_tokenizer_replaces_its_own(templated):
    """``--chat-template`` over a tokenizer that has a template of its own (tokenizer_config.json):
    rendered by its ``apply_chat_template`` with the override, not with its own template."""
    msgs = [("user", "2 + 3?")]
    conv = [{"role": "user", "content": "2 + 3?"}]
    own = render_chat(templated, msgs)[0]
    templated.chat_template = OVERRIDE
    try:
        got = render_chat(templated, msgs)
    finally:
        templated.chat_template = None
    want = templated.backend.apply_chat_template(conv, chat_template=OVERRIDE, tokenize=False,
                                                 add_generation_prompt=True)
    assert got == (want, []) and want != own and want.startswith("[user] 2 + 3?")


# vLLM passes every message field to the template (name, tool_calls, tool_call_id, ...) and takes
# continue_final_message (the last assistant message left open); transformers' renderer is the reference
FIELDS = ("{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>{{ m.content }}"
          "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}"
          "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}</{{ m.role }}>{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_message_fields_and_continue_final_message_render_as_transformers():
    from mtpspec.engine.detokenizer import load_tokenizer
    tok = load_tokenizer(demo_model_path())
    conv = [{"role": "user", "name": "ann", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sun"}]
    for gen, cont in ((True, False), (False, False), (False, True)):
        want = _reference_dicts(conv, gen, FIELDS, cont)
        got, stops = render_chat(tok, conv, gen, chat_template=FIELDS, continue_final_message=cont)
        assert got == want and stops == []
    assert "<user ann>weather?" in want and "[call get_weather]" in want and "[for c1]" in want
    assert want.endswith("It is sun")  # left open: no closing tag
    # the plain template: the last answer continues from its last character
    plain = [("user", "2 + 3?"), ("assistant", "2 + 3")]
    assert render_plain(plain, False, True) == "Question: 2 + 3?\nAnswer: 2 + 3"
    assert render_chat(None, plain, False, continue_final_message=True) == ("Question: 2 + 3?\nAnswer: 2 + 3",
                                                                            ["Question:"])
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        render_chat(None, plain, True, continue_final_message=True)
    # any role may be continued, as in vLLM / transformers: the last message is left open
    assert render_plain(plain[:1], False, True) == "Question: 2 + 3?"
    assert render_plain([("system", "Be brief."), ("tool", "42")], False, True) == "Be brief.\n\n42"
    assert render_chat(tok, plain[:1], False, chat_template=FIELDS, continue_final_message=True)[0] == \
        _reference_dicts([{"role": "user", "content": "2 + 3?"}], False, FIELDS, True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set continue_final_message"):
        render_chat(None, plain, False, {"continue_final_message": True})


def _reference_dicts(conv, add_generation_prompt, template, continue_final_message):
    import os

    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(demo_model_path(), "tokenizer.json"))
    return hf.apply_chat_template(conv, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message)


# vLLM's _postprocess_messages (facts only): an assistant's tool_calls arguments reach the template as
# an object, parsed from the JSON string OpenAI clients send; empty / malformed / non-object -> {}
TOOLS = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
         "[{{ c.function.name }} {{ c.function.arguments | tojson }}"
         "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}]{% endfor %}|{% endfor %}")


def _call(args, name="f"):
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": args}}


def test_tool_call_arguments_reach_the_template_as_objects(caplog):
    from mtpspec.engine.detokenizer import load_tokenizer
    tok = load_tokenizer(demo_model_path())
    calls = [_call('{"city": "Paris", "n": 2}'), _call({"x": 1}), _call(""), _call(None), _call("{bad json"),
             _call("[1, 2]")]
    conv = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    sent = json.dumps(conv)
    got, _ = render_chat(tok, [dict(m, content=m["content"] or "") for m in conv], False, chat_template=TOOLS)
    assert json.dumps(conv) == sent  # the caller's messages are not changed
    want = ('user:weather?|assistant:[f {"city": "Paris", "n": 2} city=Paris n=2][f {"x": 1} x=1][f {}][f {}]'
            '[f {}][f {}]|')
    assert got == want
    assert "not valid JSON" in caplog.text and "not a JSON object" in caplog.text
    # vLLM's fields only: an empty or null tool_calls list is dropped (the template's plain assistant
    # path), a user's tool_calls, a non-string name and unknown fields are left out; reasoning under both names
    # (transformers' renderer adds its own "thinking" beside reasoning: not ours, not checked)
    seen = "{% for m in messages %}{{ m | dictsort | map('first') | reject('equalto', 'thinking') | join(',') }};{% endfor %}"
    got = render_chat(tok, [{"role": "assistant", "content": "", "tool_calls": []},
                            {"role": "assistant", "content": "", "tool_calls": None, "reasoning_content": "r"},
                            {"role": "user", "content": "", "tool_calls": "x", "name": 42, "extra": 1},
                            {"role": "tool", "content": "", "tool_call_id": "c", "name": "f"},
                            {"role": "developer", "content": ""}], False, chat_template=seen)[0]
    assert got == ("content,role;content,reasoning,reasoning_content,role;content,role;content,name,role,"
                   "tool_call_id;content,role,tools;")
    for bad, match in (([1], r"tool_calls entries must be objects \(tool_calls\[0\] is int\)"),
                       ([{"type": "code", "function": {}}], "only support assistant tool_calls of type 'function'"),
                       ([{"function": "f"}], "only support assistant tool_calls of type 'function'")):
        with pytest.raises(ValueError, match=match):
            render_chat(tok, [{"role": "assistant", "content": "", "tool_calls": bad}], False, chat_template=TOOLS)


TOOLS_TEMPLATE = ("{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def test_tools_reach_the_template_offline_and_with_tool_choice_none_on_the_server():
    """vLLM's ``tools`` (``LLM.chat(tools=...)``; the server's with ``tool_choice: "none"``, which vLLM still
    renders) reach the template's ``tools``, as transformers' ``apply_chat_template(tools=...)`` renders them."""
    import os

    from fastapi.testclient import TestClient
    from transformers import PreTrainedTokenizerFast

    from mtpspec.engine.detokenizer import load_tokenizer
    from mtpspec.entrypoints.serve import build, parse_serve_flags
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(demo_model_path(), "tokenizer.json"))
    conv = [{"role": "user", "content": "Weather in Paris?"}]
    want = hf.apply_chat_template(conv, tools=[WEATHER], chat_template=TOOLS_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    assert want.startswith("[tools: get_weather]")
    tok = load_tokenizer(demo_model_path())
    assert render_chat(tok, conv, chat_template=TOOLS_TEMPLATE, tools=[WEATHER]) == (want, [])
    assert render_chat(None, conv, tools=[WEATHER]) == render_chat(None, conv)  # the plain template has none
    for bad in ({"type": "function"}, ["get_weather"]):
        with pytest.raises(ValueError, match="tools must be a list of tool objects"):
            render_chat(tok, conv, chat_template=TOOLS_TEMPLATE, tools=bad)
    base = ["--device", "cpu", "-k", "1", "--max-model-len", "256", "--max-num-seqs", "2"]
    app, engine, _ = build(parse_serve_flags(base + ["--chat-template", TOOLS_TEMPLATE]))
    try:
        with TestClient(app) as client:
            body = {"messages": conv, "tools": [WEATHER], "max_tokens": 2, "temperature": 0}
            r = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(want)), r.text
            r = client.post("/v1/chat/completions", json=body)  # "auto": tool calling is not served
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            r = client.post("/tokenize", json={"messages": conv, "tools": [WEATHER]})
            assert r.status_code == 200 and r.json()["tokens"] == tok.encode(want), r.text
    finally:
        engine.shutdown()
    from mtpspec import LLM, SamplingParams
    with LLM(demo_model_path(), device="cpu", max_model_len=256, max_num_seqs=2) as llm:
        out = llm.chat(conv, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False, tools=[WEATHER],
                       chat_template=TOOLS_TEMPLATE)[0]
        assert out.prompt == want


def test_get_tokenizer_apply_chat_template_and_len_as_transformers(templated):
    """vLLM's idiom ``llm.get_tokenizer().apply_chat_template(msgs, tokenize=False,
    add_generation_prompt=True)`` then ``generate``: mtpspec's tokenizer had no such method (nor
    ``len``). It renders as ``LLM.chat`` (transformers' defaults: tokenize, no generation prompt)."""
    from mtpspec.engine.detokenizer import Tokenizer, load_tokenizer
    hf = templated.backend
    tok = Tokenizer(hf)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "2?"}]}]
    flat = [conv[0], {"role": "user", "content": "2?"}]
    for kw in (dict(tokenize=False, add_generation_prompt=True), dict(tokenize=False, enable_thinking=False),
               dict(add_generation_prompt=True, enable_thinking=False), {}):
        assert tok.apply_chat_template(conv, **kw) == hf.apply_chat_template(flat, return_dict=False, **kw)
    assert len(tok) == len(hf)
    demo = load_tokenizer(demo_model_path())  # a bare tokenizer.json without a template: the plain one
    assert demo.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == render_plain(flat)
    assert demo.apply_chat_template(conv, add_generation_prompt=True) == demo.encode(render_plain(flat))
    assert len(demo) == demo.backend.get_vocab_size(with_added_tokens=True)
    assert demo.apply_chat_template(conv, return_dict=False) == demo.apply_chat_template(conv)
    with pytest.raises(ValueError, match="list of"):
        demo.apply_chat_template("hi")
