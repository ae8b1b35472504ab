"""`mtpspec bench serve` / `bench arms` smoke runs at tiny sizes, and their arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from test_server_fixtures import GSM8K_DIR, REPO, ServerProcess, child_env, make_served_model

from mtpspec.entrypoints import bench_arms
from mtpspec.entrypoints.bench_dataset import gsm8k_token_prompts
from mtpspec.entrypoints.bench_prefix import prefix_prompts, run_prefix_benchmark
from mtpspec.entrypoints.bench_serve import BenchConfig, run_benchmark
from mtpspec.data.gsm8k import format_query, load_gsm8k


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench_model"))
    make_served_model(path, seed=7)
    return path


@pytest.fixture(scope="module")
def forced_server(model_dir):
    srv = ServerProcess(model_dir, ["-k", "3", "--max-model-len", "512", "--forced-acceptance", "length:2"])
    yield srv
    srv.stop()


def test_token_prompts_exact_length_and_real_text(forced_server):
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))[:40]

    def tok(text):
        return httpx.post(forced_server.url + "/tokenize", json={"prompt": text}).json()["tokens"]

    prompts = gsm8k_token_prompts(rows, 5, 900, tok)  # this tiny BPE needs ~1 token per character
    assert all(len(p) == 900 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 5
    for i, p in enumerate(prompts):  # every prompt ends with its own query
        q = tok(format_query(rows[i]["question"]))
        assert p[-len(q):] == q
    text = httpx.post(forced_server.url + "/detokenize", json={"tokens": prompts[0]}).json()["prompt"]
    assert "Question: " in text and "#### " in text and text.endswith("Answer:")


def test_bench_serve_forced_acceptance_figures(forced_server):
    cfg = BenchConfig(num_prompts=6, max_concurrency=3, input_len=64, output_len=24, warmup=1)
    res = run_benchmark(forced_server.url, cfg, progress=False)
    assert res["completed"] == 6 and res["failed"] == 0
    # forced accepted length 2 of k = 3: every verification accepts exactly positions 0 and 1
    assert res["acceptance_length"] == pytest.approx(3.0)
    assert res["acceptance_rate_per_pos"] == pytest.approx([1.0, 1.0, 0.0])
    assert res["synthetic"] and any("forced acceptance length:2" in r for r in res["synthetic_reasons"])
    assert res["steps_per_s"] == pytest.approx(res["output_throughput"] / 3.0)
    # client token counts agree with the server's counter; lengths with the workload
    assert res["total_output_tokens"] == res["server_generation_tokens"]
    assert res["total_input_tokens"] == 6 * 64
    assert res["total_output_tokens"] <= 6 * 24
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        assert res[key]["median"] is not None and res[key]["median"] <= res[key]["p99"]
    assert res["config"]["prompts"] == "gsm8k"
    # every run starts with an empty prefix cache: the same prompts again find nothing cached
    again = run_benchmark(forced_server.url, cfg, progress=False)
    assert res["prefix_cache_hit_rate"] is not None
    assert again["prefix_cache_hit_rate"] == res["prefix_cache_hit_rate"] < 0.5


def test_bench_serve_cli_random_prompts_marked_synthetic(forced_server, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "serve", "--base-url", forced_server.url,
           "--num-prompts", "3", "--max-concurrency", "2", "--input-len", "16", "--output-len", "8",
           "--random-prompts", "--ignore-eos", "--no-progress", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "SYNTHETIC" in p.stdout and "random-token prompts" in p.stdout and "ignore_eos" in p.stdout
    res = json.loads(out.read_text())
    assert res["synthetic"] and res["total_output_tokens"] == 3 * 8  # ignore_eos: every request runs to the end
    # a workload that cannot fit the context is refused before any request
    bad = cmd[:-2] + ["--input-len", "600"]
    p = subprocess.run(bad, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert p.returncode == 2 and "max_model_len" in p.stderr


def test_bench_serve_at_a_request_rate_against_a_server(forced_server):
    """The open loop end to end: 4 arrivals at 8 req/s (the last at 0.5 s), at most 2 in flight."""
    cfg = BenchConfig(num_prompts=4, max_concurrency=2, input_len=16, output_len=4, prompts="random", warmup=0,
                      request_rate=8.0, burstiness=2.0)
    res = run_benchmark(forced_server.url, cfg, progress=False)
    assert res["completed"] == 4 and res["duration_s"] >= 4 / 8.0
    assert res["config"]["request_rate"] == 8.0 and res["request_throughput"] == pytest.approx(4 / res["duration_s"])


def test_bench_serve_natural_prompts_longer_than_the_context_say_to_pass_input_len(forced_server):
    """Natural GSM8K 5-shot prompts (this tiny BPE: thousands of tokens) against a 512-token server:
    every request fails, and the error says how to run the benchmark (``--input-len``)."""
    cfg = BenchConfig(num_prompts=2, max_concurrency=2, output_len=8, warmup=0)
    with pytest.raises(ValueError, match=r"no request succeeded; first error: .*max_model_len.*the natural GSM8K "
                                         r"5-shot prompts do not fit the server's max_model_len 512: pass --input-len"):
        run_benchmark(forced_server.url, cfg, progress=False)


def _short_rows(path, n: int = 30) -> str:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"Tom has {i} apples and buys 2 more. How many apples does he have?",
                                "answer": f"Tom has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"}) + "\n")
    return str(path)


def test_prefix_prompts_share_the_examples_and_differ_in_the_question():
    rows = load_gsm8k(os.path.join(GSM8K_DIR, "test.jsonl"))[:40]
    prompts, prefix = prefix_prompts(rows, 7, num_shots=3, seed=2)
    assert len(set(prompts)) == 7 and all(p.startswith(prefix) for p in prompts)
    assert prefix.count("#### ") == 3 and prefix.endswith("\n\n")
    assert all(p[len(prefix):].startswith("Question: ") and p.endswith("Answer:") for p in prompts)
    assert prefix_prompts(rows, 7, num_shots=3, seed=3)[1] != prefix
    with pytest.raises(ValueError, match="at least 45 GSM8K rows"):
        prefix_prompts(rows, 40, num_shots=5)


def test_bench_serve_shared_prefix_ttft_hits_and_misses(forced_server, tmp_path):
    """``bench serve --shared-prefix``: after each cache reset a miss computes the whole prompt and
    the next question finds the 3-shot prefix cached (server counters per request)."""
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "serve", "--base-url", forced_server.url,
           "--shared-prefix", "--num-shots", "3", "--num-prompts", "3", "--dataset", _short_rows(tmp_path / "rows.jsonl"), "--json",
           str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "TTFT hit / miss (medians)" in p.stdout and "WARNING" not in p.stdout
    res = json.loads(out.read_text())
    assert res["config"]["num_shots"] == 3 and res["config"]["output_len"] == 8
    assert [r["cached_tokens"] for r in res["requests"]["miss"]] == [0, 0, 0]
    block = 16
    for r in res["requests"]["hit"]:  # the prefix's full blocks (the question starts a block of its own)
        assert res["shared_prefix_tokens"] - block < r["cached_tokens"] <= res["shared_prefix_tokens"] + block
        assert r["cached_tokens"] % block in (0, block - 1) and r["cached_tokens"] < r["prompt_tokens"]
    assert res["ttft_hit_over_miss"] is not None and res["hit"]["ttft_ms"]["median"] > 0
    for r in res["requests"]["hit"] + res["requests"]["miss"]:  # server-side figures per request
        assert 0 < r["server_queue"] + r["server_prefill"] <= r["server_ttft"] + 1e-6 and r["engine_steps"] >= 1
        assert r["server_ttft"] <= r["ttft_s"] + 1e-3
    assert "server side medians" in p.stdout
    # natural GSM8K 5-shot prompts do not fit a 512-token context: the error says what to lower
    cfg = BenchConfig(num_prompts=1, output_len=8, warmup=0)
    with pytest.raises(ValueError, match="lower --num-shots"):
        run_prefix_benchmark(forced_server.url, cfg)


def test_verdict_rule():
    a = {"median": 100.0, "spread": 4.0}
    assert not bench_arms.verdict(a, {"median": 103.0, "spread": 2.0}, True, 3)["significant"]
    v = bench_arms.verdict(a, {"median": 106.0, "spread": 2.0}, True, 3)
    assert v["significant"] and "better" in v["text"] and v["delta_pct"] == pytest.approx(6.0)
    v = bench_arms.verdict(a, {"median": 90.0, "spread": 5.0}, True, 3)
    assert v["significant"] and "worse" in v["text"]
    v = bench_arms.verdict(a, {"median": 90.0, "spread": 5.0}, False, 3)  # lower latency is better
    assert "better" in v["text"]
    assert not bench_arms.verdict(a, {"median": 200.0, "spread": 0.0}, True, 1)["significant"]  # one run: no verdict
    s = bench_arms.summarise([{"output_throughput": x, "steps_per_s": x / 2, "ttft_ms": {"median": 1.0},
                               "itl_ms": {"median": 2.0}, "acceptance_length": 2.0,
                               "collective_bytes_per_step_total": 0.0, "acceptance_rate_per_pos": [0.5, 0.25]}
                              for x in (10.0, 14.0, 11.0)])
    assert s["output_throughput"]["median"] == 11.0 and s["output_throughput"]["spread"] == 4.0
    assert s["acceptance_rate_per_pos"]["median"] == [0.5, 0.25]
    assert bench_arms.scaled_preset("c64", 0.01) == dict(input_len=10, output_len=10, num_prompts=3, max_concurrency=3)
    assert bench_arms.scaled_preset("batch1", 1.0)["input_len"] == 8192
    with pytest.raises(ValueError, match="unknown arm"):
        bench_arms.parse_arms("baseline,turbo", [])
    assert bench_arms.parse_arms("baseline", ["k1=-k 1"]) == {"baseline": ["--no-fusion", "--no-local-argmax"],
                                                              "k1": ["-k", "1"]}


def test_bench_arms_smoke(model_dir, tmp_path):
    out = tmp_path / "arms"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "arms", "--model", model_dir,
           "--arms", "baseline,both", "--scale", "0.01", "--repeats", "2", "--warmup", "0", "--output-dir", str(out),
           "--no-progress",
           "--server-args", "--device cpu --torch-threads 1 --max-model-len 256"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "workload batch1" in p.stdout and "workload c64" in p.stdout and "both vs baseline" in p.stdout
    assert "SYNTHETIC" not in p.stdout
    res = json.loads((out / "bench_arms.json").read_text())
    assert list(res["arms"]) == ["baseline", "both"]
    for name, wl in res["workloads"].items():
        runs = sorted(((r["started_at"], arm) for arm, d in wl["arms"].items() for r in d["runs"]))
        assert [arm for _, arm in runs] == ["baseline", "both", "both", "baseline"]  # interleaved, rotated: A B, B A
        for arm, d in wl["arms"].items():
            srv = d["runs"][0]["server"]
            fusion, local = {"baseline": (False, False), "fusion": (True, False), "both": (True, True)}[arm]
            assert (srv["fusion"], srv["local_argmax"]) == (fusion, local)  # each arm ran its own server flags
            vals = d["summary"]["output_throughput"]["runs"]
            assert len(vals) == 2 and d["summary"]["output_throughput"]["spread"] == pytest.approx(max(vals) - min(vals))
            assert all(r["completed"] == wl["config"]["num_prompts"] for r in d["runs"])
        assert set(wl["verdicts"]) == {"both vs baseline"}
        assert set(wl["verdicts"]["both vs baseline"]) == set(bench_arms.FIGURES)
    for png in ("batch1_runs.png", "batch1_acceptance.png", "c64_runs.png", "c64_acceptance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_arms_one_at_a_time_plain_vs_adaptive(model_dir, tmp_path):
    """``--one-arm-at-a-time``: arm after arm (each server stopped before the next starts; runs not
    interleaved), here the speculation-length arms ``plain`` and ``adaptive`` on workload ``s8``."""
    out = tmp_path / "arms1"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "arms", "--model", model_dir,
           "--arms", "plain,adaptive", "--workloads", "s8", "--scale", "0.05", "--repeats", "2", "--warmup", "0",
           "--output-dir", str(out), "--no-progress", "--no-plots", "--one-arm-at-a-time",
           "--server-args", "--device cpu --torch-threads 1 --max-model-len 256 --max-num-seqs 4"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_arms.json").read_text())
    assert res["interleaved"] is False and list(res["arms"]) == ["plain", "adaptive"]
    assert not (out / "bench_arms.partial.json").exists()  # a finished sweep leaves only bench_arms.json
    wl = res["workloads"]["s8"]
    runs = sorted(((r["started_at"], arm) for arm, d in wl["arms"].items() for r in d["runs"]))
    assert [arm for _, arm in runs] == ["plain", "plain", "adaptive", "adaptive"]  # one server, then the other
    srv = {arm: d["runs"][0]["server"] for arm, d in wl["arms"].items()}
    assert srv["plain"]["num_speculative_tokens"] == 0 and srv["adaptive"]["adaptive"] is True
    hist = wl["arms"]["adaptive"]["runs"][0]["num_speculative_tokens_histogram"]
    assert len(hist) == 4 and sum(hist) > 0  # the steps per chosen k reached the client


@pytest.mark.parametrize("mode", ["one-at-a-time", "gpu-shares"])
def test_bench_arms_in_process_shares_weights_only_among_coexisting_block_sized_arms(model_dir, tmp_path, mode):
    """In-process arms hold the model's weights once only where they coexist and ``--equal-kv-blocks``
    sizes their KV caches (``shared_weights`` in the JSON): one arm at a time would keep an arm's
    weights after its shutdown, and a share of the GPU each assumes each arm holds its own."""
    out = tmp_path / "arms_share"
    extra = ["--one-arm-at-a-time", "--equal-kv-blocks"] if mode == "one-at-a-time" else []
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "arms", "--model", model_dir, "--in-process",
           "--arms", "plain,k1", "--workloads", "s8", "--scale", "0.05", "--repeats", "1", "--warmup", "0",
           "--output-dir", str(out), "--no-progress", "--no-plots", *extra,
           "--server-args", "--device cpu --torch-threads 1 --max-model-len 256 --max-num-seqs 4"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_arms.json").read_text())
    assert res["in_process"] is True and res["shared_weights"] is False


def test_bench_arms_in_process_repeats_the_same_steps(model_dir, tmp_path):
    """``--in-process``: each arm an ``LLM`` here, each run one ``generate`` with every request queued
    before the first step and the workload's concurrency as the running cap: under forced acceptance
    (re-armed each run) every round of a fixed-k arm runs the same engine steps and accepts the
    same tokens (the HTTP client's trickling arrival made rounds differ 4x in steps on an H200)."""
    out = tmp_path / "arms_ip"
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "arms", "--model", model_dir, "--in-process",
           "--arms", "k1,adaptive", "--workloads", "s8", "--scale", "0.2", "--repeats", "2", "--warmup", "2",
           "--warmup-rounds", "1", "--equal-kv-blocks", "--output-dir", str(out), "--no-progress", "--no-plots",
           "--random-prompts",
           "--ignore-eos", "--forced-acceptance", "rate:0.7",
           "--server-args", "--device cpu --torch-threads 1 --max-model-len 256 --max-num-seqs 4"]
    prof = tmp_path / "prof"  # each run also profiled (the warm-up round's first), then two runs diffed
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(child_env(), MTPSPEC_BENCH_PROFILE_DIR=str(prof),
                                                                      MTPSPEC_ADAPTIVE_TRACE="1"), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "adaptive / best other arm (k1)" in p.stdout and "SYNTHETIC" in p.stdout
    assert sorted(os.listdir(prof)) == sorted(f"s8_{arm}_{n}.{ext}" for arm in ("k1", "adaptive") for n in range(3)
                                              for ext in ("pstats", "gc.json"))
    d = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "diff_profiles.py"),
                        str(prof / "s8_k1_1.pstats"), str(prof / "s8_adaptive_1.pstats"), "--per", "10", "--top", "5"],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert d.returncode == 0, d.stderr[-3000:]
    lines = d.stdout.splitlines()  # totals, a gc line per side, column names, the 5 largest differences
    assert len(lines) == 9 and lines[0].startswith("profiled own time:") and lines[1].startswith("gc (a): gen 0:") \
        and lines[2].startswith("gc (b): gen 0:") and lines[3].split()[:3] == ["b", "-", "a"], d.stdout
    assert "run 1's steps by kind (steps x mean wall [mean batch, prompt tokens, catch-up rows]): decode k1 " in p.stdout
    res = json.loads((out / "bench_arms.json").read_text())
    assert res["in_process"] is True and res["warmup_rounds"] == 1
    assert res["shared_weights"] is True  # coexisting arms, KV caches sized in blocks: the weights held once
    kv = res["equal_kv_blocks"]  # the same KV tokens for both arms (equal_kv_blocks; one block size here)
    assert set(kv) == {"k1", "adaptive"} and kv["k1"] == kv["adaptive"] > 0
    wl = res["workloads"]["s8"]
    for arm, d in wl["arms"].items():
        r0, r1 = d["runs"]
        assert r0["in_process"] and r0["completed"] == wl["config"]["num_prompts"] == 3
        assert r0["total_output_tokens"] == 3 * wl["config"]["output_len"]
        assert r0["acceptance_length"] > 1.0 and r0["engine_steps"] > 0
        assert "cuda_graph_capture_failed" in r0 and r0["cuda_graph_capture_failed"] is None  # CPU: no capture
        if arm == "k1":  # a fixed k: the same step sequence each round (adaptive's choices follow step times)
            assert r0["engine_steps"] == r1["engine_steps"], arm
            assert r0["num_accepted_tokens"] == r1["num_accepted_tokens"]
    assert len(wl["arms"]["adaptive"]["runs"][0]["num_speculative_tokens_histogram"]) == 4
    host = wl["arms"]["adaptive"]["runs"][0]["adaptive_host_model"]  # the policy's fitted host time, ms
    assert set(host) == {"per_step_ms", "per_seq_ms", "per_token_ms", "per_prompt_token_ms",
                         "per_prompt_token_ms_drafting", "measured_ms", "measured_batch", "catch_up_us_per_row",
                         "catch_up_rows_timed", "transition_steps", "transition_extra_ms", "cost_table", "rates",
                         "rechecks"}
    rechecks = host.pop("rechecks")  # re-checks done, per "batch B k K" / "prompt k0" / "prompt drafting"
    assert isinstance(rechecks, dict) and all(isinstance(n, int) and n > 0 for n in rechecks.values())
    table, rates = host.pop("cost_table"), host.pop("rates")  # what the choices rest on: device table, rates
    assert set(table) == {"verify_ms", "draft_ms"} and set(table["verify_ms"]) == {"0", "1", "2", "3"}  # JSON keys
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)  # one per draft position
    measured = host.pop("measured_ms")  # what the policy measured beyond its device table, per batch size and k
    assert measured and all(key.startswith("batch ") and " k " in key for key in measured)
    assert isinstance(host["transition_steps"], int) and isinstance(host.pop("transition_extra_ms"), float)
    batches = host.pop("measured_batch")  # and the mean batch size of the steps behind each
    assert set(batches) == set(measured) and all(1 <= v <= int(key.split()[1]) for key, v in batches.items())
    assert all(v >= 0.0 for v in host.values()) and wl["arms"]["k1"]["runs"][0]["adaptive_host_model"] is None
    for run in wl["arms"]["adaptive"]["runs"]:  # MTPSPEC_ADAPTIVE_TRACE: the policy's records, this run's alone
        trace, start = run["adaptive_trace"], run["adaptive_trace_timed_from"]
        kinds = {r["kind"] for r in trace[start:]}
        assert 0 <= start < len(trace) and "prompt choice" in kinds and kinds <= {"sample", "choice", "prompt choice"}
        assert all(r["k"] in range(4) for r in trace)
    assert "adaptive_trace" not in wl["arms"]["k1"]["runs"][0]
    assert "adaptive_vs_best" in wl and 0.0 < wl["arms"]["k1"]["runs"][0]["host_cpu_s"]
    for arm, d in wl["arms"].items():  # where each run's wall time went: every step counted, no more than the run
        r0 = d["runs"][0]
        walls = r0["step_wall"]
        assert sum(w["steps"] for w in walls.values()) == r0["engine_steps"], (arm, walls)
        assert 0.5 * r0["duration_s"] < sum(w["total_s"] for w in walls.values()) <= r0["duration_s"] + 1e-6, arm
        assert any(kind.startswith("prompt ") for kind in walls) and any(kind.startswith("decode ") for kind in walls)
        for kind, w in walls.items():  # per step: batch, prompt tokens only in prompt steps, drafts verified
            assert 1 <= w["mean_batch"] <= 4 and (w["mean_prompt_tokens"] > 0) == kind.startswith("prompt "), kind
            assert 0 <= w["mean_verify_k"] <= 3 and (w["catch_up_rows"] > 0) == kind.endswith(" +catch-up"), kind
    assert set(wl["arms"]["k1"]["runs"][0]["step_wall"]) <= {"prompt k1", "decode k1"}
    assert wl["arms"]["k1"]["runs"][0]["step_wall"]["decode k1"]["mean_verify_k"] == 1.0
    # adaptive: the entries its k = 0 steps deferred are caught up by drafting steps, counted under their own kinds
    a0 = wl["arms"]["adaptive"]["runs"][0]
    assert sum(w["catch_up_rows"] for w in a0["step_wall"].values()) == a0["mtp_catch_up_tokens"]
    bad = subprocess.run(cmd[:-2] + ["--base-url", "k1=http://127.0.0.1:1", "--server-args", cmd[-1]],
                         capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "exclude each other" in bad.stderr


@pytest.mark.parametrize("bad", ["missing", "malformed"])
def test_bench_arms_checks_its_dataset_before_starting_servers(tmp_path, bad):
    out = tmp_path / "arms"
    data = tmp_path / "gsm.jsonl"
    if bad == "malformed":
        data.write_text('{"question": "x?"}\n')
    cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "bench", "arms", "--dataset", str(data),
           "--output-dir", str(out), "--no-progress", "--no-plots", "--server-args", "--device cpu"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert p.returncode == 2, p.stderr
    if bad == "missing":
        assert p.stderr == (f"error: --dataset: no file or folder at {str(data)!r} "
                            "(expected a GSM8K JSONL file, or a folder holding test.jsonl)\n")
    else:
        assert p.stderr == f"error: {data}:1: expected keys 'question' and 'answer', got ['question']\n"
    assert not out.exists()  # no server was started: its log would be there
    assert time.monotonic() - t0 < 60  # an interpreter start, not a server start


def test_bench_serve_unreachable_server_names_the_url(capsys):
    from test_server_fixtures import free_port
    from mtpspec.entrypoints.cli import main
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and url in err, err


def test_bench_arms_keeps_the_runs_made_before_a_failure(tmp_path, monkeypatch):
    """A sweep killed or failing mid-way leaves ``bench_arms.partial.json`` with the runs made so far;
    a finished sweep leaves only ``bench_arms.json``."""
    from mtpspec.entrypoints.bench_serve import BenchConfig
    calls = []

    def fake_run(url, cfg, progress=True, desc=""):
        calls.append(desc)
        if len(calls) == 3:
            raise RuntimeError("server went away")
        return {"desc": desc, "synthetic_reasons": []}

    monkeypatch.setattr(bench_arms, "run_benchmark", fake_run)
    wl = {"s1": BenchConfig(num_prompts=1, max_concurrency=1, input_len=8, output_len=4, prompts="random")}
    urls = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}
    (tmp_path / "bench_arms.partial.json").write_text('{"runs": "of an earlier sweep"}')
    with pytest.raises(RuntimeError, match="went away"):
        bench_arms.run_arms({"a": [], "b": []}, wl, 2, str(tmp_path), [], urls=urls, progress=False, plots=False)
    part = json.loads((tmp_path / "bench_arms.partial.json").read_text())
    assert [r["desc"] for r in part["runs"]["s1"]["a"]] == ["s1 a #1"]
    assert [r["desc"] for r in part["runs"]["s1"]["b"]] == ["s1 b #1"]
    assert part["partial"] is True and part["repeats"] == 2 and part["workload_configs"]["s1"]["input_len"] == 8
    assert part["synthetic"] is False
    assert not (tmp_path / "bench_arms.json").exists() and not (tmp_path / "bench_arms.partial.json.tmp").exists()

    calls.clear()  # a sweep that fails before its first run leaves no earlier sweep's runs behind
    monkeypatch.setattr(bench_arms, "run_benchmark", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("down")))
    with pytest.raises(RuntimeError, match="down"):
        bench_arms.run_arms({"a": []}, wl, 1, str(tmp_path), [], urls=urls, progress=False, plots=False)
    assert not (tmp_path / "bench_arms.partial.json").exists()


