"""The request path's host work (issue 17): each prompt is tokenized and checked once per request,
from the HTTP handler to the engine thread, and the outputs are unchanged by it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from test_server_fixtures import make_served_model

from mtpspec import LLM, SamplingParams
from mtpspec.engine import llm_engine
from mtpspec.engine.async_llm import AsyncLLM
from mtpspec.engine.llm_engine import ValidatedPrompt

SPEC = {"method": "mtp", "num_speculative_tokens": 2, "use_local_argmax_reduction": True}
PROMPT = "Question: Ann has 4 cats and buys 3 more. How many cats does she have?\nAnswer:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("request_path_model"))
    make_served_model(path, seed=5)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLM.from_model(model_dir, device="cpu", max_model_len=256, max_num_seqs=4, speculative_config=SPEC)
    yield eng
    eng.shutdown()


class _Counts:
    """Counts ``Tokenizer.encode`` and the token-id type checks (``_all_ints``) while active."""

    def __init__(self, monkeypatch, eng: AsyncLLM):
        self.encode = self.checks = 0
        tok = eng.tokenizer
        encode, all_ints = tok.encode, llm_engine._all_ints

        def counted_encode(text, *args):
            self.encode += 1
            return encode(text, *args)

        def counted_all_ints(ids):
            self.checks += 1
            return all_ints(ids)
        monkeypatch.setattr(tok, "encode", counted_encode)
        monkeypatch.setattr(llm_engine, "_all_ints", counted_all_ints)


def _app(eng: AsyncLLM):
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    metrics = ServerMetrics(eng.num_speculative_tokens, {"model": "m"})
    return build_app(ServerContext(eng, "m", "m", {"model": "m"}, metrics))


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json=body, timeout=60)


def test_http_request_tokenized_and_checked_once(engine, monkeypatch):
    want = [o.outputs[0].text for o in _offline(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=8))]
    app = _app(engine)
    counts = _Counts(monkeypatch, engine)
    for stream in (False, True):
        counts.encode = counts.checks = 0
        r = asyncio.run(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                       "stream": stream}))
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            text = r.json()["choices"][0]["text"]
        assert text == want[0]
        assert (counts.encode, counts.checks) == (1, 1), f"stream={stream}"
    counts.encode = counts.checks = 0
    r = asyncio.run(_post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                        "max_tokens": 4, "temperature": 0}))
    assert r.status_code == 200, r.text
    assert counts.encode == 1 and counts.checks == 1


def _offline(eng: AsyncLLM, prompts, params):
    async def run():
        outs = []
        for p in prompts:
            async for out in eng.generate(p, params):
                pass
            outs.append(out)
        return outs
    return asyncio.run(run())


def test_validated_prompt_is_checked_again_with_other_params(engine):
    eng = engine.engine
    params = SamplingParams(temperature=0, max_tokens=4)
    vp = eng.validated_prompt(PROMPT, params)
    assert isinstance(vp, ValidatedPrompt) and vp.text == PROMPT and vp.token_ids == eng.tokenizer.encode(PROMPT)
    assert eng.validate_request(vp, params) == (PROMPT, vp.token_ids)
    other = SamplingParams(temperature=0, max_tokens=4, logprobs=21)  # not valid: checked again
    with pytest.raises(ValueError, match="greater than max allowed"):
        eng.validate_request(vp, other)
    assert eng.validate_request(ValidatedPrompt(None, [1, 2], params), SamplingParams()) == (None, [1, 2])


@pytest.mark.parametrize("ids, exc", [([1, True], TypeError), ([1, 2.0], TypeError), ([1, "2"], TypeError),
                                      ([1, 10 ** 6], ValueError), ([1, -1], ValueError)])
def test_token_id_checks_unchanged(engine, ids, exc):
    with pytest.raises(exc):
        engine.engine.validate_request({"prompt_token_ids": ids}, SamplingParams())


def test_int_subclass_ids_accepted(engine):
    class Id(int):
        pass
    assert engine.engine.validate_request({"prompt_token_ids": [Id(3), 4]}, SamplingParams()) == (None, [3, 4])


def test_offline_generate_tokenizes_once(model_dir, monkeypatch):
    llm = LLM(model_dir, device="cpu", max_model_len=256)
    try:
        calls = []
        tok = llm.get_tokenizer()
        encode = tok.encode
        monkeypatch.setattr(tok, "encode", lambda text, *args: calls.append(text) or encode(text, *args))
        out = llm.generate([PROMPT, "Numbers:"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(calls) == 2 and [o.prompt for o in out] == [PROMPT, "Numbers:"]
    finally:
        llm.shutdown()


def test_transformers_tokenizer_fast_path_gives_the_same_ids(model_dir, tmp_path):
    """A transformers fast tokenizer is called through its ``tokenizers.Tokenizer`` (same ids);
    a subclass that overrides a step of ``encode`` keeps transformers' own path."""
    import shutil

    from test_server_fixtures import gsm8k_rows

    from mtpspec.engine.detokenizer import load_tokenizer
    shutil.copy(f"{model_dir}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                               "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None and not tok._is_fast_lib and tok._rust is not None
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("test", 20)] + ["<|endoftext|> x<|endoftext|>"]
    for text in texts:
        assert tok.encode(text) == list(tok.backend.encode(text, add_special_tokens=False))
    whole = tok.encode(texts[-1])
    tok.backend.split_special_tokens = True  # a changed setting is followed (transformers' path sets it)
    for _ in range(2):
        split = tok.encode(texts[-1])
        assert split == list(tok.backend.encode(texts[-1], add_special_tokens=False)) and len(split) > len(whole)

    from mtpspec.engine.detokenizer import Tokenizer, _rust_backend
    backend = load_tokenizer(str(tmp_path)).backend

    class Custom(type(backend)):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)
    backend.__class__ = Custom
    assert _rust_backend(backend) is None and Tokenizer(backend)._rust is None


