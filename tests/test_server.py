"""End-to-end tests of `mtpspec serve` (a real server subprocess on 127.0.0.1) on a tiny random checkpoint.

References: the offline ``LLM.generate`` (same checkpoint and settings) for every greedy output,
and Hugging Face ``transformers``' own model for log-probabilities.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import torch

from test_server_fixtures import ServerProcess, gsm8k_rows, make_served_model, metric_value

from mtpspec import LLM, SamplingParams

MAX_LEN = 512
K = 3
SERVER_ARGS = ["-k", str(K), "--max-num-seqs", "8", "--max-model-len", str(MAX_LEN), "--max-queue-len", "256",
               "--debug-fault-marker", "FAULT-HERE"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served_model"))
    make_served_model(path, seed=3)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(model_dir, SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, device="cpu", max_num_seqs=8, max_model_len=MAX_LEN,
              speculative_config={"method": "mtp", "num_speculative_tokens": K, "use_local_argmax_reduction": True})
    yield llm
    llm.shutdown()


def _post(srv, path, body, timeout=60.0):
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def _sse_events(resp):
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def _prompts(n, seed=0):
    rows = gsm8k_rows("test", n + seed)[seed:]
    # mixed lengths: cut each question at a different word count
    return [" ".join(r["question"].split()[: 3 + (i * 7) % 40]) for i, r in enumerate(rows)]


def _metrics(srv):
    return httpx.get(srv.url + "/metrics", timeout=10).text


# ---------------------------------------------------------------------------- basics
def test_health_models_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert len(data) == 1 and data[0]["max_model_len"] == MAX_LEN and data[0]["vocab_size"] == 301
    info = data[0]["mtpspec"]
    assert info["num_speculative_tokens"] == K and info["fusion"] and info["local_argmax"] and not info["synthetic"]
    assert info["max_num_batched_tokens"] == MAX_LEN and info["dtype"] == "float32"  # resolved, not "derived"
    assert info["default_sampling_params"] == "none"  # no generation_config.json
    assert info["allreduce_backend"] == "none (tp 1)"  # what runs, as the start-up line says (not the flag's nccl)
    text = _metrics(server)
    total = metric_value(text, "mtpspec:kv_cache_total_blocks")
    assert total > 0 and metric_value(text, "mtpspec:kv_cache_free_blocks") == total
    from prometheus_client.parser import text_string_to_metric_families  # vLLM's model_name label, on every sample
    names = {s.labels.get("model_name") for f in text_string_to_metric_families(text) for s in f.samples
             if not s.name.startswith("mtpspec:engine_info")}
    assert names == {data[0]["id"]}, names
    for j in range(K):
        metric_value(text, "mtpspec:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(j)})
    assert metric_value(text, "mtpspec:forced_acceptance") == 0


def test_completion_equals_offline(server, offline):
    prompt = _prompts(1, seed=5)[0]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0,
                                          "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0]
    ch = body["choices"][0]
    assert ch["token_ids"] == ref.outputs[0].token_ids
    assert ch["text"] == ref.outputs[0].text
    assert ch["finish_reason"] == ref.outputs[0].finish_reason
    assert ch["prompt_token_ids"] == ref.prompt_token_ids
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                             "completion_tokens": len(ref.outputs[0].token_ids),
                             "total_tokens": len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)}
    assert body["object"] == "text_completion" and body["model"] == server_model_name(server)


def server_model_name(srv):
    return httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]


def test_list_prompts_and_token_ids(server, offline):
    texts = _prompts(3, seed=11)
    ids = [offline.get_tokenizer().encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = offline.generate(texts, params, use_tqdm=False)
    for prompt in (texts, ids):
        r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                              "return_token_ids": True, "model": server_model_name(server)})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [o.outputs[0].token_ids for o in ref]
    r = _post(server, "/v1/completions", {"prompt": ids[0], "max_tokens": 12, "temperature": 0,
                                          "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == ref[0].outputs[0].token_ids


def test_streaming_equals_non_streaming(server):
    prompt = _prompts(1, seed=21)[0]
    base = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    full = _post(server, "/v1/completions", base).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**base, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(full["token_ids"])
    body = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in body) == full["text"]
    assert sum((c["choices"][0]["token_ids"] for c in body), []) == full["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in body][-1] == full["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])


def test_stop_string_cut_and_never_streamed(server, offline):
    prompt = _prompts(1, seed=30)[0]
    full = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    assert len(full) > 12, full
    stop = full[8:11]
    cut = full[:full.find(stop)]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop]})
    ch = r.json()["choices"][0]
    assert ch["text"] == cut and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}) as s:
        events = _sse_events(s)
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    streamed = ""
    for t in texts:
        streamed += t
        assert stop not in streamed
    assert streamed == cut
    assert all(c["text"] or c["finish_reason"] for c in chunks), texts  # held-back text sends no empty chunk
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
                            "stop": stop, "stream": True}) as s:
        events = _sse_events(s)
    deltas = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}  # vLLM's first chunk
    assert all(d["delta"].get("content") or d["finish_reason"] for d in deltas[1:]), deltas


def test_include_stop_str_in_output(server, offline):
    """vLLM's flag: the matched stop string stays at the end of the text (streamed too)."""
    prompt = _prompts(1, seed=30)[0]
    full = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    stop = full[8:11]
    kept = full[:full.find(stop) + len(stop)]
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop], "include_stop_str_in_output": True}
    ch = _post(server, "/v1/completions", body).json()["choices"][0]
    assert ch["text"] == kept and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json=dict(body, stream=True)) as s:
        events = _sse_events(s)
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == kept
    msgs = [{"role": "user", "content": prompt}]
    chat = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 40, "temperature": 0}).json()
    text = chat["choices"][0]["message"]["content"]
    stop = text[4:7]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 40, "temperature": 0, "stop": stop,
                                               "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["message"]["content"] == text[:text.find(stop) + len(stop)], r.text