def test_bench_arms_warmup_rounds_interleave_untimed_and_adaptive_vs_best(tmp_path, monkeypatch):
    """``warmup_rounds``: that many untimed runs of each workload on every arm, interleaved, before
    the timed rounds (not in the results); the adaptive arm's median output tok/s over the best
    other arm's, and the same per round, go to the JSON and the table."""
    from mtpspec.entrypoints.bench_serve import BenchConfig
    calls = []
    tput = {("a", 0): 100.0, ("a", 1): 120.0, ("adaptive", 0): 110.0, ("adaptive", 1): 114.0}

    def fake_run(url, cfg, progress=True, desc=""):
        calls.append(desc)
        arm, rep = desc.split()[1], int(desc.split("#")[1]) - 1
        return {"desc": desc, "synthetic_reasons": [], "output_throughput": tput.get((arm, rep), 1.0),
                "steps_per_s": 1.0, "ttft_ms": {"median": 1.0}, "itl_ms": {"median": 1.0}, "acceptance_length": None,
                "collective_bytes_per_step_total": 0, "acceptance_rate_per_pos": []}

    monkeypatch.setattr(bench_arms, "run_benchmark", fake_run)
    wl = {"s1": BenchConfig(num_prompts=1, max_concurrency=1, input_len=8, output_len=4, prompts="random")}
    urls = {"a": "http://127.0.0.1:1", "adaptive": "http://127.0.0.1:2"}
    with pytest.raises(ValueError, match="warmup_rounds"):
        bench_arms.run_arms({"a": []}, wl, 1, str(tmp_path), [], urls=urls, progress=False, plots=False,
                            warmup_rounds=-1)
    res = bench_arms.run_arms({"a": [], "adaptive": []}, wl, 2, str(tmp_path), [], urls=urls, progress=False,
                              plots=False, warmup_rounds=1)
    assert calls == ["s1 a warm-up #1", "s1 adaptive warm-up #1", "s1 a #1", "s1 adaptive #1", "s1 adaptive #2",
                     "s1 a #2"]  # round 2 rotated
    assert bench_arms.round_order([], 3) == [] and bench_arms.round_order(["a"], 5) == ["a"]
    assert res["warmup_rounds"] == 1 and len(res["workloads"]["s1"]["arms"]["a"]["runs"]) == 2
    vs = res["workloads"]["s1"]["adaptive_vs_best"]
    assert vs["best"] == "a" and vs["ratio"] == pytest.approx(112.0 / 110.0)  # medians of two runs: means
    assert vs["per_round"] == pytest.approx([1.1, 0.95]) and vs["per_round_median"] == pytest.approx(1.025)
    assert "adaptive / best other arm (a), output tok/s medians: 1.018; per interleaved round: [1.100, 0.950], " \
        "their median 1.025" in bench_arms.format_workload("s1", res["workloads"]["s1"])
    assert bench_arms.versus_best({"arms": {"a": res["workloads"]["s1"]["arms"]["a"]}}) is None  # no adaptive arm
    arms_out = res["workloads"]["s1"]["arms"]
    probes = [p for a in ("a", "adaptive") for r in arms_out[a]["runs"] for p in r["host_probe_ms"]]
    assert len(probes) == 8 and all(p > 0 for p in probes)  # before and after each of the 4 timed runs
    hp = res["workloads"]["s1"]["host_probe"]
    assert hp["min_ms"] == min(probes) and hp["spread"] == pytest.approx(max(probes) / min(probes))
    assert "host probe (a fixed Python loop" in bench_arms.format_workload("s1", res["workloads"]["s1"])