def test_first_output_hand_off_waits_for_the_loop(engine, monkeypatch):
    """``_hand_off`` returns once the loop ran what was queued before it (or after its time limit;
    at once for a closed loop); ``first_output_handoff_s`` is checked."""
    import threading
    import time
    monkeypatch.setattr(engine, "first_output_handoff_s", 0.002)  # off by default

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ran = []

        def woke():  # what a published output wakes: a callback that queues the next one
            loop.call_soon(lambda: ran.append(time.perf_counter()))
        loop.call_soon_threadsafe(woke)
        engine._hand_off({loop})
        assert ran and ran[0] <= time.perf_counter()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    stopped = asyncio.new_event_loop()  # not running: the wait ends at the limit
    t0 = time.perf_counter()
    engine._hand_off({stopped})
    assert 0.9 * engine.first_output_handoff_s <= time.perf_counter() - t0 < 1.0
    stopped.close()
    t0 = time.perf_counter()
    engine._hand_off({stopped})  # closed: at once
    assert time.perf_counter() - t0 < 0.5 * engine.first_output_handoff_s
    with pytest.raises(ValueError, match="first_output_handoff_s"):
        AsyncLLM(None, first_output_handoff_s=-1)


def test_one_hand_off_per_request_and_none_for_busy_steps(engine, monkeypatch):
    """A request's first output is handed off once (later outputs are not); a step that hands
    more than ``handoff_max_outputs`` outputs to the loops does not wait."""
    monkeypatch.setattr(engine, "first_output_handoff_s", 0.002)  # off by default
    calls = []
    hand_off = engine._hand_off

    def recorded(loops):
        if loops:
            calls.append(len(loops))
        hand_off(loops)
    monkeypatch.setattr(engine, "_hand_off", recorded)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = _offline(engine, [PROMPT], params)
    assert len(outs[0].outputs[0].token_ids) == 6 and calls == [1]
    calls.clear()
    monkeypatch.setattr(engine, "handoff_max_outputs", 0)
    assert [o.outputs[0].token_ids for o in _offline(engine, [PROMPT], params)] == [outs[0].outputs[0].token_ids]
    assert calls == []


