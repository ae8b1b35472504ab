"""`mtpspec bench arms` command line: how ``--server-args`` is read, and plots that never cost a
sweep its JSON or tables (no servers start here: runs are faked or the command stops first)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from mtpspec.entrypoints import bench, bench_arms
from mtpspec.entrypoints.cli import main
from mtpspec.entrypoints.serve import default_model_path

JSON = '{"adaptive_prompt_reserve": 0.5}'


def fake_result(url, cfg, progress=True, desc=""):
    return {"desc": desc, "synthetic_reasons": [], "output_throughput": 10.0, "steps_per_s": 5.0,
            "ttft_ms": {"median": 1.0}, "itl_ms": {"median": 2.0}, "acceptance_length": 2.0,
            "collective_bytes_per_step_total": 0, "acceptance_rate_per_pos": [0.5]}


@pytest.fixture
def no_sweep(monkeypatch):
    """``run_arms`` replaced: records the server flags every arm would get, runs nothing."""
    seen = {}

    def fake_run_arms(arms, workloads, repeats, out_dir, common, urls=None, **kw):
        seen.update(arms=arms, common=common, plots=kw.get("plots"))
        return {"workloads": {}}

    monkeypatch.setattr(bench_arms, "run_arms", fake_run_arms)
    return seen


def test_split_flags_keeps_json_as_written_and_otherwise_splits_as_a_shell():
    split = bench_arms.split_flags
    assert split("--device cpu  -tp 2") == ["--device", "cpu", "-tp", "2"]
    assert split('--speculative-config {"num_speculative_tokens":3}') == \
        ["--speculative-config", '{"num_speculative_tokens":3}']
    assert split('--speculative-config {"num_speculative_tokens": 3, "x": "a }"} -k 3') == \
        ["--speculative-config", '{"num_speculative_tokens": 3, "x": "a }"}', "-k", "3"]
    assert split(f"--speculative-config '{JSON}'") == ["--speculative-config", JSON]  # quoted: the shell's rules
    assert split(f"--speculative-config={JSON}") == [f"--speculative-config={JSON}"]
    assert split('{\\"a\\":1}') == ['{"a":1}']  # not JSON as written: the shell's rules
    assert split("--a 'b c' \"d\" ''") == ["--a", "b c", "d", ""]
    assert split("  ") == [] and split("") == []
    with pytest.raises(ValueError, match="closing quotation"):
        split("--a 'b")


def test_the_word_after_server_args_is_its_value():
    p = argparse.ArgumentParser()
    bench.add_parser(p.add_subparsers(dest="command"))
    for argv, value in ((["--server-args", "--enforce-eager"], "--enforce-eager"),
                        (["--server-args=--enforce-eager"], "--enforce-eager"),
                        (["--server-args", "-tp 2", "--server-args", "-k"], "-k"),  # the last one, as before
                        (["--server-args", "--device cpu"], "--device cpu")):
        args = p.parse_args(["bench", "arms", *argv, "--no-plots"])
        assert args.server_args == value and args.no_plots
    assert bench_arms.join_server_args(["--x", "--", "--server-args", "--y"]) == ["--x", "--", "--server-args", "--y"]


def test_help_shows_every_option_default(capsys):
    """`mtpspec bench arms --help` gave no default for --arms, --workloads, --scale, --output-dir (nor bench
    serve's --temperature); every option with a value of its own says it, as the other commands write it."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "arms", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert info.value.code == 0
    for text in ("(default: baseline,fusion,both)", "(default 3)", "(default: batch1,c64)", "(default 1)",
                 "(default: bench_arms_out)", "(default 0: greedy)"):
        assert text in out, text
    sub = argparse.ArgumentParser().add_subparsers()
    bench_arms.add_parser(sub)
    for a in sub.choices["arms"]._actions:
        if a.nargs != 0 and a.default not in (None, "", []):  # flags and options without a value of their own
            assert "default" in (a.help or ""), a.option_strings


def test_server_args_without_a_value_names_the_accepted_forms(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "arms", "--no-plots", "--server-args"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --server-args: expected one value" in err and "--server-args --enforce-eager" in err


def test_server_args_flag_alone_reaches_the_servers(no_sweep, capsys):
    """``--server-args --enforce-eager`` (argparse used to say 'expected one argument')."""
    assert main(["bench", "arms", "--server-args", "--enforce-eager", "--no-progress", "--no-plots"]) == 0
    assert no_sweep["common"] == ["--model", default_model_path(), "--enforce-eager"]
    assert main(["bench", "arms", "--server-args", "--bogus-flag", "--no-progress", "--no-plots"]) == 2
    assert capsys.readouterr().err == "error: --server-args / --model: unrecognized arguments: --bogus-flag\n"


@pytest.mark.parametrize("value", [f"--speculative-config {JSON}", f"--speculative-config '{JSON}'",
                                   f"--speculative-config={JSON}"])
def test_server_args_json_unquoted_or_quoted(no_sweep, value):
    """The JSON's double quotes survive (shlex used to strip them: 'invalid JSON')."""
    assert main(["bench", "arms", "--arms", "adaptive", "--server-args", value, "--no-progress", "--no-plots"]) == 0
    assert no_sweep["common"][2:] in (["--speculative-config", JSON], [f"--speculative-config={JSON}"])


def test_arm_flags_json_kept_as_written():
    arms = bench_arms.parse_arms("r", [f"r=-k 3 --adaptive-speculation --speculative-config {JSON}"])
    assert arms == {"r": ["-k", "3", "--adaptive-speculation", "--speculative-config", JSON]}


def test_bad_json_or_quote_in_server_args_is_one_line_naming_the_form(no_sweep, capsys):
    assert main(["bench", "arms", "--arms", "adaptive", "--server-args",
                 "--speculative-config {adaptive_prompt_reserve: 0.5}", "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --server-args / --model: --speculative-config: invalid JSON")
    assert "--server-args split into ['--speculative-config', '{adaptive_prompt_reserve:', '0.5}'];" in err
    assert bench_arms.SERVER_ARGS_JSON_FORM in err
    assert main(["bench", "arms", "--server-args", "--device 'cpu", "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No closing quotation" in err and "--server-args --enforce-eager" in err
    assert not no_sweep


@pytest.mark.parametrize("value", ["rate:1.5", "length:-1", "rate:x", "p:0.5", "length:inf"])
def test_a_bad_forced_acceptance_value_stops_before_any_server_starts(no_sweep, capsys, value):
    """Found by a new-user pass: ``--forced-acceptance rate:1.5`` started a server before it was refused."""
    assert main(["bench", "arms", "--forced-acceptance", value, "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --forced-acceptance: forced") and not no_sweep


def test_no_matplotlib_stops_before_any_server_starts(monkeypatch, capsys, tmp_path):
    """Plots wanted and matplotlib missing: one error line naming the fix, exit 2, nothing run
    (a finished sweep used to crash in plot_workload and lose bench_arms.json and the tables)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    ran = []
    monkeypatch.setattr(bench_arms, "run_benchmark", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(bench_arms, "ArmServer", lambda *a, **k: ran.append(a))
    out = tmp_path / "arms"
    assert main(["bench", "arms", "--server-args", "--device cpu", "--workloads", "s1", "--scale", "0.01",
                 "--no-progress", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the plots need matplotlib"), err
    assert "pip install 'mtpspec[bench]'" in err and "--no-plots" in err
    assert not ran and not out.exists()
    # the library call checks it too, before its first run
    wl = {"s1": bench_arms.BenchConfig(num_prompts=1, max_concurrency=1, input_len=8, output_len=4, prompts="random")}
    with pytest.raises(RuntimeError, match="--no-plots"):
        bench_arms.run_arms({"a": []}, wl, 1, str(out), [], urls={"a": "http://127.0.0.1:1"}, progress=False)
    assert not ran
    # --no-plots needs no matplotlib
    monkeypatch.setattr(bench_arms, "run_benchmark", fake_result)
    res = bench_arms.run_arms({"a": []}, wl, 1, str(out), [], urls={"a": "http://127.0.0.1:1"}, progress=False,
                              plots=False)
    assert "plots" not in res and (out / "bench_arms.json").exists()


def test_a_failing_plot_loses_neither_the_json_nor_the_tables(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_arms, "run_benchmark", fake_result)
    seen = {}

    def bad_plot(name, wl, out_dir):
        seen["json_before_plot"] = json.loads((tmp_path / "bench_arms.json").read_text())
        seen["stdout_before_plot"] = capsys.readouterr().out
        raise RuntimeError("boom")

    monkeypatch.setattr(bench_arms, "plot_workload", bad_plot)
    assert main(["bench", "arms", "--arms", "a,b", "--arm", "a=", "--arm", "b=",
                 "--base-url", "a=http://127.0.0.1:1", "--base-url", "b=http://127.0.0.1:2",
                 "--workloads", "s1", "--scale", "0.01", "--repeats", "1", "--no-progress",
                 "--output-dir", str(tmp_path)]) == 0
    assert "workload s1" in seen["stdout_before_plot"] and "b vs a" in seen["stdout_before_plot"]
    assert list(seen["json_before_plot"]["workloads"]) == ["s1"]
    cap = capsys.readouterr()
    assert cap.err == (f"warning: no plots for workload 's1' (RuntimeError: boom); every figure is in "
                       f"{tmp_path / 'bench_arms.json'}\n")
    assert f"every figure: {tmp_path / 'bench_arms.json'}" in cap.out
    res = json.loads((tmp_path / "bench_arms.json").read_text())
    assert res["plots"] == [] and list(res["workloads"]) == ["s1"]
    assert not (tmp_path / bench_arms.PARTIAL_JSON).exists() and not (tmp_path / "bench_arms.json.tmp").exists()


def test_plots_are_made_after_the_json_and_listed_in_it(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bench_arms, "run_benchmark", fake_result)
    wl = {"s1": bench_arms.BenchConfig(num_prompts=1, max_concurrency=1, input_len=8, output_len=4, prompts="random")}
    res = bench_arms.run_arms({"a": [], "b": []}, wl, 1, str(tmp_path), [],
                              urls={"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, progress=False)
    assert res["plots"] == [str(tmp_path / "s1_runs.png"), str(tmp_path / "s1_acceptance.png")]
    assert json.loads((tmp_path / "bench_arms.json").read_text())["plots"] == res["plots"]
    for p in res["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_equal_kv_blocks_give_every_arm_the_same_tokens_and_each_a_whole_workload():
    """Every arm the same KV token capacity: the most any arm needs (each workload's concurrent
    requests whole with that arm's lookahead, or one longest sequence) plus 10%, in its own block size."""
    cfg = bench_arms.BenchConfig
    wl = {"s8": cfg(num_prompts=16, max_concurrency=8, input_len=512, output_len=256, prompts="random"),
          "s256": cfg(num_prompts=512, max_concurrency=256, input_len=512, output_len=256, prompts="random")}
    kw = {"plain": {"block_size": 16, "max_model_len": 1024, "speculative_config": None, "model": None},
          "k3": {"block_size": 16, "max_model_len": 1024, "speculative_config": {"num_speculative_tokens": 3},
                 "model": None},
          "big": {"block_size": 64, "max_model_len": 1024, "speculative_config": {"num_speculative_tokens": 3},
                  "model": None}}
    blocks = bench_arms.equal_kv_blocks(wl, kw)
    tokens = 256 * (-(-(512 + 256 + 7) // 64) + 1) * 64  # the 64-token-block arm needs the most: 13 + 1 blocks each
    tokens += -(-tokens // 10)
    assert blocks == {"plain": -(-tokens // 16), "k3": -(-tokens // 16), "big": -(-tokens // 64)}
    assert blocks["k3"] * 16 >= 1.1 * 256 * (768 + 7)  # k = 3's lookahead and the token scheduled ahead fit
    # a small workload: at least one longest sequence (the engine refuses fewer blocks than that)
    s1 = {"s1": cfg(num_prompts=1, max_concurrency=1, input_len=16, output_len=8, prompts="random")}
    one = bench_arms.equal_kv_blocks(s1, {"k3": dict(kw["k3"], max_model_len=8192)})["k3"]
    assert one * 16 >= 8192 + 6 and one == -(-((-(-(8192 + 6) // 16)) * 16 * 11 // 10) // 16)
    # defaults from the model: block size and max_model_len (at most 8192); natural prompts: max_model_len each
    demo = default_model_path()
    from mtpspec.config import ModelConfig
    from mtpspec.engine.arg_utils import DEFAULT_MAX_MODEL_LEN
    m = ModelConfig.from_pretrained(demo)
    bs, mml = m.arch.default_block_size, min(m.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    natural = {"g": cfg(num_prompts=4, max_concurrency=4, input_len=None, output_len=64)}
    got = bench_arms.equal_kv_blocks(natural, {"a": {"block_size": None, "max_model_len": None,
                                                      "speculative_config": None, "model": demo}})["a"]
    need = 4 * (-(-(mml + 64 + 1) // bs) + 1) * bs
    assert got == -(-(need + -(-need // 10)) // bs)


def test_equal_kv_blocks_reach_each_arm_unless_it_sizes_its_own(monkeypatch, tmp_path):
    """``equal_kv``: ``--num-kv-blocks`` per arm (recorded), no GPU share; an arm with its own KV flag keeps
    it; without ``equal_kv`` the 85% share as before."""
    started = {}

    class FakeServer:
        def __init__(self, arm, flags, common, log):
            started[arm] = list(flags)
            self.url = f"http://127.0.0.1:{len(started)}"

        def stop(self):
            pass

    monkeypatch.setattr(bench_arms, "ArmServer", FakeServer)
    monkeypatch.setattr(bench_arms, "run_benchmark", fake_result)
    wl = {"s1": bench_arms.BenchConfig(num_prompts=1, max_concurrency=2, input_len=40, output_len=8, prompts="random")}
    common = ["--block-size", "16", "--max-model-len", "64"]
    arms = {"a": ["-k", "0"], "b": ["-k", "1"], "c": ["--num-kv-blocks", "99"], "d": ["--num-kv", "7"]}  # abbreviated
    res = bench_arms.run_arms(arms, wl, 1, str(tmp_path), common, progress=False, plots=False, equal_kv=True)
    want = bench_arms.equal_kv_blocks(wl, {"a": {"block_size": 16, "max_model_len": 64, "speculative_config": None,
                                                 "model": None},
                                           "b": {"block_size": 16, "max_model_len": 64,
                                                 "speculative_config": {"num_speculative_tokens": 1}, "model": None}})
    assert res["equal_kv_blocks"] == want and want["a"] == want["b"]
    assert started == {"a": ["-k", "0", "--num-kv-blocks", str(want["a"])],
                       "b": ["-k", "1", "--num-kv-blocks", str(want["b"])], "c": ["--num-kv-blocks", "99"],
                       "d": ["--num-kv", "7"]}
    started.clear()
    res = bench_arms.run_arms({"a": [], "b": []}, wl, 1, str(tmp_path / "2"), common, progress=False, plots=False,
                              share_gpu=True)
    assert res["equal_kv_blocks"] is None
    assert started == {"a": ["--gpu-memory-utilization", "0.4250"], "b": ["--gpu-memory-utilization", "0.8500"]}


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization 0.5", "--gpu-memory-util 0.5", "--num-kv 40"])
def test_equal_kv_blocks_flag_conflicts_with_a_common_kv_size(capsys, flag):
    assert main(["bench", "arms", "--equal-kv-blocks", "--no-plots", "--server-args", flag]) == 2
    assert "--equal-kv-blocks sizes every arm's KV cache: drop --gpu-memory-utilization" in capsys.readouterr().err


def test_preemption_in_one_arm_only_is_warned_in_the_table():
    def wl(pre):
        return {"arms": {arm: {"runs": [{"preemptions": p} for p in runs]} for arm, runs in pre.items()}}

    warn = bench_arms.preemption_warning(wl({"plain": [0, 0], "adaptive": [86, 101]}))
    assert warn.startswith("WARNING: preemptions in adaptive up to 101") and "--equal-kv-blocks" in warn
    assert bench_arms.preemption_warning(wl({"plain": [0, 0], "adaptive": [0, 0]})) is None
    assert bench_arms.preemption_warning(wl({"plain": [3, 1], "adaptive": [5, 0]})) is None  # every arm preempted
    assert bench_arms.preemption_warning({"arms": {"a": {"runs": [{}]}, "b": {"runs": [{"preemptions": 2}]}}}) is None


def test_eager_decode_steps_are_warned_in_the_table_with_the_capture_failure():
    """An arm whose decode steps ran eagerly (a capture that ran out of memory: adaptive at s1 ran at
    0.24x of k = 3 on an H100, 2026-12-05) is named with its reason; none: no warning."""
    oom = "CUDA graph capture failed (OutOfMemoryError: CUDA out of memory.)"
    wl = {"arms": {"plain": {"runs": [{"eager_fallbacks": 0.0}, {"eager_fallbacks": 0.0}]},
                   "adaptive": {"runs": [{"eager_fallbacks": 437.0, "cuda_graph_capture_failed": oom},
                                         {"eager_fallbacks": 560.0, "cuda_graph_capture_failed": oom}]},
                   "old": {"runs": [{}]}}}
    warn = bench_arms.eager_warning(wl)
    assert warn.startswith("WARNING: decode steps ran eagerly") and "adaptive up to 560 a run" in warn
    assert oom in warn and "plain" not in warn and "old" not in warn
    wl["arms"]["adaptive"]["runs"] = [{"eager_fallbacks": 3.0}]  # e.g. batches above the largest graph
    assert bench_arms.eager_warning(wl).count("adaptive up to 3 a run:") == 1
    del wl["arms"]["adaptive"]
    assert bench_arms.eager_warning(wl) is None


def _probed_fake_sweep(monkeypatch, probes):
    """``host_probe_ms`` returns ``probes`` in turn, ``run_benchmark`` a result whose throughput counts the
    calls (recorded in the returned list); and a one-prompt workload ``s1``."""
    it = iter(probes)
    monkeypatch.setattr(bench_arms, "host_probe_ms", lambda: next(it))
    calls = []

    def fake(url, cfg, progress=True, desc=""):
        calls.append(desc)
        return dict(fake_result(url, cfg), output_throughput=float(len(calls)))

    monkeypatch.setattr(bench_arms, "run_benchmark", fake)
    return calls, {"s1": bench_arms.BenchConfig(num_prompts=1, max_concurrency=1, input_len=8, output_len=4,
                                                prompts="random")}


def test_host_retries_run_a_perturbed_round_again_by_its_probes_alone(monkeypatch, tmp_path, capsys):
    """``--host-retries``: a round whose host probes reach > HOST_SPREAD_WARN x the sweep's fastest is run
    again, every arm of it (the H100 of 2026-12-06: probes 12 to 24 ms made the adaptive sweep unreadable);
    the replaced runs are kept apart, the last try stays whatever its probes say."""
    # probes, two per run (before, after), arms a and b: round 1 fine; round 2 slow, slow again, then fine;
    # round 3 slow every time (kept after the retries)
    # (the first probe seeds the sweep's fastest, before the first timed round)
    probes = [10] + [10, 10, 10, 10] + [10, 15, 10, 10] + [10, 10, 10, 16] + [10, 10, 10, 10] + [20] * 12
    calls, wl = _probed_fake_sweep(monkeypatch, probes)
    res = bench_arms.run_arms({"a": [], "b": []}, wl, 3, str(tmp_path), [], progress=False, plots=False,
                              urls={"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, host_retries=2)
    got = res["workloads"]["s1"]
    assert len(calls) == 2 * (1 + 3 + 3)
    assert [r["output_throughput"] for r in got["arms"]["a"]["runs"]] == [1.0, 8.0, 13.0]  # round 2's third try
    assert [r["output_throughput"] for r in got["arms"]["b"]["runs"]] == [2.0, 7.0, 14.0]  # (round 2 rotated: b first)
    assert [r["run_index"] for r in got["arms"]["a"]["runs"]] == [0, 1, 2]
    assert [r["output_throughput"] for r in got["host_perturbed_runs"]["a"]] == [4.0, 6.0, 9.0, 11.0]
    assert res["host_retries"] == 2 and "running the round again" in capsys.readouterr().err
    table = bench_arms.format_workload("s1", got)
    assert "rounds run again for a slow host (--host-retries; their runs in host_perturbed_runs): 4" in table
    with pytest.raises(ValueError, match="--host-retries re-runs interleaved rounds; --one-arm-at-a-time has none"):
        bench_arms.run_arms({"a": []}, wl, 1, str(tmp_path), [], progress=False, plots=False, one_at_a_time=True,
                            host_retries=1)


def test_host_max_ms_stops_the_sweep_on_a_slow_host_keeping_its_runs(monkeypatch, tmp_path, capsys):
    """``--host-max-ms``: a round whose probes' median is above it stops the sweep with a clear error (no
    retry on that host; the runs made stay in the partial JSON); a round at or below it goes on."""
    # the seed probe, then (before, after) per run, arms a and b: round 1 at 14 ms (the limit: goes on), round 2
    # at 14-25 ms (median 22.5 > 14)
    calls, wl = _probed_fake_sweep(monkeypatch, [14] + [14, 14, 14, 14] + [14, 22, 23, 25] + [11] * 20)
    with pytest.raises(RuntimeError, match=r"s1 round 2: the host probes' median, 22.5 ms, is above --host-max-ms 14"):
        bench_arms.run_arms({"a": [], "b": []}, wl, 3, str(tmp_path), [], progress=False, plots=False,
                            urls={"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, host_retries=2,
                            host_max_ms=14)
    assert len(calls) == 4  # no retry, no third round
    partial = json.load(open(tmp_path / bench_arms.PARTIAL_JSON))
    assert len(partial["runs"]["s1"]["a"]) == 2 and len(partial["runs"]["s1"]["b"]) == 2
    assert partial["host_max_ms"] == 14
    for bad, match in ((-1.0, "--host-max-ms must be a finite number >= 0"), (float("nan"), "finite number"),
                       (14.0, "--host-max-ms checks interleaved rounds")):
        with pytest.raises(ValueError, match=match):
            bench_arms.run_arms({"a": []}, wl, 1, str(tmp_path), [], progress=False, plots=False,
                                one_at_a_time=True, host_max_ms=bad)


@pytest.mark.parametrize("argv, said", [
    (["--arms", ","], "error: --arms ',' names no arm; expected some of"),
    (["--arms", "plain,k3,plain"], "error: --arms names ['plain'] more than once ('plain,k3,plain'); name each arm "
                                   "once (for an A/A run give the copy its own name: --arm 'plain2=...'"),
])
def test_arms_naming_no_arm_or_one_twice_is_one_line_before_any_run(no_sweep, capsys, argv, said):
    """Found by a new-user pass: ``--arms ,`` loaded nothing and crashed in the first round with a
    TypeError traceback; ``--arms plain,plain`` ran one arm, silently, with nothing to compare."""
    assert main(["bench", "arms", *argv, "--workloads", "s1", "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(said), err
    assert not no_sweep
    # only --arm's arms: still fine
    assert list(bench_arms.parse_arms(",", ["x=-k 1"])) == ["x"]


@pytest.mark.parametrize("value, said", [
    (",", "error: --workloads ',' names no workload; expected some of ['batch1', 'c64', 's1',"),
    ("s1,s8,s1", "error: --workloads names ['s1'] more than once ('s1,s8,s1'); name each workload once"),
])
def test_workloads_naming_none_or_one_twice_is_one_line_before_any_run(no_sweep, capsys, value, said):
    """Found by a new-user pass: ``--workloads ,`` loaded every arm, ran nothing and exited 0 with an
    empty ``bench_arms.json``; ``--workloads s1,s1`` ran s1 once, silently."""
    assert main(["bench", "arms", "--workloads", value, "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(said), err
    assert not no_sweep
    assert bench_arms.parse_workloads(" s1 , s8 ") == ["s1", "s8"]


def test_in_process_workload_wider_than_max_num_seqs_stops_before_any_arm_loads(monkeypatch, tmp_path, capsys):
    """Found by a new-user pass: ``--in-process --workloads s1,s256`` loaded every arm, ran s1, then
    stopped at s256 ("concurrency ... exceeds the engine's max_num_seqs 64") without naming the flag."""
    from mtpspec.entrypoints import bench_inprocess
    loaded = []
    monkeypatch.setattr(bench_inprocess, "open_arm", lambda *a, **k: loaded.append(a))
    assert main(["bench", "arms", "--in-process", "--arms", "plain,k3", "--workloads", "s1,s256", "--scale", "0.3",
                 "--server-args", "--device cpu", "--no-progress", "--no-plots", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == ("error: workload 's256': concurrency 154 exceeds arm 'plain''s max_num_seqs=64; raise it with "
                   "--server-args '--max-num-seqs 154' (or lower --scale / --max-concurrency)\n"), err
    assert not loaded
    wl = {"s256": bench_arms.BenchConfig(num_prompts=154, max_concurrency=154, input_len=8, output_len=4,
                                         prompts="random")}
    bench_arms.check_workload_concurrency(wl, {"max_num_seqs": 154}, "plain")  # wide enough: no error


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_temperature_stops_before_any_server_starts(monkeypatch, capsys, tmp_path, value):
    """Found by a new-user pass: ``bench arms --temperature -1`` started (or loaded) every arm, then
    failed in the first run; ``bench serve`` sent its warm-up first."""
    loaded = []
    monkeypatch.setattr(bench_arms, "ArmServer", lambda *a, **k: loaded.append(a))
    assert main(["bench", "arms", "--arms", "plain,k3", "--workloads", "s1", "--scale", "0.05", "--temperature", value,
                 "--server-args", "--device cpu", "--no-progress", "--no-plots", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --temperature must be a finite number >= 0, got {float(value)!r}\n"
    assert not loaded
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--temperature", value, "--no-progress"]) == 2
    assert capsys.readouterr().err == f"error: --temperature must be a finite number >= 0, got {float(value)!r}\n"
    assert bench_arms.BenchConfig(temperature=0.7).temperature == 0.7


def test_base_url_naming_one_arm_twice_is_an_error(no_sweep, capsys):
    """Found by a new-user pass: ``--base-url k3=URL1 --base-url k3=URL2`` kept the last, silently."""
    assert main(["bench", "arms", "--arms", "plain,k3", "--base-url", "k3=http://h:1", "--base-url", "k3=http://h:2",
                 "--workloads", "s1", "--no-progress", "--no-plots"]) == 2
    assert capsys.readouterr().err == ("error: --base-url names the arm 'k3' twice (http://h:1 and http://h:2); "
                                       "one server per arm\n")
    assert not no_sweep


def test_bad_counts_name_their_flags(capsys, tmp_path):
    """Found by a new-user pass: ``bench serve --num-prompts 0`` said ``num_prompts must be ...`` and
    ``bench arms --repeats 0`` ``repeats must be ...`` (field and argument names, not the flags)."""
    for argv, want in ((["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "0"],
                        "error: --num-prompts must be an int >= 1, got 0\n"),
                       (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--output-len", "-3"],
                        "error: --output-len must be an int >= 1, got -3\n"),
                       (["bench", "arms", "--repeats", "0", "--no-plots", "--output-dir", str(tmp_path)],
                        "error: --repeats must be >= 1, got 0\n"),
                       (["bench", "arms", "--workloads", "s1", "--max-concurrency", "0", "--no-plots",
                         "--output-dir", str(tmp_path)], "error: --max-concurrency must be an int >= 1, got 0\n")):
        assert main(argv + ["--no-progress"]) == 2, argv
        assert capsys.readouterr().err == want, argv


def test_a_request_rate_reaches_every_workload_and_is_refused_in_process(monkeypatch, capsys, tmp_path):
    """``bench arms --request-rate R``: every workload's runs arrive at R, its concurrency still the limit
    (both apply, as in vLLM); ``--in-process`` queues every request at once, so a rate there is an error."""
    p = argparse.ArgumentParser()
    bench_arms.add_arguments(p)
    p.add_argument("--scale", type=float, default=1.0)
    for name in ("s8", "c64"):
        cfg = bench_arms.workload_config(name, p.parse_args(["--request-rate", "3", "--burstiness", "0.5"]))
        assert (cfg.request_rate, cfg.burstiness) == (3.0, 0.5)
        assert cfg.max_concurrency == bench_arms.PRESETS[name]["max_concurrency"]
    assert bench_arms.workload_config("s8", p.parse_args([])).request_rate == float("inf")
    loaded = []
    from mtpspec.entrypoints import bench_inprocess
    monkeypatch.setattr(bench_inprocess, "open_arm", lambda *a, **k: loaded.append(a))
    assert main(["bench", "arms", "--in-process", "--arms", "plain", "--workloads", "s1", "--request-rate", "2",
                 "--server-args", "--device cpu", "--no-progress", "--no-plots", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("error: --request-rate 2: --in-process queues every request before the first "
                                       "step (no arrivals to pace); drop one\n")
    assert not loaded
    assert main(["bench", "arms", "--workloads", "s1", "--request-rate", "0", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --request-rate must be a number > 0 in requests/s (inf: all at once), " \
                                      "got 0.0\n"
    wl = {"config": bench_arms.BenchConfig(request_rate=2.5).as_json(), "repeats": 1, "synthetic": False,
          "synthetic_reasons": [], "arms": {}, "verdicts": {}}
    assert "concurrency 8, rate 2.5 req/s, burstiness 1 (Poisson), 1 runs/arm" in bench_arms.format_workload("s", wl)
    wl["config"] = bench_arms.BenchConfig().as_json()
    assert "concurrency 8, 1 runs/arm" in bench_arms.format_workload("s", wl)