def test_bench_arms_warns_when_the_host_speed_moves() -> None:
    """A workload whose host probes moved by more than HOST_SPREAD_WARN gets a warning that arm
    differences smaller than the spread are not readable; a steady host gets none; runs without
    probes (older JSON) get no line."""
    def wl(probes):
        runs = [{"output_throughput": 100.0, "steps_per_s": 1.0, "ttft_ms": {"median": 1.0}, "itl_ms": {"median": 1.0},
                 "acceptance_length": None, "collective_bytes_per_step_total": 0, "acceptance_rate_per_pos": [],
                 **({"host_probe_ms": p} if p else {})} for p in probes]
        return {"synthetic": False, "synthetic_reasons": [], "repeats": len(runs),
                "config": {"input_len": 8, "output_len": 4, "num_prompts": 1, "max_concurrency": 1},
                "arms": {"a": {"runs": runs, "summary": bench_arms.summarise(runs)}}, "verdicts": {}}
    assert "WARNING: the host's speed moved" in bench_arms.format_workload("s", wl([[10.0, 10.5], [17.0, 10.2]]))
    steady = bench_arms.format_workload("s", wl([[10.0, 10.5], [10.3, 10.2]]))
    assert "spread 1.05x" in steady and "WARNING" not in steady
    assert "host probe" not in bench_arms.format_workload("s", wl([None, None]))
    assert bench_arms.host_spread(wl([None])) is None
    assert 0 < bench_arms.host_probe_ms(iters=1000, repeats=2) < 1000
    zero = {"summary": {"output_throughput": {"median": 0.0}}, "runs": [{"output_throughput": 0.0}]}
    assert bench_arms.versus_best({"arms": {"a": zero, "adaptive": zero}}) is None  # nothing to divide by