def test_stop_strings_without_a_tokenizer_name_the_stop_param(engine, monkeypatch):
    """The 400 for stop strings on a model without a tokenizer names ``stop``, not ``prompt``."""
    monkeypatch.setattr(engine.engine, "tokenizer", None)
    r = asyncio.run(_post(_app(engine), "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stop": ["x"]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop" and "stop strings need a tokenizer" in err["message"]


def test_several_served_model_names_are_all_accepted(engine):
    """``--served-model-name a b`` (vLLM): either name is accepted, a response names the one its
    request sent (the first when it sent none: vLLM's ``_get_model_name``), ``/v1/models`` lists
    both; another name is a 404."""
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    metrics = ServerMetrics(engine.num_speculative_tokens, {"model": "m"})
    app = build_app(ServerContext(engine, ["a", "b"], "m", {"model": "m"}, metrics))
    r = asyncio.run(_post(app, "/v1/completions", {"model": "b", "prompt": [5, 6], "max_tokens": 2}))
    assert r.status_code == 200 and r.json()["model"] == "b", r.text
    r = asyncio.run(_post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}))
    assert r.status_code == 200 and r.json()["model"] == "a", r.text
    r = asyncio.run(_post(app, "/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2}))
    assert r.status_code == 200 and r.json()["model"] == "b", r.text
    r = asyncio.run(_post(app, "/v1/completions", {"model": "c", "prompt": [5], "max_tokens": 1}))
    assert r.status_code == 404 and r.json()["error"]["message"] == \
        "The model `c` does not exist. This server serves `a`, `b`.", r.text

    async def models():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return (await client.get("/v1/models")).json()
    assert [m["id"] for m in asyncio.run(models())["data"]] == ["a", "b"]
    with pytest.raises(ValueError, match="non-empty strings"):
        ServerContext(engine, [], "m", {}, metrics)


def test_a_lone_surrogate_prompt_is_named(engine):
    """JSON allows ``"\\ud800"``; the tokenizer's own error ("TextInputSequence must be str") said
    nothing a client could act on."""
    app = _app(engine)

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", content=b'{"prompt": "ab\\ud800c", "max_tokens": 2}',
                                     headers={"content-type": "application/json"}, timeout=60)
    r = asyncio.run(post())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "the prompt is not valid Unicode text: a lone surrogate U+D800 at character 2"


def test_text_prompts_get_the_tokenizer_s_special_tokens_as_vllm_adds_them(tmp_path):
    """A tokenizer whose post-processor adds a BOS (DeepSeek-V3's does): ``LLM.generate`` and
    ``/v1/completions`` tokenize text prompts with it (vLLM's default; ``add_special_tokens: false``
    drops it), chat completions without it (the template writes its own), ``/tokenize`` as vLLM
    (prompt: with, messages: without, both overridable)."""
    from tokenizers import Tokenizer, processors
    path = str(tmp_path / "m")
    make_served_model(path, seed=5)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    bos = 7  # any id: the post-processor puts it first
    tok.post_processor = processors.TemplateProcessing(single=f"{tok.id_to_token(bos)} $A",
                                                       special_tokens=[(tok.id_to_token(bos), bos)])
    tok.save(f"{path}/tokenizer.json")
    plain = tok.encode(PROMPT, add_special_tokens=False).ids
    assert tok.encode(PROMPT).ids == [bos] + plain
    eng = AsyncLLM.from_model(path, device="cpu", max_model_len=256, max_num_seqs=2)
    try:
        assert eng.engine.validate_request(PROMPT, SamplingParams())[1] == [bos] + plain
        assert eng.engine.validate_request(PROMPT, SamplingParams(), add_special_tokens=False)[1] == plain
        app = _app(eng)
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        for extra, want in (({}, [bos] + plain), ({"add_special_tokens": False}, plain)):
            r = asyncio.run(_post(app, "/v1/completions", {**body, **extra, "return_token_ids": True}))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["prompt_token_ids"] == want, extra
        msgs = [{"role": "user", "content": "Ann has 4 cats."}]
        r = asyncio.run(_post(app, "/tokenize", {"messages": msgs}))
        chat_ids = r.json()["tokens"]
        assert chat_ids[0] != bos
        assert asyncio.run(_post(app, "/tokenize", {"messages": msgs, "add_special_tokens": True})).json()["tokens"] \
            == [bos] + chat_ids
        assert asyncio.run(_post(app, "/tokenize", {"prompt": PROMPT})).json()["tokens"] == [bos] + plain
        assert asyncio.run(_post(app, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})).json()[
            "tokens"] == plain
        r = asyncio.run(_post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0,
                                                            "return_token_ids": True}))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == chat_ids
        r = asyncio.run(_post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0,
                                                            "return_token_ids": True, "add_special_tokens": True}))
        assert r.json()["choices"][0]["prompt_token_ids"] == [bos] + chat_ids
    finally:
        eng.shutdown()
    llm = LLM(path, device="cpu", max_model_len=256, max_num_seqs=2)  # found by review: LLM.chat as the server's chat
    try:
        params = SamplingParams(temperature=0, max_tokens=1)
        assert llm.chat(msgs, params, use_tqdm=False)[0].prompt_token_ids == chat_ids
        assert llm.generate(PROMPT, params, use_tqdm=False)[0].prompt_token_ids == [bos] + plain
    finally:
        llm.shutdown()


