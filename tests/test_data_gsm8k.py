"""`mtpspec.data.gsm8k`: the bundled GSM8K copy, the one resolution rule (flag, then
$MTPSPEC_GSM8K_DIR, then the bundled copy), prompts pinned byte for byte, and the two promises
of issue 13 that hang on it: a fresh clone needs nothing beside it, and inference does not
import training."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from test_engine_fixtures import repo_env

from mtpspec.data import gsm8k
from mtpspec.data.gsm8k import (GSM8KNotFoundError, bundled_gsm8k_dir, fewshot_prompt, format_query, load_gsm8k,
                                load_split, resolve_gsm8k, training_document)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------- the bundled copy
def test_bundled_copy_is_verbatim_with_licence_and_source():
    d = bundled_gsm8k_dir()
    assert d == os.path.join(REPO, "mtpspec", "data", "gsm8k")
    # the sha256 sums of openai/grade-school-math's files, as the README beside them states
    readme = open(os.path.join(d, "README.md"), encoding="utf-8").read()
    for split, n in (("train", 7473), ("test", 1319)):
        raw = open(os.path.join(d, f"{split}.jsonl"), "rb").read()
        digest = hashlib.sha256(raw).hexdigest()
        assert f"{split}.jsonl {digest}" in readme
        rows = load_gsm8k(os.path.join(d, f"{split}.jsonl"))
        assert len(rows) == n and all(STRICT.search(r["answer"]) for r in rows)
    assert "openai/grade-school-math" in readme and "MIT" in readme and "verbatim" in readme
    lic = open(os.path.join(d, "LICENSE"), encoding="utf-8").read()
    assert lic.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in lic


def test_bundled_copy_is_package_data():
    text = open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8").read()
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    line = re.search(r'^"mtpspec\.data\.gsm8k" = \[(.*)\]$', section, re.M)
    assert line and {x.strip().strip('"') for x in line.group(1).split(",")} >= {"*.jsonl", "LICENSE", "README.md"}


# ---------------------------------------------------------------------------- resolution order
def test_resolution_order_flag_then_env_then_bundled(tmp_path, monkeypatch):
    monkeypatch.delenv(gsm8k.ENV_VAR, raising=False)
    bundled = os.path.join(bundled_gsm8k_dir(), "test.jsonl")
    assert resolve_gsm8k("test") == bundled
    assert resolve_gsm8k("train") == os.path.join(bundled_gsm8k_dir(), "train.jsonl")
    assert resolve_gsm8k("test", "") == bundled  # an empty flag is "not given"
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "test.jsonl").write_text('{"question": "q?", "answer": "a\\n#### 1"}\n')
    monkeypatch.setenv(gsm8k.ENV_VAR, str(env_dir))
    assert resolve_gsm8k("test") == str(env_dir / "test.jsonl")
    assert load_split("test") == [{"question": "q?", "answer": "a\n#### 1"}]
    # an explicit path wins over the variable: a file as is (any name), a folder by split name
    f = tmp_path / "mine.jsonl"
    f.write_text("")
    assert resolve_gsm8k("test", str(f)) == str(f)
    assert resolve_gsm8k("train", f) == str(f)  # os.PathLike too
    assert resolve_gsm8k("test", bundled_gsm8k_dir()) == bundled


def test_resolution_errors_name_the_setting_and_path(tmp_path, monkeypatch):
    monkeypatch.delenv(gsm8k.ENV_VAR, raising=False)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(GSM8KNotFoundError) as e:
        resolve_gsm8k("test", missing, "--dataset")
    assert str(e.value) == (f"--dataset: no file or folder at {missing!r} "
                            "(expected a GSM8K JSONL file, or a folder holding test.jsonl)")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(GSM8KNotFoundError, match=r"^--data: no train.jsonl in the folder "):
        resolve_gsm8k("train", str(tmp_path))
    # a variable that points nowhere is an error, not a silent fall-back to the bundled copy
    monkeypatch.setenv(gsm8k.ENV_VAR, missing)
    with pytest.raises(GSM8KNotFoundError, match=r"^\$MTPSPEC_GSM8K_DIR: no folder at .*nope.jsonl"):
        resolve_gsm8k("test")
    f = tmp_path / "test.jsonl"
    f.write_text("")
    monkeypatch.setenv(gsm8k.ENV_VAR, str(f))  # the variable names a folder, never a file
    with pytest.raises(GSM8KNotFoundError, match="expected a folder holding test.jsonl"):
        resolve_gsm8k("test")
    with pytest.raises(ValueError, match="split"):
        resolve_gsm8k("validation")


def test_load_gsm8k_rejects_rows_without_keys(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected keys 'question' and 'answer'"):
        load_gsm8k(bad)


@pytest.mark.parametrize("text, pattern", [
    ('{"question": "q", "answer": "a"}\nnot json\n', r"bad.jsonl:2: not a JSON line"),
    ("123\n", r"bad.jsonl:1: expected a JSON object .* got int"),
    ('{"question": 1, "answer": "a"}\n', r"bad.jsonl:1: 'question' and 'answer' must be strings"),
    ("", r"bad.jsonl: no GSM8K rows \(the file is empty\)"),
    ("\n  \n", r"bad.jsonl: no GSM8K rows"),
])
def test_load_gsm8k_names_the_file_and_line_of_a_bad_row(tmp_path, text, pattern):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        load_gsm8k(bad)


def test_generate_reports_a_bad_gsm8k_file_in_one_line(tmp_path):
    """``generate --gsm8k-data`` with a malformed file: ``error: ...`` naming it, exit 2, no traceback."""
    (tmp_path / "test.jsonl").write_text("not json\n")
    r = subprocess.run([sys.executable, "-m", "mtpspec.entrypoints.cli", "generate", "--gsm8k-data", str(tmp_path),
                        "--gsm8k-question", "0", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "test.jsonl:1: not a JSON line" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------- prompts, pinned
# sha256 of the prompts built by mtpspec.training.gsm8k_format / entrypoints.bench_dataset at
# commit ca1cb7c (before the move), from the same files: the move changed no byte.
PIN_EVAL_Q0 = "ea821015b5b035b5699391cb903e1dc2ba0bfff20e99caa72f169af47609249e"
PIN_EVAL_ALL = "c6e4db66756a172278ee06a66192d1c29de88d03ed94020a45c90c1316319b1f"
PIN_BENCH_TEXT_64 = "297520a2dbb9891a2cbb6dca321125076e11000a8ec93f730c5a708940b3bc0c"
PIN_TRAIN_DOCS = "a17aa38fdad4d1766c25c494a3afb71dbfd340126eb2d8f06bb78c0464ccdc67"


def test_prompts_from_bundled_data_are_pinned():
    from mtpspec.entrypoints import eval_gsm8k
    from mtpspec.entrypoints.bench_dataset import gsm8k_text_prompts
    test = load_gsm8k(os.path.join(bundled_gsm8k_dir(), "test.jsonl"))
    train = load_gsm8k(os.path.join(bundled_gsm8k_dir(), "train.jsonl"))
    assert format_query(test[0]["question"]) == (
        "Question: Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
        "muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
        "per fresh duck egg. How much in dollars does she make every day at the farmers' market?\nAnswer:")
    p0 = fewshot_prompt(train[:5], test[0]["question"])
    assert len(p0) == 2158 and _sha(p0) == PIN_EVAL_Q0
    assert p0.startswith("Question: " + train[0]["question"] + "\nAnswer: " + train[0]["answer"] + "\n\nQuestion: ")
    prompts = eval_gsm8k.build_prompts(test, train, 5)
    assert prompts[0] == p0 and _sha("\x00".join(prompts)) == PIN_EVAL_ALL
    assert _sha("\x00".join(gsm8k_text_prompts(test, 64))) == PIN_BENCH_TEXT_64
    docs = [training_document(train[i:i + 3]) for i in range(0, 300, 3)]
    assert _sha("\x00".join(docs)) == PIN_TRAIN_DOCS


def test_eval_data_files_default_and_flags(tmp_path, monkeypatch):
    from mtpspec.entrypoints.eval_gsm8k import data_files
    monkeypatch.delenv(gsm8k.ENV_VAR, raising=False)
    d = bundled_gsm8k_dir()
    assert data_files() == (os.path.join(d, "test.jsonl"), os.path.join(d, "train.jsonl"))
    assert data_files(d) == data_files()
    lone = tmp_path / "questions.jsonl"  # a test file with no train.jsonl beside it
    lone.write_text("")
    with pytest.raises(GSM8KNotFoundError, match=r"^--train \(default: beside the test file\): no train.jsonl"):
        data_files(str(lone))
    assert data_files(str(lone), d) == (str(lone), os.path.join(d, "train.jsonl"))


# ---------------------------------------------------------------------------- a fresh clone
def test_tests_and_ci_never_read_a_folder_beside_the_clone():
    """Tests, Makefile, .ci/ and lm_eval_tasks/ name no path into a `shared` folder beside the clone
    (a folder no user has)."""
    needles = [re.compile(r"\.\./" + "shared"), re.compile(r"[\"']shared[\"']\s*,\s*[\"']data[\"']"),
               re.compile(r"\bshared/" + "data/gsm8k")]
    files = [os.path.join(REPO, "Makefile")]
    for top in ("tests", ".ci", "lm_eval_tasks"):
        for root, _, names in os.walk(os.path.join(REPO, top)):
            files += [os.path.join(root, n) for n in names if not n.endswith((".pyc", ".png"))]
    assert len(files) > 10
    hits = [f"{os.path.relpath(f, REPO)}: {rx.pattern}" for f in files
            for rx in needles if rx.search(open(f, encoding="utf-8", errors="replace").read())]
    assert hits == []


def test_inference_entrypoints_do_not_import_training():
    """Importing every inference entrypoint (and building its parser) leaves mtpspec.training unloaded."""
    code = """