def test_warmup_waves_run_at_the_workloads_concurrency_with_short_outputs(forced_server, monkeypatch):
    """``warmup`` requests go at most ``max_concurrency`` at a time with ``warmup_output_len``
    tokens each; bench arms' default warm-up is one full wave at the workload's concurrency (the
    first server to see a batch shape must not pay its kernel compilation inside the timed run)."""
    import argparse

    from mtpspec.entrypoints import bench_serve
    seen = []
    real = bench_serve._run_load

    async def spy(base_url, model, prompts, cfg, progress, desc):
        seen.append((desc, len(prompts), cfg.max_concurrency, cfg.output_len))
        return await real(base_url, model, prompts, cfg, progress, desc)

    monkeypatch.setattr(bench_serve, "_run_load", spy)
    cfg = BenchConfig(num_prompts=4, max_concurrency=3, input_len=16, output_len=12, warmup=3, warmup_output_len=2)
    res = run_benchmark(forced_server.url, cfg, progress=False)
    assert seen[0] == ("warmup", 3, 3, 2) and seen[1][1:] == (4, 3, 12)
    assert res["total_output_tokens"] == res["server_generation_tokens"]  # the warm-up is not counted
    with pytest.raises(ValueError, match="warmup_output_len"):
        BenchConfig(warmup_output_len=0)

    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    p.add_argument("--scale", type=float, default=1.0)
    for argv, want in (([], (128, 16)), (["--warmup", "2"], (2, None)), (["--scale", "0.05"], (6, 13))):
        c = bench_arms.workload_config("s64", p.parse_args(argv))
        assert (c.warmup, c.warmup_output_len) == want
    args = p.parse_args([])
    assert bench_serve.config_from_args(args, {"num_prompts": 8, "max_concurrency": 2, "output_len": 5}).warmup == 1
    # request i's own seed is seed + i, none with --no-request-seeds (adaptive arms' sampled drafts)
    three = {"num_prompts": 8, "max_concurrency": 2, "output_len": 5}
    assert bench_serve.config_from_args(p.parse_args(["--seed", "4"]), three).request_seed(3) == 7
    assert bench_serve.config_from_args(p.parse_args(["--no-request-seeds"]), three).request_seed(3) is None