def test_internal_errors_are_json_500s_and_template_or_nesting_errors_400s(tmp_path, engine):
    """Found by a new-user pass: a chat template raising (its ``raise_exception``) and a body nested
    100,000 deep were 500s whose connection the server then closed ("connection reset" on the
    client's next request): Starlette's handler for ``Exception`` re-raises after answering. Now the
    two are 400s (vLLM's answer to a template error) and any other handler error a JSON 500 that
    leaves the connection alone (ASGI: the app does not raise)."""
    app = _app(engine)

    async def boom():
        raise RuntimeError("kaput")
    app.add_api_route("/boom", boom, methods=["POST"])
    r = asyncio.run(_post(app, "/boom", {}))  # httpx's ASGITransport raises what the app raises
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError: kaput"

    async def nested():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", content="[" * 100_000, timeout=60)
    r = asyncio.run(nested())
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]

    path = str(tmp_path / "m")
    make_served_model(path, seed=5)
    template = ("{% if oops %}{{ messages[0]['content'] + 1 }}{% endif %}"  # a TypeError inside the template
                "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be first') }}{% endif %}{{ m['content'] }}\n{% endfor %}")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "chat_template": template}, f)
    eng = AsyncLLM.from_model(path, device="cpu", max_model_len=256, max_num_seqs=2)
    try:
        bad = [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]
        for route, body in (("/v1/chat/completions", {"messages": bad, "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": bad, "max_tokens": 2, "stream": True}),
                            ("/tokenize", {"messages": bad})):
            r = asyncio.run(_post(_app(eng), route, body))
            assert r.status_code == 400, (route, r.text)
            assert "System message must be first" in r.json()["error"]["message"]
        r = asyncio.run(_post(_app(eng), "/v1/chat/completions", {"messages": bad[:1], "max_tokens": 2,
                                                                  "chat_template_kwargs": {"oops": True}}))
        assert r.status_code == 400 and "the chat template failed on this conversation: TypeError" in r.text, r.text
        good = [{"role": "system", "content": "y"}, {"role": "user", "content": "x"}]
        r = asyncio.run(_post(_app(eng), "/v1/chat/completions", {"messages": good, "max_tokens": 2}))
        assert r.status_code == 200, r.text
    finally:
        eng.shutdown()
    llm = LLM(path, device="cpu", max_model_len=256)
    try:
        with pytest.raises(ValueError, match="conversation 0: the chat template refused the conversation: System"):
            llm.chat(bad, SamplingParams(max_tokens=1), use_tqdm=False)
        # vLLM's chat_template_kwargs: more variables for the template (here one it tests), as the server takes them
        with open(f"{path}/tokenizer_config.json", "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                       "chat_template": "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"}, f)
    finally:
        llm.shutdown()
    llm = LLM(path, device="cpu", max_model_len=256)
    try:
        tok, params = llm.get_tokenizer(), SamplingParams(max_tokens=1, temperature=0)
        got = [llm.chat([{"role": "user", "content": "x"}], params, use_tqdm=False, chat_template_kwargs=kw)[0]
               for kw in (None, {"shout": True})]
        assert [o.prompt_token_ids for o in got] == [tok.encode("x"), tok.encode("LOUD x")]
        with pytest.raises(ValueError, match="^chat_template_kwargs may not set add_generation_prompt"):
            llm.chat([{"role": "user", "content": "x"}], params, chat_template_kwargs={"add_generation_prompt": 1})
        with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
            llm.chat([{"role": "user", "content": "x"}], params, chat_template_kwargs="abc")
    finally:
        llm.shutdown()


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(engine):
    """vLLM's ``stream_options.continuous_usage_stats`` (a new-user pass: ignored before): with
    ``include_usage`` every content chunk carries its prompt's usage so far, growing to the final
    usage chunk's; without it only the last chunk has usage."""
    app = _app(engine)
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        for continuous in (True, False):
            opts = {"include_usage": True, "continuous_usage_stats": continuous}
            r = asyncio.run(_post(app, route, {**body, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                               "stream": True, "stream_options": opts}))
            assert r.status_code == 200, r.text
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            content = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
            final = chunks[-1]["usage"]
            assert not chunks[-1]["choices"] and final["completion_tokens"] == 24
            if not continuous:
                assert all("usage" not in c for c in chunks[:-1]), route
                continue
            done = [c["usage"]["completion_tokens"] for c in content]
            assert done == sorted(done) and done[-1] == 24 and len(done) >= 2, (route, done)
            assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] and c["usage"]["total_tokens"]
                       == final["prompt_tokens"] + c["usage"]["completion_tokens"] for c in content)
            roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0].get("delta", {})]
            assert all(c["usage"] == {"prompt_tokens": final["prompt_tokens"], "completion_tokens": 0,
                                      "total_tokens": final["prompt_tokens"]} for c in roles)  # vLLM's, too
    # found by review, as vLLM: include_usage defaults to true once stream_options is given (null: false);
    # per-chunk completion_tokens are the chunk's own choice's (n = 2: up to 24, not 48)
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True, "stream": True, "n": 2}
    for opts, final_usage, per_chunk in (({}, True, False), ({"continuous_usage_stats": True}, True, True),
                                         ({"include_usage": None, "continuous_usage_stats": True}, False, False)):
        r = asyncio.run(_post(app, "/v1/completions", {**body, "stream_options": opts}))
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert ("usage" in chunks[-1] and not chunks[-1]["choices"]) == final_usage, opts
        content = [c for c in chunks if c["choices"]]
        assert all(("usage" in c) == per_chunk for c in content), opts
        if per_chunk:
            for j in (0, 1):
                own = [c["usage"]["completion_tokens"] for c in content if c["choices"][0]["index"] == j]
                assert own == sorted(own) and own[-1] == 24, own


