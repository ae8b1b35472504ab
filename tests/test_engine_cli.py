"""`mtpspec generate` pieces (``add_parser`` / ``run``), run in-process on a tiny checkpoint."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from test_engine_fixtures import make_model, repo_env

from mtpspec import LLM, SamplingParams, demo_model_path
from mtpspec.entrypoints import generate


def _parse(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    generate.add_parser(sub)
    return p.parse_args(["generate", *argv])


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_cli"))
    make_model(p, seed=31)
    return p


def test_generate_json_matches_llm(path, capsys) -> None:
    args = _parse(["--model", path, "--prompt", "w5 w6", "--prompt", "w9", "-k", "2", "--max-tokens", "6",
                   "--max-model-len", "48", "--num-kv-blocks", "64", "--json"])
    assert generate.run(args) == 0
    got = json.loads(capsys.readouterr().out)
    with LLM(path, max_model_len=48, num_kv_blocks=64) as llm:
        ref = llm.generate(["w5 w6", "w9"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o["token_ids"] for o in got["outputs"]] == [r.outputs[0].token_ids for r in ref]
    assert [o["text"] for o in got["outputs"]] == [r.outputs[0].text for r in ref]
    assert got["metrics"]["num_drafts"] > 0


def test_generate_text_summary_and_prompt_file(path, tmp_path, capsys) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("w3 w4\n\nw7\n")
    args = _parse(["--model", path, "--prompt-file", str(f), "-k", "1", "--no-local-argmax", "--no-fusion",
                   "--max-tokens", "4", "--max-model-len", "48", "--num-kv-blocks", "64"])
    assert generate.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("--- [") == 2 and "acceptance length" in out and "eager fall-backs" in out
    assert "draft sampling greedy" in out and "KV cache dtype     auto" in out
    assert "local argmax " in out  # whether the headline draft path is on (-k turns it on, the JSON form off)


def test_generate_errors(path, capsys) -> None:
    assert generate.run(_parse(["--model", str(path) + "-missing"])) == 2
    assert "no folder" in capsys.readouterr().err
    assert generate.run(_parse(["--model", path, "--temperature", "-1"])) == 2
    assert "temperature" in capsys.readouterr().err
    assert generate.run(_parse(["--model", path, "-k", "99"])) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_generate_bad_model_paths_and_prompt_files_say_what_is_wrong(path, tmp_path, capsys, monkeypatch) -> None:
    """Each bad --model / --prompt-file is one `error:` line (exit 2) naming what is wrong; no traceback."""
    import shutil
    no_cfg = tmp_path / "no_cfg"
    no_cfg.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(path, "config.json"), no_weights / "config.json")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    cases = [
        (["--model", str(no_cfg)], "has no config.json: --model takes a checkpoint folder"),
        (["--model", "deepseek-ai/DeepSeek-V3"], "does not download Hugging Face Hub ids"),
        (["--model", str(empty)], "is a file; it takes a checkpoint folder"),
        (["--model", str(no_weights), "--prompt", "hi"], "no safetensors checkpoint in"),
        (["--model", path, "--prompt-file", str(empty)], "no prompts: "),
    ]
    for argv, needle in cases:
        assert generate.run(_parse(argv)) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and err.startswith("error: "), (argv, err)
    with pytest.raises(SystemExit) as info:
        generate.run(_parse(["--model", path, "--prompt-file", str(tmp_path / "missing.txt")]))
    assert info.value.code == 2 and "--prompt-file: cannot read" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # the README's repo-relative demo path, run from another folder
    assert generate.run(_parse(["--model", "mtpspec/demo_model"])) == 2
    assert f"the bundled model is at {demo_model_path('glm4_moe')!r}" in capsys.readouterr().err


def test_generate_corrupt_tokenizer_is_a_clear_error(path, tmp_path, capsys) -> None:
    import shutil
    bad = tmp_path / "corrupt_tok"
    shutil.copytree(path, bad)
    (bad / "tokenizer.json").write_text("garbage{")
    assert generate.run(_parse(["--model", str(bad), "--max-tokens", "2", "--max-model-len", "48",
                                "--num-kv-blocks", "64"])) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json: cannot load the tokenizer" in err and "Traceback" not in err


def test_generate_tp2_checkpoint_error_is_the_same_clear_error_as_at_tp1(path, tmp_path, capsys) -> None:
    """A checkpoint error raised inside spawned ranks reaches the command as the rank's message
    (``error: rank 0: ...``, exit 2), as at tp 1, not as two nested tracebacks and exit 1."""
    from mtpspec.models.loader import read_checkpoint_tensors, save_checkpoint
    key = "model.layers.1.self_attn.o_proj.weight"
    bad = tmp_path / "missing_key"
    tensors = {k: v for k, v in read_checkpoint_tensors(path) if k != key}
    save_checkpoint(str(bad), tensors, json.load(open(f"{path}/config.json")))
    (bad / "tokenizer.json").write_text(open(f"{path}/tokenizer.json").read())
    for tp in ("1", "2"):
        assert generate.run(_parse(["--model", str(bad), "-tp", tp, "--max-tokens", "2", "--max-model-len", "48",
                                    "--num-kv-blocks", "64", "--device", "cpu"])) == 2
        err = capsys.readouterr().err
        assert f"checkpoint is missing key {key!r}" in err and "Traceback" not in err, err
        assert ("error: rank 0: " in err) == (tp == "2")


def test_rank_errors_keep_the_traceback_and_only_input_errors_are_value_errors() -> None:
    from mtpspec.engine.executor import WorkerError, WorkerInputError, rank_error
    tb = "Traceback (most recent call last):\n  ...\nValueError: bad"
    e = rank_error(1, {"traceback": tb, "message": "bad", "input_error": True})
    assert isinstance(e, WorkerInputError) and isinstance(e, ValueError) and isinstance(e, WorkerError)
    assert str(e) == "rank 1: bad" and e.rank_traceback == tb
    e = rank_error(0, {"traceback": tb, "message": "boom", "input_error": False})
    assert type(e) is WorkerError and not isinstance(e, ValueError) and tb in str(e) and e.rank_traceback == tb


def test_gsm8k_question_reads_the_bundled_gsm8k(monkeypatch, capsys):
    """`make demo` on a fresh clone: the prompt is the bundled GSM8K test row (no generated stand-in)."""
    import argparse
    import os

    import mtpspec.entrypoints.generate as gen
    from mtpspec.data.gsm8k import ENV_VAR, bundled_gsm8k_dir, format_query, load_gsm8k

    monkeypatch.delenv(ENV_VAR, raising=False)
    args = argparse.Namespace(gsm8k_data=None, gsm8k_question=[0, 2], prompt_file=None, prompt_token_ids=None,
                              prompt=None)
    rows = load_gsm8k(os.path.join(bundled_gsm8k_dir(), "test.jsonl"))
    assert gen._prompts(args) == [format_query(rows[i]["question"]) for i in (0, 2)]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv,needle", [
    (["--prompt-token-ids", "1,,2"], "no empty items"),
    (["--prompt-token-ids", "abc"], "comma-separated ints"),
    (["--prompt-token-ids=1,--5"], "comma-separated ints"),  # was a ValueError traceback
    (["--prompt-token-ids", "1,\u00b2"], "comma-separated ints"),  # '²'.isdigit() is True, int('²') fails
    (["--gsm8k-data", "/no/such/file.jsonl", "--gsm8k-question", "0"],
     "error: --gsm8k-data: no file or folder at '/no/such/file.jsonl' (expected a GSM8K JSONL file, or a folder "
     "holding test.jsonl)"),
    (["--gsm8k-question", "1319"], "--gsm8k-question: index 1319 outside [0, 1319)"),
])
def test_generate_bad_prompt_sources_exit_2_with_error(argv, needle, capsys):
    from mtpspec.entrypoints.cli import main
    with pytest.raises(SystemExit) as info:
        main(["generate", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_generate_help_names_the_real_default_model(capsys):
    from mtpspec.entrypoints.cli import main
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"mtpspec/{os.path.basename(demo_model_path())}" in out and "mtpspec/demo_model)" not in out


@pytest.mark.parametrize("argv, needle", [
    # (was --trust-remote-code, accepted since: that case started a real server and waited)
    (["serve", "--no-such-flag"], "mtpspec serve: error: unrecognized arguments: --no-such-flag"),
    (["bench", "serve", "--base-url", "http://x", "--bogus"], "mtpspec bench serve: error: unrecognized arguments: "
                                                              "--bogus"),
    (["generate", "--max-model-len", "4x"], "mtpspec generate: error: argument --max-model-len: expected a whole "
                                           "number such as 4096, 4k (4,000)"),
])
def test_unknown_flags_are_named_by_their_subcommand(argv, needle, capsys):
    from mtpspec.entrypoints.cli import main
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_ctrl_c_in_a_command_is_exit_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C in `mtpspec generate` (or another command without its own handling) printed
    ``KeyboardInterrupt``'s traceback; the command's clean-up runs on the way out, then exit 130."""
    from mtpspec.entrypoints import cli, generate

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "run", interrupted)
    assert cli.main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "mtpspec generate: interrupted\n"