def test_parse_metrics_keys_leave_out_the_model_name_label():
    """Every /metrics sample carries vLLM's ``model_name`` label; the benches' keys stay as they were."""
    from mtpspec.engine.async_llm import EngineStats
    from mtpspec.entrypoints.bench_serve import parse_metrics
    from mtpspec.entrypoints.server_metrics import ServerMetrics
    text = ServerMetrics(2, {"model": "x"}, model_name="alpha").render(EngineStats(num_total_blocks=7)).decode()
    assert 'model_name="alpha"' in text
    keys = parse_metrics(text)
    assert keys["mtpspec:kv_cache_total_blocks"] == 7.0
    assert "mtpspec:spec_decode_num_accepted_tokens_per_pos_total{position=1}" in keys
    assert not any("model_name" in key for key in keys)


def test_server_root_json_path_and_a_url_that_is_not_a_server_root(tmp_path, capsys, monkeypatch):
    """An OpenAI client's base URL (``.../v1``) names the same server (a new-user pass got
    ``KeyError: 'data'`` from it); ``/v1/models`` without a model list is a clear error; a
    ``--json`` path that cannot be written fails before the run, not after it."""
    import argparse

    import httpx

    from mtpspec.entrypoints import bench_serve
    from mtpspec.entrypoints.bench_serve import ServerInfo, output_path_problem, server_root
    assert server_root("http://h:1/v1/") == server_root("http://h:1/v1") == server_root("http://h:1/") == "http://h:1"
    assert server_root("http://h:1/api/v1x") == "http://h:1/api/v1x"
    page = httpx.MockTransport(lambda req: httpx.Response(404, json={"detail": "Not Found"}))
    with httpx.Client(transport=page) as c, pytest.raises(ValueError, match="answered HTTP 404 without a model list"):
        ServerInfo("http://h:1/v1", c)
    # a server started with --api-key: the key, not the URL, is what is wrong
    locked = httpx.MockTransport(lambda req: httpx.Response(401, json={"error": "Unauthorized"}))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with httpx.Client(transport=locked) as c, pytest.raises(ValueError, match="HTTP 401: the server wants an API key "
                                                            r"\(its --api-key\) and this client sent no key"):
        ServerInfo("http://h:1", c)
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with httpx.Client(transport=locked) as c, pytest.raises(ValueError, match=r"sent the key in \$OPENAI_API_KEY"):
        ServerInfo("http://h:1", c)
    assert output_path_problem(None) is None and output_path_problem(str(tmp_path / "r.json")) is None
    assert "no folder" in output_path_problem(str(tmp_path / "missing" / "r.json"))
    assert "is a folder" in output_path_problem(str(tmp_path))
    assert output_path_problem("/dev/stdout") is None  # an existing writable file: its own permission counts
    p = argparse.ArgumentParser()
    bench_serve.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["serve", "--base-url", "http://127.0.0.1:9", "--json", str(tmp_path / "no" / "x.json")])
    assert bench_serve.run(args) == 2
    assert "error: --json: no folder" in capsys.readouterr().err