def test_an_error_inside_a_stream_ends_it_with_an_error_event_and_done(engine, monkeypatch):
    """Found by review: an exception other than the engine's inside the SSE generators cut the
    connection (no error event, no [DONE]); vLLM sends both."""
    from mtpspec.entrypoints import openai_server
    app, calls = _app(engine), []
    real = openai_server._Delta.next

    def flaky(self, c):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("decode went wrong")
        return real(self, c)
    monkeypatch.setattr(openai_server._Delta, "next", flaky)
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        calls.clear()
        r = asyncio.run(_post(app, route, {**body, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                           "stream": True}))
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", route
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == 500 and "RuntimeError: decode went wrong" in err["message"], route


@pytest.mark.parametrize("k", [0, 2])
def test_streamed_echo_logprobs_of_several_choices_equal_non_streamed(model_dir, k):
    """A new-user pass (2026-12-05): with ``n > 1`` a request's first snapshot was published before any
    token (its progress, a tuple, was compared with 0), and a stream echoed the prompt with the logprobs
    known then (``[None]``, or the first prefill chunk's): one prompt entry, every later ``text_offset``
    short. Each streamed choice carries the whole prompt's entries, as the non-streamed answer does:
    plain decoding and k = 2, the prompt in 16-token prefill chunks, generating and scoring alone."""
    spec = {**SPEC, "num_speculative_tokens": k} if k else None
    eng = AsyncLLM.from_model(model_dir, device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                              speculative_config=spec)
    try:
        app = _app(eng)
        for max_tokens in (3, 0):
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1, "n": 2, "echo": True,
                    "logprobs": 0}
            full = sorted(asyncio.run(_post(app, "/v1/completions", body)).json()["choices"],
                          key=lambda c: c["index"])
            r = asyncio.run(_post(app, "/v1/completions", {**body, "stream": True}))
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"] for e in events[:-1]]
            for j, choice in enumerate(full):
                mine = [c[0] for c in chunks if c and c[0]["index"] == j]
                merged = {key: sum((c["logprobs"][key] for c in mine), []) for key in choice["logprobs"]}
                assert merged == choice["logprobs"], (max_tokens, j)
                assert "".join(c["text"] for c in mine) == choice["text"]
                assert len(merged["tokens"]) >= 16 and merged["text_offset"][0] == 0
    finally:
        eng.shutdown()


