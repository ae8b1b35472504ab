"""`mtpspec eval gsm8k`: lm-eval-identical scoring, offline and HTTP arms, and lm-eval's own client
(`local-completions`) running the repo's task config against `mtpspec serve`, offline."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_server_fixtures import GSM8K_DIR, REPO, ServerProcess, child_env, gsm8k_rows, make_served_model

from mtpspec import LLM, SamplingParams
from mtpspec.entrypoints import eval_gsm8k
from mtpspec.entrypoints.eval_gsm8k_score import (
    IGNORE_RES, STOP_SEQUENCES, exact_match, flexible_extract, mean_stderr, score_completions, strict_extract)
from mtpspec.data.gsm8k import fewshot_prompt

# lm-eval is in the `test` extra: a missing install must fail here, not skip the file.
import lm_eval.api.metrics as lm_metrics  # noqa: E402
import lm_eval.filters.extraction as lm_filters  # noqa: E402


def _lm_eval_score(completion: str, answer: str):
    strict = lm_filters.RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)", group_select=0)
    flex = lm_filters.RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
    out = []
    for f in (strict, flex):
        pred = f.apply([[completion]], None)[0][0]
        em = lm_metrics.exact_match_hf_evaluate(predictions=[pred], references=[answer], regexes_to_ignore=IGNORE_RES,
                                                ignore_case=True, ignore_punctuation=False)["exact_match"]
        out.append((pred, bool(em)))
    return out


ANSWERS = [r["answer"] for r in gsm8k_rows("test", 30)] + ["x\n#### 1,234", "y\n#### -5", "z\n#### 3.50", "w\n#### 7."]
PIECES = ["#### ", "18", "1,234", "-5", "$", ".", ",", " ", "\n", "3.50", "abc", "7", "####", "-", "The answer is "]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.sampled_from(ANSWERS))
def test_scoring_equals_lm_eval(pieces, answer):
    completion = "".join(pieces)
    (sp, sok), (fp, fok) = _lm_eval_score(completion, answer)
    assert strict_extract(completion) == sp and exact_match(sp, answer) == sok
    assert flexible_extract(completion) == fp and exact_match(fp, answer) == fok


def test_scoring_known_cases_and_stderr():
    ans = "She makes 9 * 2 = $<<9*2=18>>18.\n#### 18"
    s = score_completions([" 9 * 2 = 18\n#### 18", " so $18.", " 17\n#### 17 then 18", "nothing"], [ans] * 4)
    assert s["strict-match"]["correct"] == [True, False, False, False]
    assert s["flexible-extract"]["correct"] == [True, True, True, False]
    for xs in ([1.0, 0.0, 1.0, 1.0], [0.0] * 5 + [1.0] * 3):
        mu, se = mean_stderr(xs)
        assert mu == pytest.approx(lm_metrics.mean(xs)) and se == pytest.approx(lm_metrics.mean_stderr(xs))
    assert s["flexible-extract"]["accuracy"] == 0.75


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eval_model"))
    make_served_model(path, seed=5)
    return path


def _offline_kwargs(model_dir, fusion, local):
    return dict(model=model_dir, device="cpu", max_model_len=2048, max_num_seqs=8,
                fuse_allreduce_rmsnorm=fusion,
                speculative_config={"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": local})


def test_offline_arms_identical_and_scored(model_dir):
    data, train = os.path.join(GSM8K_DIR, "test.jsonl"), os.path.join(GSM8K_DIR, "train.jsonl")
    sources = {"baseline": _offline_kwargs(model_dir, False, False), "both": _offline_kwargs(model_dir, True, True)}
    res = eval_gsm8k.evaluate(sources, data, train, num_fewshot=1, limit=3, max_tokens=8, progress=False)
    assert res["n"] == 3
    cmp = res["comparison"]["both vs baseline"]
    assert cmp["identical"] == 3 and cmp["total"] == 3  # greedy speculative decoding is lossless across arms
    rows, shots = gsm8k_rows("test", 3), gsm8k_rows("train", 1)
    plain = LLM(model_dir, device="cpu", max_model_len=2048)  # no speculation at all: the reference
    try:
        ref = plain.generate([fewshot_prompt(shots, r["question"]) for r in rows],
                             SamplingParams(temperature=0, max_tokens=8, stop=STOP_SEQUENCES), use_tqdm=False)
    finally:
        plain.shutdown()
    for arm in sources:
        r = res["arms"][arm]
        assert r["token_ids"] == [o.outputs[0].token_ids for o in ref]
        again = score_completions(r["texts"], [row["answer"] for row in rows])
        assert r["scores"]["strict-match"]["accuracy"] == again["strict-match"]["accuracy"]
    report = eval_gsm8k.format_report(res)
    assert "both vs baseline: 3/3 (100.0%)" in report and "strict-match" in report


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(model_dir, ["-k", "3", "--max-num-seqs", "8"])
    yield srv
    srv.stop()


def test_eval_cli_over_http_equals_offline(server, model_dir, tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "eval", "gsm8k", "--base-url", f"a={server.url}",
           "--base-url", f"b={server.url}", "--limit", "4", "--num-fewshot", "1", "--max-tokens", "8",
           "--no-progress", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=180)
    assert p.returncode == 0, p.stderr
    assert "b vs a: 4/4" in p.stdout and "flexible-extract" in p.stdout
    res = json.loads(out.read_text())
    rows, shots = gsm8k_rows("test", 4), gsm8k_rows("train", 1)
    llm = LLM(**_offline_kwargs(model_dir, True, True))
    try:
        ref = llm.generate([fewshot_prompt(shots, r["question"]) for r in rows],
                           SamplingParams(temperature=0, max_tokens=8, stop=STOP_SEQUENCES), use_tqdm=False)
    finally:
        llm.shutdown()
    assert res["arms"]["a"]["token_ids"] == [o.outputs[0].token_ids for o in ref]
    assert res["arms"]["a"]["texts"] == [o.outputs[0].text for o in ref]
    # bad input: no such file
    p = subprocess.run(cmd[:5] + ["--base-url", server.url, "--data", str(tmp_path / "missing.jsonl")],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert p.returncode == 2 and "missing.jsonl" in p.stderr


def test_eval_cli_unreachable_server_is_a_clear_error(capsys):
    import argparse
    import socket
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["eval", "gsm8k", "--base-url", url, "--data", os.path.join(GSM8K_DIR, "test.jsonl"),
                         "--limit", "1", "--num-fewshot", "1", "--no-progress"])
    assert eval_gsm8k.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: talking to " + url) and "ConnectError" in err


def test_eval_cli_help_states_every_default():
    """`mtpspec eval gsm8k --help` listed --num-fewshot and --max-tokens without a word (defaults 5 and 256)."""
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["eval"]
    gsm = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["gsm8k"]
    own = {"--num-fewshot", "--limit", "--max-tokens", "--max-concurrency"}
    for a in gsm._actions:
        if own & set(a.option_strings):
            assert "default" in (a.help or ""), a.option_strings


def test_eval_cli_under_torchrun_reports_on_rank_0_only(monkeypatch, tmp_path, capsys):
    """Under `torchrun ... -m mtpspec eval gsm8k -tp 2` every rank printed the report (the followers'
    with no acceptance length: their engines do not schedule) and wrote --json to the same file."""
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    out = tmp_path / "res.json"
    args = p.parse_args(["eval", "gsm8k", "--data", os.path.join(GSM8K_DIR, "test.jsonl"), "--limit", "1",
                         "--num-fewshot", "1", "--no-progress", "--json", str(out)])
    monkeypatch.setattr(eval_gsm8k, "evaluate", lambda *a, **k: {"fake": True})
    monkeypatch.setattr(eval_gsm8k, "format_report", lambda res: "REPORT")
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        assert eval_gsm8k.run(args) == 0
        assert ("REPORT" in capsys.readouterr().out) == printed and out.exists() == printed, rank


def test_lm_eval_local_completions_against_server(server, tmp_path):
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    out = tmp_path / "lm_eval_out"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=none,tokenized_requests=False,"
           "max_gen_toks=12,num_concurrent=2",
           "--include_path", os.path.join(REPO, "lm_eval_tasks"), "--tasks", "gsm8k_local", "--limit", "3",
           "--num_fewshot", "1", "--output_path", str(out), "--log_samples"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=str(tmp_path), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads(open(glob.glob(str(out / "*" / "results_*.json"))[0]).read())["results"]["gsm8k_local"]
    samples = [json.loads(line) for f in glob.glob(str(out / "*" / "samples_gsm8k_local_*.jsonl")) for line in open(f)]
    assert len({s["doc_id"] for s in samples}) == 3
    rows = gsm8k_rows("test", 3)
    for s in samples:
        assert s["doc"]["question"] == rows[s["doc_id"]]["question"]  # read from the local JSONL
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        assert prompt.endswith("Question: " + s["doc"]["question"] + "\nAnswer:")
        # lm-eval's recorded completion is exactly what the server generates for that prompt
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": STOP_SEQUENCES}).json()
        assert s["resps"][0][0] == r["choices"][0]["text"]
        fn = strict_extract if s["filter"] == "strict-match" else flexible_extract
        pred = fn(s["resps"][0][0])
        assert s["filtered_resps"][0] == pred
        assert float(exact_match(pred, s["target"])) == s["exact_match"]
    for flt in ("strict-match", "flexible-extract"):
        mine = [float(exact_match((strict_extract if flt == "strict-match" else flexible_extract)(s["resps"][0][0]),
                                  s["target"])) for s in samples if s["filter"] == flt]
        assert results[f"exact_match,{flt}"] == pytest.approx(sum(mine) / len(mine))


def test_eval_cli_prompt_too_long_suggests_fewer_shots(capsys):
    # 5-shot prompts (about 700 tokens) into a 256-token context: the engine's error plus a hint
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["eval", "gsm8k", "--data", os.path.join(GSM8K_DIR, "test.jsonl"), "--limit", "1",
                         "--num-fewshot", "5", "--max-model-len", "256", "--no-progress", "--arms", "baseline"])
    assert eval_gsm8k.run(args) == 2
    err = capsys.readouterr().err
    assert "maximum context length is 256 tokens" in err and "try --num-fewshot 1 or fewer" in err
    # a context that holds no shot: "try --num-fewshot 0", not "0 or fewer" (a new-user pass)
    args = p.parse_args(["eval", "gsm8k", "--data", os.path.join(GSM8K_DIR, "test.jsonl"), "--limit", "1",
                         "--num-fewshot", "5", "--max-model-len", "100", "--no-progress", "--arms", "baseline"])
    assert eval_gsm8k.run(args) == 2
    err = capsys.readouterr().err
    assert err.endswith("(the 5-shot prompts are too long for this model: try --num-fewshot 0)\n"), err
    # the suggestion from the figures in the message: the prompt shared by its shots and its question
    assert eval_gsm8k.fewer_shots("This model's maximum context length is 2048 tokens. However, your request has 18542 "
                                  "input tokens", 100) == 10
    assert eval_gsm8k.fewer_shots("This model's maximum context length is 2048 tokens. However, you requested 2100 "
                                  "tokens (2090 in the messages, 10 in the completion).", 5) == 4
    assert eval_gsm8k.fewer_shots("maximum context length", 3) == 2  # no figures: one fewer


def test_negative_num_fewshot_is_named() -> None:
    with pytest.raises(ValueError, match="--num-fewshot must be >= 0, got -1"):
        eval_gsm8k.build_prompts([{"question": "q", "answer": "a"}], [], -1)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_eval_cli_max_concurrency_below_1_is_an_error_not_a_hang(capsys, value):
    """Found by a new-user pass: ``--base-url URL --max-concurrency 0`` sent nothing and waited forever
    (a semaphore of 0), -2 failed with asyncio's message naming no flag."""
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["eval", "gsm8k", "--base-url", "http://127.0.0.1:9", "--limit", "1", "--no-progress",
                         "--max-concurrency", value])
    assert eval_gsm8k.run(args) == 2
    assert f"--max-concurrency must be an int >= 1, got {value}" in capsys.readouterr().err