def test_bench_arms_names_where_a_bad_server_flag_came_from(capsys, tmp_path):
    """``--server-args`` and an ``--arm`` definition are both `mtpspec serve` flags: an error says which."""
    from mtpspec.entrypoints.cli import main
    assert main(["bench", "arms", "--server-args", "--device cpu --bogus-flag", "--no-progress"]) == 2
    assert capsys.readouterr().err == "error: --server-args / --model: unrecognized arguments: --bogus-flag\n"
    assert main(["bench", "arms", "--arms", "x", "--arm", "x=--nope", "--no-progress"]) == 2
    assert capsys.readouterr().err == "error: arm 'x' (--nope): unrecognized arguments: --nope\n"
    # --server-args valid only together with an arm's flags (a reserve needs the adaptive arm) pass the check
    from mtpspec.entrypoints.serve import check_serve_args
    common = ["--device", "cpu", "--speculative-config", '{"adaptive_prompt_reserve": 0.5}']
    with pytest.raises(ValueError):
        check_serve_args(common)
    check_serve_args(common + bench_arms.parse_arms("adaptive", [])["adaptive"])
    # an --base-url nobody answers at: one error line (it was httpx's traceback)
    from test_server_fixtures import free_port
    assert main(["bench", "arms", "--arms", "adaptive", "--base-url", f"adaptive=http://127.0.0.1:{free_port()}",
                 "--server-args", "--device cpu", "--workloads", "s1", "--scale", "0.01", "--no-progress",
                 "--no-plots", "--output-dir", str(tmp_path / "arms")]) == 2
    assert capsys.readouterr().err.startswith("error: talking to a server: ConnectError")


def test_bench_serve_shared_prefix_refuses_a_concurrency(capsys):
    """``--shared-prefix`` sends one request at a time; a ``--max-concurrency`` above 1 was silently
    ignored (a review, 2026-12-07): now an error before any request."""
    from mtpspec.entrypoints.cli import main
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--shared-prefix", "--max-concurrency", "4",
                 "--no-progress"]) == 2
    assert "--shared-prefix sends one request at a time" in capsys.readouterr().err