def test_unknown_fields_ignored_with_warning(server):
    """As vLLM: unknown fields are ignored (a warning names them), not a 400."""
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "store": False, "bogus_field_xyz": 1,
            "top_logprobs": 2, "response_format": {"type": "text"}}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                               "store": True, "metadata": {"a": "b"},
                                               "stream_options_typo": 1, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    log = server.log()
    assert "The following fields were present in the request but ignored" in log
    assert "bogus_field_xyz" in log and "stream_options_typo" in log


@pytest.mark.parametrize("endpoint,field,value", [
    ("/v1/completions", "min_p", 0.5), ("/v1/completions", "min_p", 2), ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "guided_json", {"type": "object"}), ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "bad_words", ["x"]), ("/v1/chat/completions", "chat_template", "{{ 1/0 }}"),
    ("/v1/chat/completions", "min_p", 0.1), ("/v1/chat/completions", "logits_processors", ["my.module.Proc"]),
    ("/v1/completions", "return_tokens_as_token_ids", True)])
def test_vllm_fields_not_served_are_a_400_naming_them(server, endpoint, field, value):
    """Found by a new-user review (2026-12-04): vLLM's ``min_p``, chat ``echo``, ``chat_template``, ...
    were ignored with a log line, so a client got output made without them. Set, they are a 400
    naming the field; at their defaults they pass (as unknown fields do)."""
    base = ({"prompt": "hi"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = _post(server, endpoint, {**base, "max_tokens": 2, "temperature": 0, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"] and repr(value) in err["message"], err
    default = {"min_p": 0.0, "use_beam_search": False, "guided_json": None, "echo": False,
               "bad_words": [], "chat_template": None, "logits_processors": None,
               "return_tokens_as_token_ids": False}[field]
    r = _post(server, endpoint, {**base, "max_tokens": 2, "temperature": 0, field: default})
    assert r.status_code == 200, r.text


def test_echo_logprobs_match_transformers(server, model_dir):
    from transformers import AutoModelForCausalLM
    prompt = _prompts(1, seed=40)[0]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                                          "logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"].startswith(prompt)
    ids = ch["prompt_token_ids"] + ch["token_ids"]
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    for i in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], ref[i - 1, ids[i]].item(), abs_tol=2e-4)
        top = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert math.isclose(top[0], ref[i - 1].max().item(), abs_tol=2e-4)
    # greedy outputs are the argmax: their logprob is the top one
    n_prompt = len(ch["prompt_token_ids"])
    for i in range(n_prompt, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], max(lp["top_logprobs"][i].values()), abs_tol=1e-6)
    # vLLM's convention: the chosen token is always among the alternatives (N or N + 1 entries)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] in top and top[lp["tokens"][i]] == lp["token_logprobs"][i] and len(top) <= 3
    r00 = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                                            "logprobs": 0})
    lp00 = r00.json()["choices"][0]["logprobs"]
    assert lp00["top_logprobs"][0] is None
    assert all(top == {t: v} for t, v, top in zip(lp00["tokens"][1:], lp00["token_logprobs"][1:],
                                                  lp00["top_logprobs"][1:]))
    # prompt scoring alone (max_tokens 0 + echo), as lm-eval's loglikelihood would ask
    r0 = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    lp0 = r0.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp0) == n_prompt and lp0[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp0[1:], lp["token_logprobs"][1:n_prompt]))
    # the same without logprobs, streamed: still server-sent events (one event, then [DONE])
    chunks = _stream(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert [c["choices"][0]["text"] for c in chunks] == [prompt]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    # streamed prompt scoring with n > 1: one chunk per choice, each its echo + logprobs and finish reason
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 3, "temperature": 1.0}
    chunks = _stream(server, "/v1/completions", body)
    assert sorted(c["choices"][0]["index"] for c in chunks) == [0, 1, 2], chunks
    for c in chunks:
        ch = c["choices"][0]
        assert ch["text"] == prompt and ch["finish_reason"] == "length", ch
        assert ch["logprobs"]["token_logprobs"] == lp0 or all(
            math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ch["logprobs"]["token_logprobs"][1:], lp0[1:]))


def _stream(srv, path, body):
    with httpx.stream("POST", srv.url + path, timeout=60, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_equal_non_streamed(server, offline, echo):
    """Logprobs stream with the tokens (one entry per streamed token, text offsets continued) and
    equal the non-streamed answer, which equals the offline engine's Logprob values."""
    prompt = _prompts(1, seed=44)[0]
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "logprobs": 3, "echo": echo,
            "return_token_ids": True, "stop": [" the"]}
    full = _post(server, "/v1/completions", body).json()["choices"][0]
    chunks = _stream(server, "/v1/completions", body)
    merged = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in full["logprobs"]}
    assert merged == full["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert len(chunks) > 2  # several steps, each with its tokens' entries
    n_prompt = len(full["prompt_token_ids"]) if echo else 0
    assert len(full["logprobs"]["tokens"]) == n_prompt + len(full["token_ids"])
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" the"], logprobs=3))[0]
    assert full["token_ids"] == ref.outputs[0].token_ids
    for i, d in enumerate(ref.outputs[0].logprobs):
        tid = ref.outputs[0].token_ids[i]
        assert math.isclose(full["logprobs"]["token_logprobs"][n_prompt + i], d[tid].logprob, abs_tol=1e-5)
        assert 1 <= len(full["logprobs"]["top_logprobs"][n_prompt + i]) <= 4  # ids that decode alike merge
    # chat: logprobs + top_logprobs, streamed == non-streamed
    chat = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    cfull = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    cchunks = _stream(server, "/v1/chat/completions", chat)
    streamed = sum(((c["choices"][0]["logprobs"] or {"content": []})["content"] for c in cchunks), [])
    assert streamed == cfull and len(cfull) > 0 and all(len(e["top_logprobs"]) == 2 for e in cfull)