def test_http_eval_retries_a_full_queue(monkeypatch):
    """A server whose queue is full answers 503 ``server_overloaded`` (``--max-queue-len``); the
    evaluation backs off and retries instead of failing on the first one (a new-user pass: `eval
    --base-url` against a server with a short queue stopped at once); other errors, a 503 for a
    dead engine included, still fail at once with the server's message."""
    import mtpspec.entrypoints.bench_serve as bench_serve
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "mtpspec": {}}]})
        if request.url.path == "/v1/completions":
            calls["n"] += 1
            body = json.loads(request.content)
            if body["prompt"] == "bad":
                return httpx.Response(400, json={"error": {"message": "nope"}})
            if body["prompt"] == "dead":  # the engine died: its reason reaches the user at once
                return httpx.Response(503, json={"error": {"message": "engine died: boom", "type": "server_error"}})
            if calls["n"] % 3:
                return httpx.Response(503, json={"error": {"message": "queue full", "type": "server_overloaded"}})
            return httpx.Response(200, json={"choices": [{"text": body["prompt"] + "!", "token_ids": [1]}]})
        return httpx.Response(404)

    transport = httpx.MockTransport(handler)
    real_client, real_async = httpx.Client, httpx.AsyncClient
    monkeypatch.setattr(httpx, "Client", lambda *a, **kw: real_client(*a, transport=transport, **kw))
    monkeypatch.setattr(httpx, "AsyncClient", lambda *a, **kw: real_async(*a, transport=transport, **kw))
    monkeypatch.setattr(bench_serve, "scrape", lambda url, c: {})
    monkeypatch.setattr(bench_serve, "spec_figures", lambda a, b, k: {"acceptance_length": None,
                                                                      "acceptance_rate_per_pos": []})
    out = eval_gsm8k.generate_http("http://x", ["a", "b"], 8, concurrency=1, progress=False)
    assert out["texts"] == ["a!", "b!"] and calls["n"] == 6  # two 503s before each answer
    with pytest.raises(RuntimeError, match="HTTP 400"):
        eval_gsm8k.generate_http("http://x", ["bad"], 8, concurrency=1, progress=False)
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="HTTP 503.*engine died: boom"):
        eval_gsm8k.generate_http("http://x", ["dead"], 8, concurrency=1, progress=False)
    assert calls["n"] == 1  # not retried
    monkeypatch.setattr(eval_gsm8k, "OVERLOAD_RETRY_S", 0.0)  # no time left: the 503 is the answer
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="HTTP 503"):
        eval_gsm8k.generate_http("http://x", ["a"], 8, concurrency=1, progress=False)