import argparse, importlib, json, sys
mods = ["mtpspec.entrypoints." + m for m in ("generate", "serve", "bench", "bench_serve", "bench_arms",
        "bench_dataset", "eval_gsm8k", "eval_gsm8k_score", "tp_demo", "openai_server", "chat_template")]
sub = argparse.ArgumentParser().add_subparsers()
for m in mods:
    mod = importlib.import_module(m)
    if hasattr(mod, "add_parser") and m.rsplit(".", 1)[1] in ("generate", "serve", "bench", "eval_gsm8k", "tp_demo"):
        mod.add_parser(sub)
import mtpspec.data.gsm8k
print(json.dumps(sorted(k for k in sys.modules if k.startswith("mtpspec"))))
"""
    env = repo_env()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    assert "mtpspec.entrypoints.generate" in loaded and "mtpspec.entrypoints.eval_gsm8k" in loaded
    assert [m for m in loaded if m == "mtpspec.training" or m.startswith("mtpspec.training.")] == []


def test_generate_gsm8k_question_reads_the_bundled_copy_without_training(tmp_path):
    """`make demo`'s prompt: the bundled test row, never a generated stand-in; no training import."""
    code = """
import argparse, json, sys
import mtpspec.entrypoints.generate as gen
args = argparse.Namespace(gsm8k_data=None, gsm8k_question=[0, 2], prompt_file=None, prompt_token_ids=None, prompt=None)
training = any(k.startswith("mtpspec.training") for k in sys.modules)
print(json.dumps({"prompts": gen._prompts(args), "training": training}))
"""
    env = repo_env()
    env.pop(gsm8k.ENV_VAR, None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rows = load_gsm8k(os.path.join(bundled_gsm8k_dir(), "test.jsonl"))
    assert out == {"prompts": [format_query(rows[i]["question"]) for i in (0, 2)], "training": False}
    assert p.stderr == ""  # no "using generated problems" note any more


def test_generate_gsm8k_data_flag_and_env(tmp_path, monkeypatch, capsys):
    import argparse

    import mtpspec.entrypoints.generate as gen
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"question": "Own question?", "answer": "x\\n#### 3"}\n')
    ns = lambda data: argparse.Namespace(gsm8k_data=data, gsm8k_question=[0], prompt_file=None,  # noqa: E731
                                         prompt_token_ids=None, prompt=None)
    monkeypatch.delenv(gsm8k.ENV_VAR, raising=False)
    assert gen._prompts(ns(str(folder))) == ["Question: Own question?\nAnswer:"]
    assert gen._prompts(ns(str(folder / "test.jsonl"))) == ["Question: Own question?\nAnswer:"]
    monkeypatch.setenv(gsm8k.ENV_VAR, str(folder))
    assert gen._prompts(ns(None)) == ["Question: Own question?\nAnswer:"]
    monkeypatch.setenv(gsm8k.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as info:
        gen._prompts(ns(None))
    assert info.value.code == 2
    assert capsys.readouterr().err == f"error: $MTPSPEC_GSM8K_DIR: no folder at {str(tmp_path / 'missing')!r} " \
                                      "(expected a folder holding test.jsonl)\n"


def test_inference_commands_through_the_cli_do_not_import_training():
    """`mtpspec generate | serve | bench | eval | tp-demo` (parsing and a bad-data exit) load no
    mtpspec.training module; `mtpspec train` does (so the check can see one)."""
    code = """
import json, sys
from mtpspec.entrypoints import cli
argv = json.loads(sys.argv[1])
try:
    cli.main(argv)
except SystemExit as e:
    code = e.code
print(json.dumps([code, sorted(k for k in sys.modules if k.startswith("mtpspec.training"))]))
"""
    env = repo_env()
    runs = {"generate": ["generate", "--gsm8k-data", "/no/such/gsm8k", "--gsm8k-question", "0"],
            "serve": ["serve", "--help"], "bench arms": ["bench", "arms", "--help"],
            "bench serve": ["bench", "serve", "--help"], "eval": ["eval", "gsm8k", "--help"],
            "tp-demo": ["tp-demo", "--help"], "train": ["train", "--help"]}
    for what, argv in runs.items():
        p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=120)
        assert p.returncode == 0, p.stderr
        code_, training = json.loads(p.stdout.strip().splitlines()[-1])
        assert code_ == (2 if what == "generate" else 0), (what, p.stderr)
        if what == "train":
            assert "mtpspec.training.train" in training
        else:
            assert training == [], what


def test_lm_eval_task_reads_through_resolve_gsm8k(tmp_path, monkeypatch):
    """lm_eval_tasks/gsm8k_local_utils: --metadata data_dir, else the variable, else the bundled copy."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "lm_eval_tasks"))
    import gsm8k_local_utils as u
    monkeypatch.delenv(gsm8k.ENV_VAR, raising=False)
    assert u._resolve("test") == os.path.join(bundled_gsm8k_dir(), "test.jsonl")
    (tmp_path / "train.jsonl").write_text("")
    monkeypatch.setenv(gsm8k.ENV_VAR, str(tmp_path))
    assert u._resolve("train") == str(tmp_path / "train.jsonl")
    assert u._resolve("train", bundled_gsm8k_dir()) == os.path.join(bundled_gsm8k_dir(), "train.jsonl")
    with pytest.raises(FileNotFoundError, match=r"^--metadata data_dir: no file or folder at '/no/such'"):
        u._resolve("test", "/no/such")
    assert len(u._rows(u._resolve("test", bundled_gsm8k_dir()))) == 1319