def test_penalties_min_tokens_logit_bias_equal_offline(server, offline):
    """vLLM's parameter names through the server give the offline engine's tokens (k = 3 both)."""
    prompts = _prompts(3, seed=70)
    extra = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.4,
             "logit_bias": {"0": 30.0, "17": -100}, "min_tokens": 6}
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.8,
                                                   frequency_penalty=0.5, repetition_penalty=1.4,
                                                   logit_bias={0: 30.0, 17: -100.0}, min_tokens=6), use_tqdm=False)
    r = _post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 16, "temperature": 0,
                                          "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [o.outputs[0].token_ids for o in ref]
    for c in choices:  # EOS (id 0, biased up) waits for min_tokens, then ends the request
        assert len(c["token_ids"]) == 7 and c["token_ids"][-1] == 0 and c["finish_reason"] == "stop"
    plain = _post(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 16, "temperature": 0,
                                              "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert plain != choices[0]["token_ids"]
    msg = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_logprobs": 2}
    r = _post(server, "/v1/chat/completions", msg)
    assert r.status_code == 400 and "when using `top_logprobs`, `logprobs` must be set to true." in r.text


def test_chat_template_kwargs_are_taken(server):
    """vLLM's ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``, which GLM / Qwen clients send)
    reach the chat template: the plain template has no variables, so the output is the same as without;
    setting what the server sets is a 400 naming the field (/tokenize too)."""
    base = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    ref = _post(server, "/v1/chat/completions", base)
    got = _post(server, "/v1/chat/completions", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert ref.status_code == got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    for path, body in [("/v1/chat/completions", base), ("/tokenize", {"messages": base["messages"]})]:
        bad = _post(server, path, {**body, "chat_template_kwargs": {"tokenize": True}})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "chat_template_kwargs" and "may not set tokenize" in err["message"], err


def test_chat_plain_template(server, offline):
    from mtpspec.entrypoints.chat_template import render_plain
    msgs = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 2 + 3?"}]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0,
                                               "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert body["object"] == "chat.completion" and ch["message"]["role"] == "assistant"
    prompt = render_plain([(m["role"], m["content"]) for m in msgs])
    assert prompt == "Solve it.\n\nQuestion: What is 2 + 3?\nAnswer:"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=["Question:"]))[0]
    assert ch["token_ids"] == ref.outputs[0].token_ids and ch["message"]["content"] == ref.outputs[0].text
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True}) as s:
        events = _sse_events(s)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ch["message"]["content"]


# ---------------------------------------------------------------------------- n and best_of
NB = dict(max_tokens=10, temperature=0.8, seed=5, return_token_ids=True)


def _by_index(choices):
    return {c["index"]: c for c in choices}


def test_n_choices_equal_offline(server, offline):
    """Two prompts, n = 3: choice index = prompt position * 3 + i, each the offline engine's
    completion i (seeded: child i draws with seed + i); usage counts all six completions."""
    texts = _prompts(2, seed=61)
    r = _post(server, "/v1/completions", {"prompt": texts, "n": 3, **NB})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = _by_index(body["choices"])
    assert sorted(ch) == list(range(6))
    refs = offline.generate(texts, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10), use_tqdm=False)
    for p, ref in enumerate(refs):
        for c in ref.outputs:
            got = ch[p * 3 + c.index]
            assert got["token_ids"] == c.token_ids and got["text"] == c.text and got["finish_reason"] == c.finish_reason
            assert got["prompt_token_ids"] == ref.prompt_token_ids
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 3  # the children sample apart
    prompt_tokens = sum(len(o.prompt_token_ids) for o in refs)
    completion_tokens = sum(len(c.token_ids) for o in refs for c in o.outputs)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    # and streamed: every chunk one choice with its index, each choice's pieces add up, one finish each
    chunks = _stream(server, "/v1/completions", {"prompt": texts, "n": 3, **NB,
                                                 "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    pieces = {}
    for c in chunks[:-1]:
        (x,) = c["choices"]
        t, ids, fin = pieces.get(x["index"], ("", [], []))
        fin = fin + ([x["finish_reason"]] if x["finish_reason"] else [])
        pieces[x["index"]] = (t + x["text"], ids + x["token_ids"], fin)
    for i, (t, ids, fin) in pieces.items():
        assert (t, ids, fin) == (ch[i]["text"], ch[i]["token_ids"], [ch[i]["finish_reason"]])
    assert sorted(pieces) == list(range(6))


def test_chat_n_choices(server, offline):
    from mtpspec.entrypoints.chat_template import render_plain
    msgs = [{"role": "user", "content": "Name a number."}]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "n": 2, **NB})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = offline.generate(render_plain([("user", "Name a number.")]),
                           SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=10, stop=["Question:"]))[0]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in ref.outputs]
    assert [c["message"]["content"] for c in body["choices"]] == [c.text for c in ref.outputs]
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in ref.outputs)
    chunks = _stream(server, "/v1/chat/completions", {"messages": msgs, "n": 2, **NB})
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1] and all(len(c["choices"]) == 1 for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(x["delta"].get("content", "") for x in mine) == ref.outputs[i].text
        assert [x["finish_reason"] for x in mine if x["finish_reason"]] == [ref.outputs[i].finish_reason]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "best_of": 2})  # a completions-only field
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_best_of_equals_offline_and_is_not_streamed(server, offline):
    """best_of = 4, n = 2: the offline engine's two best (highest cumulative logprob) choices; with
    ``stream`` the same response arrives as one event (vLLM: best_of != n is not streamed)."""
    prompt = _prompts(1, seed=71)[0]
    req = {"prompt": prompt, "n": 2, "best_of": 4, **NB}
    body = _post(server, "/v1/completions", req).json()
    ref = offline.generate(prompt, SamplingParams(n=2, best_of=4, temperature=0.8, seed=5, max_tokens=10))[0]
    cands = offline.generate([prompt] * 4, [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=10, logprobs=0)
                                            for i in range(4)], use_tqdm=False)
    best = sorted(cands, key=lambda o: -o.outputs[0].cumulative_logprob)[:2]
    assert [c.token_ids for c in ref.outputs] == [o.outputs[0].token_ids for o in best]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in ref.outputs]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in ref.outputs)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={**req, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp)
    assert len(events) == 2 and events[-1] == "[DONE]"
    one = json.loads(events[0])
    assert one["choices"] == body["choices"] and one["usage"] == body["usage"]