def test_api_key_guards_v1_as_vllm(engine, monkeypatch) -> None:
    """``serve --api-key`` (vLLM's flag; a new-user pass, 2026-12-05, found it refused): every ``/v1``
    request needs ``Authorization: Bearer <key>``, else a 401 error object; ``/health`` and
    ``/tokenize`` stay open; an empty key is refused."""
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    metrics = ServerMetrics(engine.num_speculative_tokens, {"model": "m"})
    app = build_app(ServerContext(engine, "m", "m", {"model": "m"}, metrics, api_key="s3cret"))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            out = {}
            for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("bare", {"Authorization": "s3cret"}), ("right", {"Authorization": "Bearer s3cret"})):
                out[name] = (await c.get("/v1/models", headers=headers),
                             await c.post("/v1/completions", json=body, headers=headers, timeout=60))
            out["open"] = (await c.get("/health"), await c.post("/tokenize", json={"prompt": "a b"}))
            out["reset"] = (await c.post("/reset_prefix_cache"),
                            await c.post("/reset_prefix_cache", headers={"Authorization": "Bearer s3cret"}))
            # two Authorization headers: the first counts (Starlette's reading)
            two = [("Authorization", "Bearer nope"), ("Authorization", "Bearer s3cret")]
            out["two"] = (await c.get("/v1/models", headers=two), await c.get("/v1/models", headers=two[::-1]))
            return out

    out = asyncio.run(main())
    for name in ("none", "wrong", "bare"):
        for r in out[name]:
            assert r.status_code == 401, (name, r.text)
            assert r.json()["error"]["code"] == 401 and "API key" in r.json()["error"]["message"]
    assert [r.status_code for r in out["right"]] == [200, 200] and [r.status_code for r in out["open"]] == [200, 200]
    assert [r.status_code for r in out["reset"]] == [401, 200] and [r.status_code for r in out["two"]] == [401, 200]
    # mtpspec's own clients send $OPENAI_API_KEY
    from mtpspec.entrypoints.bench_serve import api_key_headers
    monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
    assert api_key_headers() == {"Authorization": "Bearer s3cret"}
    monkeypatch.delenv("OPENAI_API_KEY")
    assert api_key_headers() == {}
    with pytest.raises(ValueError, match="must not be empty"):
        ServerContext(engine, "m", "m", {"model": "m"}, metrics, api_key="")


def test_request_ids_token_strs_documents_and_refused_vllm_fields(engine, monkeypatch) -> None:
    """Found by a new-user pass (2026-12-07), each silently ignored before: vLLM's ``request_id`` body
    field and ``X-Request-Id`` header name the response (``cmpl-<id>``; two requests with one id do not
    collide in the engine), ``/tokenize``'s ``return_token_strs`` gives ``token_strs``, chat
    ``documents`` reach the template; ``priority``, ``cache_salt``, ``structural_tag`` and
    ``prompt_embeds`` (vLLM serves them; ignoring them changes the output or its isolation) are 400s."""
    app = _app(engine)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            two = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3,
                                                                          "request_id": "abc"}, timeout=60)
                                         for _ in range(2)))
            hdr = await c.post("/v1/chat/completions", json={**chat, "request_id": "body"}, timeout=60,
                               headers={"X-Request-Id": "hdr"})
            stream = await c.post("/v1/chat/completions", json={**chat, "stream": True, "request_id": "s1"}, timeout=60)
            plain = await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=60)
            toks = await c.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
            refused = {f: await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, f: v})
                       for f, v in (("priority", 1), ("cache_salt", "s"), ("structural_tag", "{}"),
                                    ("prompt_embeds", "AAAA"))}
            ok = await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "priority": 0}, timeout=60)
            return two, hdr, stream, plain, toks, refused, ok

    two, hdr, stream, plain, toks, refused, ok = asyncio.run(main())
    assert [r.status_code for r in two] == [200, 200] and [r.json()["id"] for r in two] == ["cmpl-abc"] * 2
    assert hdr.json()["id"] == "chatcmpl-hdr"  # the header wins, as vLLM's _base_request_id
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(ch["id"] == "chatcmpl-s1" for ch in chunks)
    assert plain.json()["id"].startswith("cmpl-") and len(plain.json()["id"]) == 5 + 32
    ids = engine.tokenizer.encode("a b")
    assert toks.json()["tokens"] == ids and toks.json()["token_strs"] == engine.tokenizer.convert_ids_to_tokens(ids)
    assert "".join(toks.json()["token_strs"]).replace("\u0120", " ") == "a b"
    for field, r in refused.items():
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert ok.status_code == 200, ok.text
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% for d in documents or [] %}[{{ d.title }}] {% endfor %}{{ messages[0]['content'] }}",
                        raising=False)
    body = {**chat, "return_token_ids": True}
    docs = asyncio.run(_post(app, "/v1/chat/completions", {**body, "documents": [{"title": "T", "text": "x"}]}))
    assert docs.json()["choices"][0]["prompt_token_ids"] == engine.tokenizer.encode("[T] hi"), docs.text