def _session_processes(sid: int) -> dict:
    """``{pid: (state, command line)}`` of the processes of session ``sid`` (from ``/proc``)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == sid:  # state, ppid, pgrp, session
            out[int(pid)] = (fields[0], cmd)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_ctrl_c_while_tp_ranks_start_prints_one_line_and_no_rank_tracebacks() -> None:
    """Ctrl-C (SIGINT to the terminal's process group) during `mtpspec generate -tp 2`'s start-up printed
    every rank's ``KeyboardInterrupt`` traceback (the ranks ignored SIGINT only once their entry point ran,
    not while they still imported torch). Now the ranks start with SIGINT blocked: the command prints its
    one line, exits 130, and leaves no process behind."""
    import signal
    import subprocess
    import sys
    import time

    env = repo_env()
    proc = subprocess.Popen([sys.executable, "-m", "mtpspec", "generate", "--model", demo_model_path(), "-tp", "2",
                             "--device", "cpu", "--prompt", "hi", "--max-tokens", "4"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while sum("spawn_main" in cmd for _, cmd in _session_processes(proc.pid).values()) < 2:  # ranks importing
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "mtpspec generate: interrupted", err
    deadline = time.monotonic() + 10  # the resource tracker exits when it sees the driver gone
    while any(state != "Z" for state, _ in _session_processes(proc.pid).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(state == "Z" for state, _ in _session_processes(proc.pid).values()), _session_processes(proc.pid)


def test_version_flag_prints_the_package_version(capsys) -> None:
    """``mtpspec --version`` (``-v``), as ``vllm --version``: the package version, exit 0."""
    import mtpspec
    from mtpspec.entrypoints.cli import main as cli_main
    for flag in ("--version", "-v"):
        with pytest.raises(SystemExit) as exc:
            cli_main([flag])
        assert exc.value.code == 0 and capsys.readouterr().out.strip() == mtpspec.__version__


def test_python_m_mtpspec_runs_the_cli() -> None:
    """``python -m mtpspec`` is the ``mtpspec`` command (it was "No module named mtpspec.__main__")."""
    import subprocess
    import sys

    import mtpspec
    r = subprocess.run([sys.executable, "-m", "mtpspec", "--version"], capture_output=True, text=True, env=repo_env(),
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == mtpspec.__version__, r.stderr


# ------------------------------------------------------------------ a KV cache larger than memory
HUGE_KV_BLOCKS = str(10 ** 12)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_generate_kv_cache_larger_than_memory_is_one_error_line(path, tp, capsys) -> None:
    """Found by a new-user pass: ``--num-kv-blocks 100000000`` (also at ``-tp 2``) ended in a raw
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``. Now: one ``error:`` line giving
    the GiB needed and available and naming --num-kv-blocks, exit 2; at tp 2 the ranks are gone."""
    import multiprocessing
    assert generate.run(_parse(["--model", path, "-tp", tp, "--prompt", "w1", "--max-tokens", "2",
                                "--max-model-len", "48", "--num-kv-blocks", HUGE_KV_BLOCKS, "--device", "cpu"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "the KV cache does not fit in memory" in err and "GiB is available" in err and "--num-kv-blocks" in err
    assert ("error: rank " in err) == (tp == "2")
    assert not multiprocessing.active_children()


def test_serve_kv_cache_larger_than_memory_is_one_error_line(path, capsys) -> None:
    from mtpspec.entrypoints.cli import main as cli_main
    assert cli_main(["serve", "--model", path, "--port", "0", "--max-model-len", "48", "--device", "cpu",
                     "--num-kv-blocks", HUGE_KV_BLOCKS]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the KV cache does not fit in memory") and err.count("\n") == 1, err


def test_a_failed_kv_cache_leaves_no_model_loaded(path) -> None:
    """The error raised for a KV cache that does not fit keeps no reference to the loaded model
    (its traceback's frames held the weights while the caller held the exception)."""
    import gc

    from mtpspec.engine.model_runner import ModelRunner
    with pytest.raises(ValueError, match="does not fit in memory") as info:
        LLM(path, max_model_len=48, num_kv_blocks=10 ** 12, device="cpu")
    gc.collect()
    assert info.value is not None
    assert not [o for o in gc.get_objects() if type(o) is ModelRunner]


def test_engine_errors_name_the_cli_flags_too(path, tmp_path, capsys) -> None:
    """Messages shared by the Python API and the CLI name both spellings (a CLI user was told to
    'pass prompt_token_ids' and to use ``LLM(cpu_kv_cache_gib=...)``)."""
    make_model(str(tmp_path / "no_tok"), seed=31, tokenizer=False)
    assert generate.run(_parse(["--model", str(tmp_path / "no_tok"), "--prompt", "hi", "--max-tokens", "2",
                                "--max-model-len", "48", "--num-kv-blocks", "64"])) == 2
    err = capsys.readouterr().err
    assert "pass prompt_token_ids; CLI: --prompt-token-ids" in err, err
    assert generate.run(_parse(["--model", path, "--prompt", "w1", "--max-tokens", "2", "--max-model-len", "48",
                                "--num-kv-blocks", "1"])) == 2
    err = capsys.readouterr().err
    assert "cannot hold one sequence" in err and "max_model_len (CLI: --max-model-len)" in err, err
    assert "num_kv_blocks (CLI: --num-kv-blocks)" in err and "(CLI: --gpu-memory-utilization)" in err, err


def test_generate_takes_the_model_s_generation_config_unless_a_flag_is_given(path, tmp_path, capsys) -> None:
    """Found by a new-user pass: with generation_config.json ``max_new_tokens: 5`` the command still
    generated its own 64 tokens (its flags always won, though the engine said the file's defaults
    apply). Flags given > the file > the command's defaults (greedy, 64 tokens)."""
    import shutil
    model = str(tmp_path / "m")
    shutil.copytree(path, model)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"max_new_tokens": 5, "top_k": 1}, f)
    base = ["--model", model, "--prompt", "w5 w6", "-k", "1", "--max-model-len", "48", "--num-kv-blocks", "64",
            "--json"]

    def lengths(*extra):
        assert generate.run(_parse(base + list(extra))) == 0
        return [len(o["token_ids"]) for o in json.loads(capsys.readouterr().out)["outputs"]]
    assert lengths() == [5]
    assert lengths("--max-tokens", "7") == [7]
    # the command's own 64, cut at the context: 48 - 2 prompt tokens
    assert lengths("--generation-config", "vllm") == [min(generate.CLI_SAMPLING_DEFAULTS["max_tokens"], 48 - 2)]