def test_bench_serve_output_len_above_the_context_is_named_before_any_request(monkeypatch):
    """Found by a new-user pass: ``bench serve --output-len 5000`` against a 4,096-token server sent every
    request, then said the natural prompts did not fit and to pass --input-len, which cannot help."""
    from mtpspec.entrypoints import bench_serve

    class Info:
        def __init__(self, base_url, client):
            self.max_model_len, self.vocab_size, self.model, self.info = 512, 100, "m", {}

    monkeypatch.setattr(bench_serve, "ServerInfo", Info)
    monkeypatch.setattr(bench_serve, "_run_load", lambda *a, **k: pytest.fail("a request was sent"))
    for out in (512, 5000):
        with pytest.raises(ValueError, match=rf"^output_len {out} leaves no room for a prompt in the server's "
                                             r"max_model_len 512; lower --output-len$"):
            run_benchmark("http://127.0.0.1:1", BenchConfig(num_prompts=1, output_len=out, warmup=0), progress=False)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_orders_are_carry_over_balanced(n) -> None:
    """``bench_arms.round_order``: over n rounds (2n for odd n) each arm runs equally often in each position
    and right after each other arm equally often (a rotation ran arm j + 1 after arm j in every round:
    session 40's adaptive arm always followed k3); the 4-arm sweep's adaptive arm follows three different
    arms in its first three rounds."""
    from collections import Counter
    arms = [f"a{j}" for j in range(n)]
    rounds = [bench_arms.round_order(arms, i) for i in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(r) == arms for r in rounds)
    positions = Counter((pos, a) for r in rounds for pos, a in enumerate(r))
    assert set(positions.values()) == {len(rounds) // n}
    pairs = Counter((r[j], r[j + 1]) for r in rounds for j in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert bench_arms.round_order(arms, len(rounds)) == rounds[0]  # periodic
    sweep = ["plain", "k1", "k3", "adaptive"]
    before = {r[r.index("adaptive") - 1] for r in (bench_arms.round_order(sweep, i) for i in range(3))
              if r.index("adaptive")}
    assert len(before) >= 2, before


# ---------------------------------------------------------------------------- --request-rate / --burstiness
def test_arrival_times_are_seeded_gamma_gaps_scaled_to_the_rate():
    """vLLM's arrivals: gaps of a gamma distribution of shape B (CV^2 = 1 / B; B = 1 exponential: Poisson),
    seeded, scaled so that the last request goes at n / R (so the mean gap is 1 / R); inf: no waits."""
    import math
    import statistics

    from mtpspec.entrypoints.bench_serve import arrival_times
    t = arrival_times(8, 4.0, 1.0, seed=3)
    assert t == arrival_times(8, 4.0, 1.0, seed=3) != arrival_times(8, 4.0, 1.0, seed=4)
    assert 0 < t[0] and all(a < b for a, b in zip(t, t[1:])) and t[-1] == pytest.approx(8 / 4.0)
    assert arrival_times(5, math.inf, 0.3) == [0.0] * 5 and arrival_times(0, 2.0) == []
    n, rate = 40_000, 20.0
    for b in (0.25, 1.0, 4.0):
        t = arrival_times(n, rate, b, seed=1)
        gaps = [t[0]] + [y - x for x, y in zip(t, t[1:])]
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=1e-9)
        assert statistics.pvariance(gaps) * rate ** 2 == pytest.approx(1 / b, rel=0.1), b  # gamma: var = 1/(B R^2)
        if b == 1.0:  # exponential: P(gap < mean) = 1 - 1/e
            assert sum(g < 1 / rate for g in gaps) / n == pytest.approx(1 - math.exp(-1), abs=0.01)
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (2.0, 0.0), (2.0, math.inf), (2.0, math.nan)):
        with pytest.raises(ValueError, match="request_rate must be a number > 0|burstiness must be a finite"):
            arrival_times(3, rate, b)