def test_n_params_are_named_in_errors(server):
    for body, param in (({"prompt": "hi", "n": 0}, "n"), ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
                        ({"prompt": "hi", "n": 2, "temperature": 0}, "n")):
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_n_disconnect_aborts_every_choice(server):
    text = _metrics(server)
    total = metric_value(text, "mtpspec:kv_cache_total_blocks")
    aborted0 = metric_value(text, "mtpspec:request_aborted_total")
    body = {"prompt": "A long story:", "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()  # kept: closing the iterator would close the stream
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 6:
                    break
        assert metric_value(_metrics(server), "mtpspec:num_requests_running") == 3
    _wait_metric(server, "mtpspec:request_aborted_total", lambda v: v == aborted0 + 1)
    _wait_metric(server, "mtpspec:kv_cache_free_blocks", lambda v: v == total)
    assert metric_value(_metrics(server), "mtpspec:num_requests_running") == 0


# ---------------------------------------------------------------------------- errors
BAD_COMPLETIONS = [
    ({"max_tokens": 4}, "prompt"),                                 # missing prompt
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),  # no guided decoding
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "Stream options can only be defined when"),
    ({"prompt": []}, "empty"),
    ({"prompt": [5, 301]}, "vocabulary"),
    ({"prompt": [7] * MAX_LEN}, "max_model_len"),                   # over-long prompt
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -3}, "top_k"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "n": 0}, "n must be at least 1, got 0."),
    ({"prompt": "hi", "n": 16385}, "n must be at most 16384, got 16385."),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    ({"prompt": "hi", "best_of": 0}, "best_of must be at least 1, got 0."),
    ({"prompt": "hi", "n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ({"prompt": "hi", "best_of": 2, "temperature": 0}, "best_of must be 1 when using greedy sampling, got 2."),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "seed": "abc"}, "seed"),
    ({"prompt": "hi", "max_tokens": "12"}, "max_tokens"),          # strict types: no coercion
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5."),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty must be greater than zero"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens must be greater than or equal to 0"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens must be less than or equal to max_tokens=4"),
    ({"prompt": "hi", "logit_bias": {"abc": 1.0}}, "logit_bias contains key(s) that cannot be converted"),
    ({"prompt": "hi", "logit_bias": {"301": 1.0}}, "token_id(s) [301] in logit_bias contain out-of-vocab token ids"),
    ({"prompt": "hi", "logprobs": -2}, "`logprobs` must be a positive value or -1."),
    ({"prompt": "hi", "logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt": "hi", "prompt_logprobs": 2, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "seed": 2 ** 63}, "seed"),
    ({"prompt": "hi", "seed": -2 ** 63 - 1}, "seed"),
    ({"prompt": "hi", "stop_token_ids": [301]}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
]


def test_validation_errors_name_the_field(server):
    """Union fields are named without pydantic's branch suffix, with the accepted types; chat's
    ``max_completion_tokens`` is named as sent, a chat prompt too long for the context as
    ``messages``; unknown routes / methods get OpenAI-style errors."""
    msgs = [{"role": "user", "content": "x"}]
    for path, body, param in (("/v1/completions", {"prompt": 5}, "prompt"),
                              ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
                               "messages.0.content"),
                              ("/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 0},
                               "max_completion_tokens")):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], err
    err = _post(server, "/v1/completions", {"prompt": 5}).json()["error"]
    assert "expected one of str, list[str], list[int], list[list[int]], got integer" in err["message"], err
    # a chat request too long for the context: its field is messages, the text vLLM's
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_LEN}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", err
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, your "
                                     "request has "), err
    for r, code in ((httpx.get(server.url + "/v1/nothing"), 404), (httpx.get(server.url + "/v1/completions"), 405)):
        assert r.status_code == code
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"], err
        assert set(err) == {"message", "type", "param", "code"}


def test_null_stream_echo_and_chat_logprobs_read_as_false(server):
    """OpenAI's API types ``stream``, ``echo`` and chat's ``logprobs`` "boolean or null" (vLLM:
    ``Optional[bool] = False``): a client that sends ``null`` gets the default, not a 400 (it was
    "stream: Input should be a valid boolean"); a non-boolean is still a 400."""
    want = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0}).json()
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": None,
                                          "echo": None, "logprobs": None})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"] and r.json()["choices"][0]["logprobs"] is None
    msgs = [{"role": "user", "content": "x"}]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stream": None, "logprobs": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = _post(server, "/v1/completions", {"prompt": "hi", "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text


@pytest.mark.parametrize("body,needle", BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(server, body, needle):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert needle in err["message"] or needle == err["param"], err


def test_empty_model_name_is_the_served_model(server):
    """``"model": ""`` reads as no model, as in vLLM (``_is_model_supported``: ``if not model_name:
    return True``); it was a 404 "The model `` does not exist". The response names the served model."""
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": ""})
    assert r.status_code == 200 and r.json()["model"] == server_model_name(server), r.text
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                               "model": ""})
    assert r.status_code == 200 and r.json()["model"] == server_model_name(server), r.text