def test_serve_on_port_0_names_the_port_it_listens_on(tmp_path) -> None:
    """``--port 0`` (any free port; a new-user pass, 2026-12-06): the banner named port 0, so a client
    could not find the server. It names the bound port, and the server answers there."""
    import httpx
    from test_server_fixtures import ServerProcess

    from mtpspec import demo_model_path
    srv = ServerProcess(demo_model_path(), ["-k", "1", "--max-model-len", "128", "--max-num-seqs", "2"],
                        log=str(tmp_path / "serve.log"), port=0)
    try:
        assert srv.port != 0, srv.log()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Question: 1 + 1?\nAnswer:", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_generate_summary_shows_steps_per_k_for_adaptive_engines_even_at_full_k() -> None:
    """An adaptive engine whose every step proposed the full k still prints its steps per k (else the
    summary reads like a fixed-k run); a fixed-k run's summary has no such line."""
    m = {"num_output_tokens": 10, "output_tokens_per_s": 5.0, "num_steps": 4,
         "ttft_s": {"mean": 0.1, "p99": 0.1}, "itl_s": {"mean": 0.01, "p99": 0.01},
         "num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6, "acceptance_length": 2.5,
         "acceptance_rate": 0.5, "num_accepted_tokens_per_pos": [3, 2, 1], "accepted_length_histogram": [1, 1, 1, 1],
         "num_speculative_tokens_histogram": [0, 0, 0, 4], "num_mtp_catch_up_tokens": 0, "num_eager_fallbacks": 0,
         "num_preemptions": 0}
    assert "steps proposing k  [0, 0, 0, 4]" in generate.format_metrics(m, adaptive=True)
    assert "steps proposing k" not in generate.format_metrics(m)
    m["num_speculative_tokens_histogram"] = [1, 0, 0, 3]
    assert "steps proposing k  [1, 0, 0, 3]" in generate.format_metrics(m)