def _fake_completions(monkeypatch, hold_s: float = 0.0):
    """``/v1/completions`` in process (httpx's MockTransport): records each request's arrival
    (``time.perf_counter``) and the most in flight at once; each holds ``hold_s`` before its one token."""
    import asyncio
    seen = {"sent": [], "live": 0, "most": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["sent"].append(time.perf_counter())
        seen["live"] += 1
        seen["most"] = max(seen["most"], seen["live"])
        await asyncio.sleep(hold_s)
        seen["live"] -= 1
        return httpx.Response(200, text='data: {"choices": [{"token_ids": [5]}]}\n\ndata: {"choices": [], "usage": '
                                        '{"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda *a, **kw: real(*a, transport=httpx.MockTransport(handler), **kw))
    return seen


def _load(cfg: BenchConfig, n: int):
    import asyncio

    from mtpspec.entrypoints import bench_serve
    return asyncio.run(bench_serve._run_load("http://x", "m", [[1, 2, 3]] * n, cfg, False, "t"))


def test_a_request_rate_spaces_the_requests_by_their_arrival_times(monkeypatch):
    from mtpspec.entrypoints.bench_serve import arrival_times
    seen = _fake_completions(monkeypatch)
    cfg = BenchConfig(num_prompts=6, max_concurrency=6, output_len=1, request_rate=10.0, burstiness=4.0, seed=2)
    t0 = time.perf_counter()
    assert all(r.ok for r in _load(cfg, 6))
    want = arrival_times(6, 10.0, 4.0, seed=2)
    for got, at in zip(sorted(seen["sent"]), want):  # never early; late by at most a loop's slack
        assert at - 0.005 <= got - t0 <= at + 0.15, (got - t0, at)
    assert want[-1] == pytest.approx(0.6)
    seen["sent"].clear()
    _load(BenchConfig(num_prompts=6, max_concurrency=6, output_len=1), 6)  # inf: all at once
    assert max(seen["sent"]) - min(seen["sent"]) < 0.1


def test_a_request_rate_and_max_concurrency_both_limit(monkeypatch):
    """As in vLLM: a request arriving while --max-concurrency are in flight waits for one to end."""
    from mtpspec.entrypoints.bench_serve import arrival_times
    seen = _fake_completions(monkeypatch, hold_s=0.15)
    cfg = BenchConfig(num_prompts=6, max_concurrency=2, output_len=1, request_rate=40.0, seed=5)
    t0 = time.perf_counter()
    recs = _load(cfg, 6)
    assert all(r.ok for r in recs) and seen["most"] == 2
    sent = sorted(s - t0 for s in seen["sent"])
    assert all(s >= at - 0.005 for s, at in zip(sent, arrival_times(6, 40.0, 1.0, seed=5)))  # the rate: never early
    assert sent[-1] >= 2 * 0.15 - 0.01 > 6 / 40.0  # the concurrency: three waves of two, not the rate's 0.15 s
    assert all(r.ttft < 0.15 + 0.1 for r in recs)  # TTFT counts from the send, not the arrival


def test_bench_serve_reports_the_rate_and_the_achieved_request_throughput(monkeypatch):
    from mtpspec.entrypoints import bench_serve

    class Info:
        def __init__(self, base_url, client):
            self.max_model_len, self.vocab_size, self.model, self.info, self.forced_acceptance = 512, 100, "m", {}, None

    _fake_completions(monkeypatch)
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda *a, **kw: real(*a, transport=httpx.MockTransport(
        lambda req: httpx.Response(200, json={})), **kw))  # POST /reset_prefix_cache
    monkeypatch.setattr(bench_serve, "ServerInfo", Info)
    monkeypatch.setattr(bench_serve, "scrape", lambda url, c: {})
    cfg = BenchConfig(num_prompts=5, max_concurrency=5, input_len=3, output_len=1, prompts="random", warmup=2,
                      request_rate=25.0, burstiness=2.0)
    rates, real_load = [], bench_serve._run_load

    async def spy(base_url, model, prompts, cfg, progress, desc):
        rates.append((desc, cfg.request_rate))
        return await real_load(base_url, model, prompts, cfg, progress, desc)

    monkeypatch.setattr(bench_serve, "_run_load", spy)
    res = run_benchmark("http://x", cfg, progress=False)
    assert rates == [("warmup", float("inf")), ("bench", 25.0)]  # the warm-up is not paced
    assert res["config"]["request_rate"] == 25.0 and res["config"]["burstiness"] == 2.0
    assert res["completed"] == 5 and res["duration_s"] >= 5 / 25.0  # the last arrival at n / R
    assert res["request_throughput"] == pytest.approx(5 / res["duration_s"]) and res["request_throughput"] <= 25.0
    text = bench_serve.format_result(res)
    assert "request rate                25 req/s, burstiness 2\n" in text and "request throughput" in text
    res = run_benchmark("http://x", BenchConfig(num_prompts=2, max_concurrency=2, input_len=3, output_len=1,
                                                prompts="random", warmup=0), progress=False)
    assert res["config"]["request_rate"] == "inf"  # vLLM's form: JSON has no infinity
    assert json.loads(json.dumps(res, allow_nan=False))["config"]["request_rate"] == "inf"
    assert "request rate                inf (all at once)" in bench_serve.format_result(res)


@pytest.mark.parametrize("argv, err", [
    (["--request-rate", "0"], "--request-rate must be a number > 0 in requests/s (inf: all at once), got 0.0"),
    (["--request-rate", "-2"], "--request-rate must be a number > 0 in requests/s (inf: all at once), got -2.0"),
    (["--request-rate", "nan"], "--request-rate must be a number > 0 in requests/s (inf: all at once), got nan"),
    (["--request-rate", "2", "--burstiness", "0"],
     "--burstiness must be a finite number > 0 (1: Poisson arrivals), got 0.0"),
    (["--request-rate", "2", "--burstiness", "inf"],
     "--burstiness must be a finite number > 0 (1: Poisson arrivals), got inf"),
    (["--burstiness", "0.5"], "--burstiness 0.5 shapes the gaps between --request-rate's arrivals; give a "
                              "--request-rate (default inf: all at once, no gaps)"),
    (["--input-len", "16", "--random-input-len", "32"],
     "--input-len 16 and --random-input-len 32 disagree (--random-input-len is vLLM's spelling of --input-len); "
     "give one"),
    (["--output-len", "8", "--random-output-len", "9"],
     "--output-len 8 and --random-output-len 9 disagree (--random-output-len is vLLM's spelling of --output-len); "
     "give one"),
    (["--dataset", "a.jsonl", "--dataset-path", "b.jsonl"],
     "--dataset a.jsonl and --dataset-path b.jsonl disagree (--dataset-path is vLLM's spelling of --dataset); "
     "give one"),
    (["--random-prompts", "--dataset-name", "gsm8k"],
     "--random-prompts and --dataset-name gsm8k disagree (--dataset-name random is vLLM's spelling of "
     "--random-prompts); give one"),
    (["--shared-prefix", "--request-rate", "2", "--burstiness", "3"],
     "--shared-prefix ignores --request-rate, --burstiness; drop them"),
    (["--shared-prefix", "--dataset-name", "random", "--random-input-len", "8"],
     "--shared-prefix ignores --random-input-len, --dataset-name; drop them"),
])
def test_bad_arrivals_and_disagreeing_spellings_are_one_line_naming_the_flags(capsys, argv, err):
    from mtpspec.entrypoints.cli import main
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err == f"error: {err}\n"


def test_vllm_spellings_and_a_rate_without_max_concurrency(monkeypatch):
    """vLLM's spellings set the same fields; one given twice with one value is fine. A rate alone has no
    concurrency limit (vLLM's default), the closed loop keeps bench serve's 8."""
    import argparse

    from mtpspec.entrypoints import bench_serve
    from mtpspec.entrypoints.cli import main
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    d = {"num_prompts": 64, "max_concurrency": 8, "output_len": 256}
    cfg = bench_serve.config_from_args(p.parse_args(
        ["--dataset-name", "random", "--dataset-path", "x.jsonl", "--random-input-len", "16", "--input-len", "16",
         "--random-output-len", "4"]), d)
    assert (cfg.prompts, cfg.dataset, cfg.input_len, cfg.output_len) == ("random", "x.jsonl", 16, 4)
    assert bench_serve.config_from_args(p.parse_args(["--dataset-name", "gsm8k"]), d).prompts == "gsm8k"
    assert bench_serve.config_from_args(p.parse_args(["--random-prompts", "--dataset-name", "random"]), d).prompts \
        == "random"
    seen = []

    def fake_run(url, cfg, progress=True, desc=""):
        seen.append(cfg)
        raise ValueError("stop")

    monkeypatch.setattr(bench_serve, "run_benchmark", fake_run)
    for argv, conc in (([], 8), (["--request-rate", "3"], 20), (["--request-rate", "3", "--max-concurrency", "2"], 2)):
        assert main(["bench", "serve", "--base-url", "http://h:1", "--num-prompts", "20", "--no-progress", *argv]) == 2
        assert (seen[-1].max_concurrency, seen[-1].request_rate) == (conc, float(argv[1]) if argv else float("inf"))
    # the other workloads: --dataset-name gsm8k is what --shared-prefix reads; --prefill-interference reads neither
    args = argparse.ArgumentParser()
    bench_serve.add_parser(args.add_subparsers(dest="command"))
    parse = lambda *a: args.parse_args(["serve", "--base-url", "http://h:1", *a])  # noqa: E731
    assert bench_serve.unread_flags(parse("--shared-prefix", "--dataset-name", "gsm8k", "--dataset-path", "x")) == []
    assert bench_serve.unread_flags(parse("--prefill-interference", "--dataset-name", "gsm8k", "--random-output-len",
                                          "3", "--request-rate", "2")) == \
        ["--random-output-len", "--dataset-name", "--request-rate"]


def test_arrival_times_stay_finite_when_the_gaps_underflow():
    """A small burstiness (gamma shape 0.001, accepted: finite and > 0) draws gaps that underflow to
    subnormal numbers: the factor ``(n / R) / t`` overflowed to inf, so a request's arrival was inf (the run
    slept forever) and one of gap 0 nan (sent at once). Each arrival is its fraction of the last, times n / R."""
    import math

    from mtpspec.entrypoints.bench_serve import arrival_times
    for seed in range(200):
        for n in (1, 2, 4):
            t = arrival_times(n, 1.0, 0.001, seed=seed)
            assert all(math.isfinite(x) and 0.0 <= x <= n for x in t), (seed, n, t)
            assert t[-1] in (0.0, float(n)), (seed, n, t)  # 0: every gap underflowed to 0 (vLLM: no scaling)