def test_include_stop_str_in_output_keeps_a_stop_token_s_text(engine) -> None:
    """Found by a new-user pass (2026-12-07): with ``stop_token_ids`` and ``include_stop_str_in_output``
    the stop token's text was left out, as without the flag; vLLM's detokenizer adds it then (it skips
    it only when the flag is off)."""
    app = _app(engine)
    base = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = asyncio.run(_post(app, "/v1/completions", base)).json()["choices"][0]["token_ids"]
    dec = engine.tokenizer.decode
    # a stop token at its first occurrence whose text is whole (the random model emits partial UTF-8 bytes too)
    stop_id = next(t for i, t in enumerate(ids) if i and t not in ids[:i] and dec([t]).isprintable())
    texts = {}
    for keep in (False, True):
        for stream in (False, True):
            body = {**base, "stop_token_ids": [stop_id], "include_stop_str_in_output": keep, "stream": stream}
            r = asyncio.run(_post(app, "/v1/completions", body))
            chunks = ([json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
                      if stream else r.json()["choices"])
            texts[keep, stream] = "".join(ch["text"] for ch in chunks)
            assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == stop_id
    # with the flag the text goes on to the stop token's (a held-back partial byte before it decodes with it)
    kept = texts[True, False]
    assert kept == texts[True, True] and kept.startswith(texts[False, False]) and kept.endswith(dec([stop_id]))
    assert len(kept) > len(texts[False, False]), texts
    assert texts[False, True] == texts[False, False]


def test_cors_as_vllm(engine) -> None:
    """Found by a new-user pass (2026-12-07): no CORS headers, so a browser page could not call the
    server (a pre-flight got 405). As vLLM: every origin by default (pre-flights answered, a 401 of
    ``--api-key`` readable too), ``--allowed-origins`` narrows it."""
    from mtpspec.entrypoints.openai_server import ServerContext, build_app
    from mtpspec.entrypoints.serve import json_str_list
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    metrics = ServerMetrics(engine.num_speculative_tokens, {"model": "m"})
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}

    async def main(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return (await c.options("/v1/completions", headers=pre),
                    await c.get("/v1/models", headers={"Origin": "http://ui.example"}))

    flight, models = asyncio.run(main(build_app(ServerContext(engine, "m", "m", {}, metrics, api_key="k"))))
    assert flight.status_code == 200 and flight.headers["access-control-allow-origin"] == "*", flight.text
    assert models.status_code == 401 and models.headers["access-control-allow-origin"] == "*"
    narrow = {"allow_origins": json_str_list('["http://other"]'), "allow_credentials": False,
              "allow_methods": ["*"], "allow_headers": ["*"]}
    flight, models = asyncio.run(main(build_app(ServerContext(engine, "m", "m", {}, metrics, cors=narrow))))
    assert flight.status_code == 400 and "access-control-allow-origin" not in models.headers
    with pytest.raises(Exception, match="JSON list of strings"):
        json_str_list("http://a")