def test_a_failed_rank_is_its_traceback_and_one_error_line_not_the_driver_s_traceback(monkeypatch, capsys):
    """A rank that died or crashed under `mtpspec generate -tp 2` (or `eval gsm8k`) ended the command
    with the driver's traceback (engine -> executor frames) around the rank's; `serve` and `tp-demo`
    already said ``error: ...``. Now: the rank's traceback (where it failed), then one error line, exit 1."""
    from mtpspec.engine.executor import WorkerError
    from mtpspec.entrypoints import cli, generate

    def rank_failed(args):
        err = WorkerError("rank 1 died (exit code -9, SIGKILL); rank 0 failed: RuntimeError: Connection reset by peer")
        err.rank_traceback = "Traceback (most recent call last):\n  File \"worker.py\", line 1\nRuntimeError: reset\n"
        raise err
    monkeypatch.setattr(generate, "run", rank_failed)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("\nerror: rank 1 died (exit code -9, SIGKILL); rank 0 failed: RuntimeError: Connection "
                        "reset by peer\n"), err
    assert err.count("Traceback") == 1 and "RuntimeError: reset" in err and "cli.py" not in err, err


def test_generate_under_torchrun_prints_on_rank_0_only(path) -> None:
    """`torchrun --nproc-per-node 2 -m mtpspec generate -tp 2` printed the completions once per rank,
    the second time with zero metrics (rank 0 schedules: "output tokens 0 (- tok/s over 0 steps)");
    with --json two objects, one of them without acceptance figures. Now rank 0 alone prints."""
    import subprocess
    import sys

    from mtpspec.distributed.launcher import find_free_port
    env = repo_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(find_free_port()), "-m", "mtpspec", "generate", "--model", path, "-tp", "2", "-k", "2",
                        "--prompt", "w5 w6", "--max-tokens", "4", "--max-model-len", "48", "--num-kv-blocks", "64",
                        "--device", "cpu", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    assert len(lines) == 1, r.stdout
    assert json.loads(lines[0])["metrics"]["num_drafts"] > 0


def test_torchrun_follower_is_a_rank_other_than_0_of_a_torchrun_launch(monkeypatch) -> None:
    from mtpspec.distributed.launcher import torchrun_follower
    for env, want in (({}, False), ({"WORLD_SIZE": "2", "RANK": "0"}, False), ({"WORLD_SIZE": "2", "RANK": "1"}, True),
                      ({"WORLD_SIZE": "1", "RANK": "0"}, False), ({"WORLD_SIZE": "2"}, False)):
        for k in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert torchrun_follower() is want, env