def test_a_test_row_without_its_gold_is_named_and_zero_shots_read_no_train_file(tmp_path) -> None:
    """A new-user pass (2026-12-05): a ``--data`` row whose answer has no ``#### n`` line was scored 0
    silently (the same row in ``--train`` is refused); ``--num-fewshot 0`` needed a valid train file."""
    import json as _json
    data = tmp_path / "test.jsonl"
    data.write_text(_json.dumps({"question": "2 + 2?", "answer": "It is 4"}) + "\n")
    with pytest.raises(ValueError, match=r"question 1's answer has no '#### n' line"):
        eval_gsm8k.evaluate({"a": "http://127.0.0.1:9"}, str(data), str(tmp_path / "none.jsonl"), num_fewshot=0)
    data.write_text(_json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    seen = {}

    def fake_http(url, prompts, *a, **kw):
        seen["prompts"] = list(prompts)
        return {"texts": [" 2 + 2 = 4\n#### 4"], "token_ids": [[1, 2, 3]]}
    import unittest.mock
    with unittest.mock.patch.object(eval_gsm8k, "generate_http", fake_http):
        res = eval_gsm8k.evaluate({"a": "http://127.0.0.1:9"}, str(data), str(tmp_path / "none.jsonl"),
                                  num_fewshot=0, progress=False)
    assert seen["prompts"] == ["Question: 2 + 2?\nAnswer:"]
    assert res["arms"]["a"]["scores"]["strict-match"]["correct"] == [True]
    # the command line too: no train.jsonl beside the test file (a review found data_files still wanted one)
    assert eval_gsm8k.data_files(str(data), None, 0) == (str(data), "")
    with pytest.raises(FileNotFoundError, match="--train"):
        eval_gsm8k.data_files(str(data), None, 1)


def test_arms_refuse_flags_they_would_override():
    """A new-user pass (2026-12-07): ``--arms both --no-fusion`` ran fusion on and labelled it "both";
    a ``use_local_argmax_reduction`` in ``--speculative-config`` was overwritten the same way, and
    ``--arms baseline,baseline`` was merged into one arm. Each is now an error naming the flag."""
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    base = ["eval", "gsm8k", "-k", "1", "--limit", "1", "--no-progress"]
    for extra, msg in ((["--arms", "both", "--no-fusion"], "drop --no-fusion, or drop --arms"),
                       (["--arms", "fusion", "--no-local-argmax"], "drop --no-local-argmax"),
                       (["--arms", "both", "--speculative-config",
                         '{"method": "mtp", "num_speculative_tokens": 1, "use_local_argmax_reduction": true}'],
                        "drop --speculative-config's use_local_argmax_reduction"),
                       (["--arms", "baseline,baseline"], "names 'baseline' twice"),
                       (["--arms", ","], "names no arm"), (["--arms", ""], "names no arm")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            eval_gsm8k._sources(p.parse_args(base + extra))
    got = eval_gsm8k._sources(p.parse_args(base + ["--arms", "baseline,both"]))
    assert [(a["fuse_allreduce_rmsnorm"], a["speculative_config"]["use_local_argmax_reduction"])
            for a in got.values()] == [eval_gsm8k.ARM_FLAGS["baseline"], eval_gsm8k.ARM_FLAGS["both"]]


def test_base_url_naming_one_arm_twice_is_an_error():
    """Found by a new-user pass: ``--base-url a=URL1 --base-url a=URL2`` (or an unnamed URL given the
    name ``server1`` of a named one) kept the last, silently: one arm evaluated, nothing compared."""
    import argparse
    p = argparse.ArgumentParser()
    eval_gsm8k.add_parser(p.add_subparsers(dest="command"))
    for urls, name in ((["a=http://h:1", "a=http://h:2"], "a"), (["server1=http://h:1", "http://h:2"], "server1")):
        args = p.parse_args(["eval", "gsm8k", *[w for u in urls for w in ("--base-url", u)]])
        with pytest.raises(ValueError, match=re.escape(f"--base-url names the arm {name!r} twice")):
            eval_gsm8k._sources(args)
    args = p.parse_args(["eval", "gsm8k", "--base-url", "a=http://h:1", "--base-url", "http://h:2"])
    assert eval_gsm8k._sources(args) == {"a": "http://h:1", "server1": "http://h:2"}
