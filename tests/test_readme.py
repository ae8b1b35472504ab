"""The README's Python snippet runs as a script, as written (tp 2: spawned gloo ranks on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from test_engine_fixtures import repo_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_snippet() -> str:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "README has no python block under '## Python API'"
    return match.group(1)


def test_readme_python_snippet_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_python_snippet(), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=repo_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    value = float(lines[-1].split(":", 1)[1])
    assert 1.0 <= value <= 4.0, lines[-1]  # k = 3: acceptance length in [1, 1 + k]


def _read(*parts: str) -> str:
    return open(os.path.join(REPO, *parts), encoding="utf-8").read()


def test_docs_bench_arms_synopsis_lists_the_readme_flags():
    readme = _read("README.md")
    cmd = next(line for line in readme.splitlines() if line.startswith("mtpspec bench arms"))
    flags = set(re.findall(r"(?<![\w\"'])--[a-z][a-z-]+", cmd.split("--server-args")[0]))
    docs = _read("docs", "serving.md")
    synopsis = docs[docs.index("mtpspec bench arms ["):]
    synopsis = synopsis[:synopsis.index("```")]
    assert flags and all(f in synopsis for f in flags), (flags, synopsis)


def test_docs_demo_model_parameter_count_matches_readme():
    m = re.search(r"\(([\d.]+) M parameters", _read("README.md"))
    assert m, "README states no demo model size"
    docs_counts = set(re.findall(r"([\d.]+) M-parameter demo model", _read("docs", "serving.md")))
    assert docs_counts <= {m.group(1)}, docs_counts


def test_served_model_name_default_is_documented_truly():
    import argparse
    from mtpspec.entrypoints import serve
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers(dest="command"))
    text = p._subparsers._group_actions[0].choices["serve"].format_help()
    assert "mtpspec-demo" in " ".join(text.split())
    row = next(line for line in _read("docs", "serving.md").splitlines() if line.startswith("| `--served-model-name"))
    assert "mtpspec-demo" in row