def test_unknown_model_is_vllms_404(server):
    for path, body in (("/v1/completions", {"prompt": "hi", "model": "gpt-4"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "other"})):
        r = _post(server, path, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == 404 and err["param"] == "model"
        assert err["message"].startswith(f"The model `{body['model']}` does not exist."), err


def test_bad_bodies_and_chat_get_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text  # no tool calling, as vLLM's default
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                                               "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):  # vLLM's 400: no tools
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "tool_choice": choice, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", (choice, r.text)
        assert r.json()["error"]["message"] == "When using `tool_choice`, `tools` must be set.", r.text
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                                               "max_tokens": 2})
    assert r.status_code == 200, r.text
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},  # the plain template's 400
                 {"messages": [{"role": 7, "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_p": -1}):
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (body, r.text)
    # the server keeps serving
    r = _post(server, "/v1/completions", {"prompt": "Ok", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------- concurrency
def test_32_concurrent_requests_equal_offline(server, offline):
    prompts = _prompts(32, seed=100)
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = offline.generate(prompts, params, use_tqdm=False)
    before = _metrics(server)

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.post(server.url + "/v1/completions",
                           json={"prompt": p, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
                    for p in prompts]
            return await asyncio.gather(*reqs)

    resps = asyncio.run(go())
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200]
    got = [r.json()["choices"][0] for r in resps]
    assert [g["token_ids"] for g in got] == [o.outputs[0].token_ids for o in ref]
    assert [g["text"] for g in got] == [o.outputs[0].text for o in ref]
    after = _metrics(server)
    steps = metric_value(after, "mtpspec:engine_steps_total") - metric_value(before, "mtpspec:engine_steps_total")
    toks = sum(len(o.outputs[0].token_ids) for o in ref)
    assert steps < toks / 2, (steps, toks)  # requests shared steps (continuous batching)
    assert metric_value(after, "mtpspec:kv_cache_free_blocks") == metric_value(after, "mtpspec:kv_cache_total_blocks")


def test_prefix_cache_metrics_and_reset(server, offline):
    """Two prompts sharing a long prefix: the second is served from the prefix cache (tokens in
    ``prefix_cache_hits_total``; ``prompt_tokens_total`` counts them, as vLLM's does, and
    ``prefill_tokens_total`` does not), its output equals the offline engine's; ``POST
    /reset_prefix_cache`` empties the cache, after which the same prompt is computed whole."""
    rows = gsm8k_rows("test", 3)
    prefix = "\n\n".join(r["question"] for r in rows[:2]) + "\n\nQuestion: "
    prompts = [prefix + "How many apples?", prefix + "What is the total cost?"]
    ntok = [len(_post(server, "/tokenize", {"prompt": p}).json()["tokens"]) for p in prompts]
    assert ntok[0] > 40

    def send(p):
        before = _metrics(server)
        r = _post(server, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        after = _metrics(server)
        d = lambda name: metric_value(after, name) - metric_value(before, name)  # noqa: E731
        # vLLM's prompt_tokens: the whole prompt, cached or not; prefill_tokens: what was computed
        assert d("mtpspec:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
        assert d("mtpspec:prefill_tokens_total") == d("mtpspec:prompt_tokens_total") - d("mtpspec:prefix_cache_hits_total")
        return r.json()["choices"][0]["token_ids"], d("mtpspec:prefix_cache_queries_total"), \
            d("mtpspec:prefix_cache_hits_total")

    assert _post(server, "/reset_prefix_cache", {}).json()["status"] == "ok"
    first = send(prompts[0])
    assert first[1:] == (ntok[0], 0)
    second = send(prompts[1])
    assert second[1] == ntok[1] and 16 <= second[2] < ntok[1]
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [first[0], second[0]] == [o.outputs[0].token_ids for o in ref]
    r = _post(server, "/reset_prefix_cache", {})
    assert r.status_code == 200 and r.json()["num_blocks_reset"] > 0
    assert send(prompts[1]) == (second[0], ntok[1], 0)


@pytest.fixture(scope="module")
def details_server(model_dir):
    srv = ServerProcess(model_dir, SERVER_ARGS + ["--enable-prompt-tokens-details"])
    yield srv
    srv.stop()


def _stream_usage(srv, path, body):
    with httpx.stream("POST", srv.url + path, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    return last["usage"]


def test_usage_prompt_tokens_details_cached_tokens(details_server, server):
    """vLLM's ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` is
    the prompt tokens the prefix cache served, present only when non-zero; completions and chat,
    non-streaming and the streamed usage chunk. Without the flag the field never appears."""
    rows = gsm8k_rows("test", 4)
    prompt = "\n\n".join(r["question"] for r in rows[:3]) + "\n\nQuestion: How many?\nAnswer:"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    ntok = len(_post(details_server, "/tokenize", {"prompt": prompt}).json()["tokens"])
    assert ntok > 64
    assert _post(details_server, "/reset_prefix_cache", {}).status_code == 200
    first = _post(details_server, "/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == ntok and "prompt_tokens_details" not in first  # computed whole: vLLM omits 0
    second = _post(details_server, "/v1/completions", body).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert ntok - 16 <= cached < ntok  # every full block but the last token's, which is always computed
    assert _stream_usage(details_server, "/v1/completions", body) == second
    # two prompts in one request: the cached tokens of both (the second one computed whole)
    other = "Tell me a story about " + rows[3]["question"]
    both = _post(details_server, "/v1/completions", {**body, "prompt": [prompt, other]}).json()["usage"]
    assert both["prompt_tokens_details"]["cached_tokens"] == cached
    # n > 1: the prompt counts once, so do its cached tokens (child 0's)
    nb = _post(details_server, "/v1/completions", {**body, "n": 2, "temperature": 0.8, "seed": 1}).json()["usage"]
    assert nb["prompt_tokens"] == ntok and nb["prompt_tokens_details"]["cached_tokens"] == cached
    # chat: the same rule
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
    c1 = _post(details_server, "/v1/chat/completions", chat).json()["usage"]
    c2 = _post(details_server, "/v1/chat/completions", chat).json()["usage"]
    assert "prompt_tokens_details" not in c1
    assert 0 < c2["prompt_tokens_details"]["cached_tokens"] < c2["prompt_tokens"] == c1["prompt_tokens"]
    assert _stream_usage(details_server, "/v1/chat/completions", chat) == c2
    assert httpx.get(details_server.url + "/v1/models").json()["data"][0]["mtpspec"]["enable_prompt_tokens_details"]
    # the flag off (vLLM's default): no details even when the prefix cache served the prompt
    before = metric_value(_metrics(server), "mtpspec:prefix_cache_hits_total")
    for _ in range(2):
        assert "prompt_tokens_details" not in _post(server, "/v1/completions", body).json()["usage"]
        assert "prompt_tokens_details" not in _stream_usage(server, "/v1/completions", body)
        assert "prompt_tokens_details" not in _post(server, "/v1/chat/completions", chat).json()["usage"]
    assert metric_value(_metrics(server), "mtpspec:prefix_cache_hits_total") - before >= 3 * (ntok - 16)


def _wait_metric(srv, name, pred, timeout=30.0, labels=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = metric_value(_metrics(srv), name, labels)
        if pred(v):
            return v
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach the expected value (last {v})")


def test_disconnect_aborts_and_frees_blocks(server):
    text = _metrics(server)
    total = metric_value(text, "mtpspec:kv_cache_total_blocks")
    aborted0 = metric_value(text, "mtpspec:request_aborted_total")
    gen0 = metric_value(text, "mtpspec:generation_tokens_total")
    ttft0 = metric_value(text, "mtpspec:time_to_first_token_seconds_count")
    itl0 = metric_value(text, "mtpspec:inter_token_latency_seconds_count")
    assert metric_value(text, "mtpspec:kv_cache_usage_perc") == 0.0  # vLLM's gauge: nothing running
    for name in ("request_time_per_output_token_seconds_count", "num_preemptions_total"):  # vLLM's names
        metric_value(text, "mtpspec:" + name)
    body = {"prompt": "A long story:", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        during = _metrics(server)
        v = metric_value(during, "mtpspec:kv_cache_free_blocks")
        assert v < total  # the request holds blocks while it runs
        assert metric_value(during, "mtpspec:kv_cache_usage_perc") == pytest.approx((total - v) / total)
    _wait_metric(server, "mtpspec:request_aborted_total", lambda v: v == aborted0 + 1)
    _wait_metric(server, "mtpspec:kv_cache_free_blocks", lambda v: v == total)
    after = _metrics(server)
    # as vLLM v1, a client's abort is no finished request: request_success does not count it
    assert 'finished_reason="abort"' not in after
    assert metric_value(after, "mtpspec:num_requests_running") == 0
    assert metric_value(after, "mtpspec:generation_tokens_total") - gen0 < 400
    # the cut stream's first token and its gaps are counted (vLLM records them per step, finished or not)
    assert metric_value(after, "mtpspec:time_to_first_token_seconds_count") == ttft0 + 1
    assert metric_value(after, "mtpspec:inter_token_latency_seconds_count") >= itl0 + 2
    # non-streaming: the client gives up (timeout) and the server aborts the request too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "Another long story:", "max_tokens": 480, "temperature": 0, "ignore_eos": True})
    _wait_metric(server, "mtpspec:request_aborted_total", lambda v: v == aborted0 + 2)
    _wait_metric(server, "mtpspec:kv_cache_free_blocks", lambda v: v == total)


# ---------------------------------------------------------------------------- queue limit and faults
@pytest.fixture(scope="module")
def small_server(model_dir):
    srv = ServerProcess(model_dir, ["-k", "1", "--max-num-seqs", "1", "--max-queue-len", "1", "--max-model-len",
                                    str(MAX_LEN)])
    yield srv
    srv.stop()


def test_full_queue_gets_503(small_server):
    srv = small_server
    long_body = {"prompt": "Count:", "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=long_body, timeout=60) as a:
        a_lines = a.iter_lines()  # keep the iterator: dropping it closes the connection (= disconnect)
        assert next(a_lines).startswith("data: ")  # A runs
        with httpx.stream("POST", srv.url + "/v1/completions", json=long_body, timeout=60) as b:
            assert b.status_code == 200
            _wait_metric(srv, "mtpspec:num_requests_waiting", lambda v: v == 1)  # B waits (max_num_seqs 1)
            r = _post(srv, "/v1/completions", {"prompt": "C", "max_tokens": 2})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == 503 and "queue is full" in err["message"]
    total = metric_value(_metrics(srv), "mtpspec:kv_cache_total_blocks")
    _wait_metric(srv, "mtpspec:kv_cache_free_blocks", lambda v: v == total)
    _wait_metric(srv, "mtpspec:num_requests_waiting", lambda v: v == 0)
    r = _post(srv, "/v1/completions", {"prompt": "C", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_batch_larger_than_the_queue_is_a_400_and_queues_nothing(small_server):
    """max_queue_len 1: two prompts in one request can never be queued together (400, not a
    retryable 503), and nothing of the request is queued or counted as aborted."""
    srv = small_server
    aborted0 = metric_value(_metrics(srv), "mtpspec:request_aborted_total")
    r = _post(srv, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "max_queue_len=1" in err["message"] and "2 prompts" in err["message"]
    assert metric_value(_metrics(srv), "mtpspec:request_aborted_total") == aborted0
    r = _post(srv, "/v1/completions", {"prompt": ["a"], "max_tokens": 2, "n": 2})  # n > 1 is one request
    assert r.status_code == 200, r.text


def test_fault_in_one_request_fails_only_it(server, offline):
    srv = server
    ref = offline.generate([f"Fine {i}" for i in range(3)], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    failed0 = metric_value(_metrics(srv), "mtpspec:request_failed_total")

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            ok = [c.post(srv.url + "/v1/completions", json={"prompt": f"Fine {i}", "max_tokens": 6, "temperature": 0,
                                                            "return_token_ids": True}) for i in range(3)]
            bad = c.post(srv.url + "/v1/completions", json={"prompt": "FAULT-HERE please", "max_tokens": 6})
            return await asyncio.gather(bad, *ok)

    bad, *ok = asyncio.run(go())
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"], bad.text
    assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
    assert [r.json()["choices"][0]["token_ids"] for r in ok] == [o.outputs[0].token_ids for o in ref]
    text = _metrics(srv)
    assert metric_value(text, "mtpspec:request_failed_total") == failed0 + 1
    assert metric_value(text, "mtpspec:kv_cache_free_blocks") == metric_value(text, "mtpspec:kv_cache_total_blocks")
    # streaming: the failing request gets an error event, then [DONE]
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"prompt": "FAULT-HERE", "max_tokens": 6, "stream": True}) as s:
        events = _sse_events(s)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    assert httpx.get(srv.url + "/health").status_code == 200


# ---------------------------------------------------------------------------- tensor parallel
def test_tp2_server_equals_offline_tp1(model_dir, offline):
    srv = ServerProcess(model_dir, ["--tp", "2"] + SERVER_ARGS[:-2])
    try:
        prompts = _prompts(4, seed=60)
        ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        r = _post(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 12, "temperature": 0,
                                           "return_token_ids": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [o.outputs[0].token_ids for o in ref]
        for c in choices:  # scored from the gathered verify logits; greedy tokens are the top alternative
            lp = c["logprobs"]
            assert len(lp["token_logprobs"]) == len(c["token_ids"])
            assert all(math.isclose(t, max(top.values()), abs_tol=1e-5)
                       for t, top in zip(lp["token_logprobs"], lp["top_logprobs"]))
        text = _metrics(srv)
        info = httpx.get(srv.url + "/v1/models").json()["data"][0]["mtpspec"]
        assert info["tp"] == 2 and info["allreduce_backend"] == "gloo"  # --allreduce-backend nccl on CPU ranks
        assert metric_value(text, "mtpspec:collective_bytes_total", {"op": "all_reduce"}) > 0
        assert metric_value(text, "mtpspec:kv_cache_free_blocks") == metric_value(text, "mtpspec:kv_cache_total_blocks")
        _kill_a_rank_mid_stream(srv)
    finally:
        srv.stop()


def test_tp2_server_notices_a_rank_that_dies_while_idle(model_dir):
    """Found by a new-user review (2026-12-04): a rank killed while no request ran went unnoticed
    (``/health`` 200), the next request failed with a bare ``BrokenPipeError`` and only the one
    after it marked the engine dead. Now the server's watcher and ``/health`` check the rank
    processes: the next request fails naming the dead rank (503 once noticed; a 500 naming it if
    it races the watcher), ``/health`` is 503 with the same line, and the server exits with status 1."""
    import os
    import re
    import signal
    import time
    srv = ServerProcess(model_dir, ["--tp", "2"] + SERVER_ARGS[:-2])
    try:
        ranks = _spawned_children(srv.proc.pid)
        assert len(ranks) == 2, ranks
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        os.kill(ranks[-1], signal.SIGKILL)
        r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert r.status_code in (500, 503), r.text
        msg = r.json()["error"]["message"]
        assert re.search(r"rank \d died \(exit code -9, SIGKILL\)", msg) and "Traceback" not in msg, msg
        health, t0 = None, time.monotonic()
        while time.monotonic() - t0 < 5:  # the server exits a moment after noticing
            try:
                health = httpx.get(srv.url + "/health", timeout=5)
            except httpx.HTTPError:
                break
            if health.status_code == 503:
                break
            time.sleep(0.1)
        assert health is None or (health.status_code == 503 and "rank 1 died" in health.text), health.text
        assert srv.proc.wait(timeout=30) == 1
        log = srv.log()
        last = log.rstrip().splitlines()[-1]
        assert re.match(r"error: .*rank 1 died \(exit code -9, SIGKILL\).*; the server shut down$", last), log[-2000:]
        # the exit skips the interpreter's teardown, as Ctrl-C's does: no page of native leak warnings
        # ("nanobind: leaked 4 instances! ... leaked 518 functions!") after the error line
        assert "leaked" not in log, log[-2000:]
    finally:
        srv.stop()


def _spawned_children(pid):
    """Pids of ``pid``'s multiprocessing-spawned children (the ranks; not the resource tracker)."""
    import os
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and "spawn_main" in cmd:
            out.append(int(d))
    return sorted(out)


def _kill_a_rank_mid_stream(srv):
    """A rank killed while a request streams: the stream ends with a one-line error naming the dead
    rank (no traceback to clients), /health says 503 with the same line, new requests get 503, and
    the server exits with status 1 (a supervisor restarts it, as vLLM's API server does)."""
    import os
    import re
    import signal
    ranks = _spawned_children(srv.proc.pid)
    assert len(ranks) == 2, ranks
    body = {"prompt": "Count:", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(ranks[-1], signal.SIGKILL)
        events = [x[6:] for x in lines if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    msg = json.loads(events[-2])["error"]["message"]
    assert re.search(r"rank \d died \(exit code -9, SIGKILL\)", msg) and "Traceback" not in msg, msg
    assert len(msg) < 600, msg
    health = httpx.get(srv.url + "/health", timeout=5)
    assert health.status_code == 503 and "Traceback" not in health.text and "died" in health.text, health.text
    assert srv.proc.wait(timeout=30) == 1
    log = srv.log()
    assert "Traceback" in log and "the server shut down" in log and "leaked" not in log, log[-2000:]


def test_a_sigint_is_remembered_even_if_its_re_raise_is_lost():
    """uvicorn re-raises a SIGINT after its graceful shutdown, but under ``asyncio.run`` the re-raise
    only cancels a serving task that may be finishing, so no ``KeyboardInterrupt`` may come out (the
    test below once saw exit 0 under load): the server remembers the signal itself."""
    import signal
    import uvicorn
    from mtpspec.entrypoints.serve import _server_class
    for sig, want in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        server = _server_class(uvicorn)(uvicorn.Config(lambda *a: None))
        server.handle_exit(sig, None)
        assert server.should_exit and server.got_sigint == want


def test_ctrl_c_shuts_the_server_down_without_a_traceback(model_dir):
    """Found by a new-user pass (2026-12-04): Ctrl-C printed uvicorn's re-raised KeyboardInterrupt and
    a page of Triton leak warnings. Now: a served request first, then SIGINT: one line, exit 130.
    A stream still open then (a later pass: uvicorn waited out its 5-s graceful timeout, cancelled it
    with a traceback and cut the stream) ends at once with a 503 "shutting down" error event."""
    import signal
    import threading
    import time
    srv = ServerProcess(model_dir, ["--adaptive-speculation"] + SERVER_ARGS)
    try:
        assert _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 4}).status_code == 200
        events, started = [], threading.Event()

        def stream():
            body = {"prompt": "Count:", "max_tokens": MAX_LEN - 16, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(60)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=60) == 130
        assert time.monotonic() - t0 < 4.5, time.monotonic() - t0  # not the 5-s graceful timeout
        t.join(10)
        assert events[-1] == "[DONE]" and "the server is shutting down" in events[-2], events[-3:]
        assert json.loads(events[-2])["error"]["code"] == 503
        log = srv.log()
        assert "interrupted; the server shut down" in log and "Traceback" not in log and "leaked" not in log, log
    finally:
        srv.stop()


def test_version_nan_logit_bias_and_a_long_prompt_off_the_event_loop(server):
    """``GET /version`` (vLLM's); a NaN logit bias is a 400 (it clamped to -100 unnoticed); a prompt of
    ``LONG_TEXT_CHARS`` or more characters (tokenized in a worker thread: the next test) is still
    checked (here: too many tokens for the context) while ``/health`` answers."""
    import threading

    import mtpspec
    from mtpspec.engine.detokenizer import LONG_TEXT_CHARS
    assert httpx.get(server.url + "/version").json() == {"version": mtpspec.__version__}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "NaN" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": '
                   b'-Infinity}}', headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # +-inf clamp to +-100, as vLLM
    health = []
    t = threading.Thread(target=lambda: health.append(httpx.get(server.url + "/health", timeout=30).status_code))
    t.start()
    r = _post(server, "/v1/completions", {"prompt": "word " * (LONG_TEXT_CHARS // 4), "max_tokens": 2})
    t.join()
    assert health == [200]
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"], r.text


def test_long_text_prompts_are_validated_in_a_worker_thread():
    import asyncio
    import threading

    from mtpspec.engine.detokenizer import LONG_TEXT_CHARS
    from mtpspec.entrypoints.openai_server import _validated

    class Engine:
        seen = []

        def validated_prompt(self, prompt, params, add_special_tokens=True):
            self.seen.append(threading.current_thread() is threading.main_thread())
            return prompt

    eng, params = Engine(), SamplingParams()
    assert asyncio.run(_validated(eng, [{"prompt": "short"}, {"prompt_token_ids": [1]}], params)) == \
        [{"prompt": "short"}, {"prompt_token_ids": [1]}]
    assert eng.seen == [True, True]
    asyncio.run(_validated(eng, [{"prompt": "x"}, {"prompt": "y" * LONG_TEXT_CHARS}], params))
    assert eng.seen[2:] == [False, False]


def test_continue_final_message_server_and_offline(server, offline):
    """vLLM's ``continue_final_message``: the last assistant message is left open and the model goes on
    with it; the server, ``/tokenize`` and ``LLM.chat`` render it alike; vLLM's errors are 400s."""
    msgs = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"},
            {"role": "assistant", "content": "Tom has 3 + 4", "name": "tutor"}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True, "temperature": 0,
            "max_tokens": 12, "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    params = SamplingParams(temperature=0, max_tokens=12)
    out = offline.chat(msgs, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("Answer: Tom has 3 + 4")
    assert r.json()["choices"][0]["token_ids"] == out.outputs[0].token_ids
    tok = _post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert tok.json()["tokens"] == out.prompt_token_ids
    bad = _post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message", bad.text
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in bad.text
    # any last message may be continued (vLLM): here the user's question, left open
    r = _post(server, "/tokenize", {"messages": msgs[:1], "add_generation_prompt": False,
                                    "continue_final_message": True})
    assert r.status_code == 200 and offline.get_tokenizer().decode(r.json()["tokens"]) == \
        "Question: " + msgs[0]["content"], r.text
    bad = _post(server, "/v1/chat/completions", {**body, "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]}]})
    assert bad.status_code == 400 and "tool_calls of type 'function'" in bad.text, bad.text
    with pytest.raises(ValueError, match="Cannot set both"):
        offline.chat(msgs, params, continue_final_message=True)


def test_llm_chat_equals_the_servers_chat_completion(server, offline):
    """``LLM.chat`` (vLLM's) renders a conversation as ``/v1/chat/completions`` does (here the plain
    template and its ``Question:`` stop): the same greedy text; text parts are joined with newlines
    (vLLM's join), null content is empty, bad messages are named."""
    msgs = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "temperature": 0, "max_tokens": 24})
    want = r.json()["choices"][0]["message"]["content"]
    assert len(want) > 10, want
    params = SamplingParams(temperature=0, max_tokens=24)
    assert offline.chat(msgs, params, use_tqdm=False)[0].outputs[0].text == want
    text = msgs[0]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": text[:9]}, {"type": "text", "text": text[9:]}]}]
    joined = [{"role": "user", "content": text[:9] + "\n" + text[9:]}]  # vLLM joins text parts with newlines
    got = offline.chat([msgs, parts, joined], params, use_tqdm=False)
    assert got[0].outputs[0].text == want and got[1].prompt == got[2].prompt and "\n" + text[9:] in got[1].prompt
    r = _post(server, "/v1/chat/completions", {"messages": parts, "temperature": 0, "max_tokens": 24})
    assert r.json()["choices"][0]["message"]["content"] == got[1].outputs[0].text
    assert offline.chat([{"role": "user"}], params, use_tqdm=False)[0].prompt == "Question: \nAnswer:"  # null content
    with pytest.raises(TypeError, match="conversation 0, message 0: expected a dict with a 'role'"):
        offline.chat([{"content": "x"}], params)
    with pytest.raises(TypeError, match=r"conversation 0, message 0: content part 1: a text part's 'text' must be a "
                                        r"string, got 5"):
        offline.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}], params)
    with pytest.raises(TypeError, match=r"content part 0: only text parts .* got 'image_url'"):
        offline.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    # vLLM's text kinds join (input_text, output_text, refusal); a part without its text is skipped
    kinds = [{"type": "input_text", "text": "a"}, {"type": "text"}, {"type": "refusal", "refusal": "b"},
             {"type": "output_text", "text": "c"}, {"type": "text", "text": None}]
    assert offline.chat([{"role": "user", "content": kinds}], params, use_tqdm=False)[0].prompt == \
        "Question: a\nb\nc\nAnswer:"
    with pytest.raises(ValueError, match="conversation 1: "):
        offline.chat([msgs, [{"role": "wizard", "content": "x"}]], params)
    # a bare string / dict is named as such (they were iterated into characters / keys)
    with pytest.raises(TypeError, match="messages must be a list of .* got str"):
        offline.chat("hello", params)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them .* got dict"):
        offline.chat(msgs, {"temperature": 0})
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them .* got dict"):
        offline.generate("hi", {"temperature": 0})
