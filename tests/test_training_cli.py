"""`mtpspec train` / `python -m mtpspec.training.train` flags map onto TrainConfig."""

import argparse
import os

import pytest

from mtpspec.entrypoints import train as entry
from mtpspec.training.train import TINY_OVERRIDES, TrainConfig, config_from_args


def _parse(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    entry.add_parser(sub)
    return p.parse_args(["train"] + argv)


def test_defaults_tiny_and_explicit_flags():
    assert config_from_args(_parse([])) == TrainConfig()
    tiny = config_from_args(_parse(["--tiny"]))
    for k, v in TINY_OVERRIDES.items():
        assert getattr(tiny, k) == v
    cfg = config_from_args(_parse(["--tiny", "--max-steps", "7", "--lr", "0.5", "--preset", "ci", "--no-progress",
                                   "--max-minutes", "1.5", "--output-dir", "x"]))
    assert (cfg.max_steps, cfg.lr, cfg.preset, cfg.progress, cfg.max_minutes, cfg.output_dir) == (
        7, 0.5, "ci", False, 1.5, "x")
    assert cfg.tokens_per_batch == TINY_OVERRIDES["tokens_per_batch"]


def test_bad_flag_values_are_rejected():
    with pytest.raises(SystemExit):
        _parse(["--max-steps", "many"])


def test_init_from_a_model_with_fewer_positions_than_max_len_is_refused_first(tmp_path, monkeypatch):
    """``--init-from`` a model whose ``max_position_embeddings`` is below ``--max-len``: a
    ValueError naming both before any data is prepared or weight loaded (it used to fail with an
    IndexError in the rotary table at the first long batch)."""
    import json

    from mtpspec.training import train as train_mod
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "model_type": "glm4_moe"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(train_mod, "prepare_data", lambda *a, **k: pytest.fail("data prepared"))
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), init_from=str(tmp_path), max_len=2048, device="cpu",
                      dtype="float32", progress=False)
    with pytest.raises(ValueError, match=r"--max-len 2048 exceeds the max_position_embeddings 512 of --init-from "
                                         r".*pass --max-len 512 or less"):
        train_mod.train(cfg, log=lambda *a, **k: None)


def test_init_from_supplies_the_architecture_unless_arch_is_given():
    """``--init-from`` a saved model and no ``--arch``: the model's ``model_type``; an explicit
    ``--arch`` still wins (and ``train`` then names the mismatch)."""
    from mtpspec import demo_model_path
    assert config_from_args(_parse(["--init-from", demo_model_path("glm_moe_dsa")])).arch == "glm_moe_dsa"
    assert config_from_args(_parse(["--init-from", demo_model_path("glm4_moe")])).arch == "glm4_moe"
    got = config_from_args(_parse(["--init-from", demo_model_path("glm_moe_dsa"), "--arch", "glm4_moe"]))
    assert got.arch == "glm4_moe"
    assert config_from_args(_parse(["--init-from", "/no/such/dir"])).arch == TrainConfig().arch


def test_flag_errors_are_one_line_before_anything_is_built(capsys, monkeypatch):
    """A flag ``check_config`` refuses: ``error: ...`` on stderr, exit status 2, no data prepared."""
    from mtpspec.training import train as train_mod
    monkeypatch.setattr(train_mod, "prepare_data", lambda *a, **k: pytest.fail("data prepared"))
    assert entry.run(_parse(["--mtp-distill", "1.5"])) == 2
    assert capsys.readouterr().err.strip() == "error: --mtp-distill must be in [0, 1], got 1.5"
    # a new-user pass: these failed late, with a traceback or numpy's words (or not at all)
    for argv, want in ((["--device", "bogus"], "error: --device must be auto, cpu, cuda"),
                       (["--max-len", "1"], "error: --max-len must be >= 2"),
                       (["--preset", "bogus"], "error: --preset must be one of"),
                       (["--self-distill-share", "2"], "error: --self-distill-share must be in [0, 1], got 2")):
        assert entry.run(_parse(argv)) == 2, argv
        assert capsys.readouterr().err.strip().startswith(want), argv
    import torch
    if not torch.cuda.is_available():
        assert entry.run(_parse(["--device", "cuda"])) == 2
        assert "sees no CUDA GPU" in capsys.readouterr().err


def test_bad_runs_are_refused_before_anything_is_written(tmp_path, capsys):
    """``mtpspec train``: a run that cannot work is one ``error:`` line, exit 2, and no output folder
    (a non-empty one needs ``--overwrite-output-dir``: a stale generation_config.json or old weights
    would be read with the new model)."""
    from mtpspec.entrypoints.cli import main
    from mtpspec.training.train import TrainConfig, _clear_previous_model, check_config
    out = tmp_path / "out"
    base = ["train", "--tiny", "--device", "cpu", "--output-dir", str(out)]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "deepseek_v3"}')
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text('{bad')
    for extra, msg in ((["--log-every", "0"], "--log-every must be >= 1"),
                       (["--max-minutes", "0.2"], "leaves no training time after --reserve-seconds 30"),
                       (["--dtype", "int8"], "--dtype must be auto"), (["--save-dtype", "int8"], "--save-dtype must"),
                       (["--init-from", str(tmp_path / "nowhere")], "there is no config.json"),
                       (["--init-from", str(tmp_path / "other"), "--arch", "glm4_moe"],
                        "holds a 'deepseek_v3' model; train continues glm4_moe / glm_moe_dsa (got --arch glm4_moe)"),
                       # no --arch given: not "--arch must be one of" (a new-user pass, 2026-12-05)
                       (["--init-from", str(tmp_path / "other")],
                        "holds a 'deepseek_v3' model; mtpspec train builds and continues glm4_moe / glm_moe_dsa"),
                       (["--init-from", str(tmp_path / "badjson")], "config.json: not a readable JSON object"),
                       (["--gsm8k-dir", str(tmp_path / "test.jsonl")], "names GSM8K's test split")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and "Traceback" not in err, err
        assert not out.exists(), extra
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty; pass --overwrite-output-dir"):
        check_config(TrainConfig(output_dir=str(out)))
    check_config(TrainConfig(output_dir=str(out), overwrite_output_dir=True))
    for name in ("config.json", "generation_config.json", "model-00001-of-00002.safetensors", "summary.json"):
        (out / name).write_text("{}")
    _clear_previous_model(str(out))  # what a run with --overwrite-output-dir removes before training
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_sigterm_stops_training_like_ctrl_c(monkeypatch):
    """SIGTERM (timeout, kill, a scheduler's pre-emption) raises KeyboardInterrupt inside ``train``,
    which the training loop turns into "stop and save"; the previous handler comes back after."""
    import signal

    from mtpspec.training import train as train_mod
    seen = {}

    def fake_train(cfg, log, stage=None):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        return "not reached"
    monkeypatch.setattr(train_mod, "_train", fake_train)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        train_mod.train(train_mod.TrainConfig())
    assert seen["handler"] is not before and signal.getsignal(signal.SIGTERM) is before


def test_a_run_that_fails_keeps_the_model_it_would_replace(tmp_path, capsys):
    """A new-user pass (2026-12-07): ``--init-from`` and ``--output-dir`` the same folder emptied that
    folder before failing; with ``--overwrite-output-dir`` a data error found after start-up (a
    malformed ``--gsm8k-dir``, a ``--max-len`` no document fits) removed the previous model first.
    Now the same folder is refused up front, and the model and data are read before anything is
    removed; an output path that is a file or empty, a negative ``--gsm8k-limit`` and no limit at
    all (``--max-steps 0 --max-minutes 0``) are one-line errors."""
    from mtpspec.entrypoints.cli import main
    from mtpspec.training.train import TrainConfig, check_config
    out = tmp_path / "model"
    out.mkdir()
    files = {"config.json": '{"model_type": "glm4_moe"}', "model.safetensors": "weights", "tokenizer.json": "{}"}
    for name, text in files.items():
        (out / name).write_text(text)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    base = ["train", "--tiny", "--device", "cpu", "--max-steps", "2", "--no-progress", "--overwrite-output-dir"]
    for extra, msg in ((["--init-from", str(out), "--output-dir", str(out)],
                        "--init-from and --output-dir are the same folder"),
                       (["--init-from", str(out) + "/.", "--output-dir", str(out)], "are the same folder"),
                       (["--output-dir", str(out), "--gsm8k-dir", str(bad)], "not a JSON line")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and "Traceback" not in err, err
        assert {p.name: p.read_text() for p in out.iterdir()} == files, extra
    (tmp_path / "a_file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for cfg, msg in ((TrainConfig(output_dir=str(tmp_path / "a_file")), "is a file; give a folder"),
                     (TrainConfig(output_dir=str(tmp_path / "a_file" / "sub" / "x")), "cannot be made: .* is a file"),
                     (TrainConfig(output_dir=str(tmp_path / "dangling")), "symbolic link to nothing"),
                     (TrainConfig(output_dir=str(tmp_path / "n"), max_minutes=float("inf")),
                      "--max-minutes must be finite"),
                     (TrainConfig(output_dir=str(tmp_path / "n"), reserve_seconds=-1.0),
                      "--reserve-seconds must be finite and >= 0"),
                     (TrainConfig(output_dir=""), "--output-dir must name a folder"),
                     (TrainConfig(output_dir=str(tmp_path / "n"), gsm8k_limit=-5), "--gsm8k-limit must be >= 0"),
                     (TrainConfig(output_dir=str(tmp_path / "n"), max_steps=0, max_minutes=0),
                      "set no limit at all")):
        with pytest.raises(ValueError, match=msg):
            check_config(cfg)
    check_config(TrainConfig(output_dir=str(tmp_path / "n"), max_steps=0, max_minutes=5))
    # --overwrite-output-dir removes the model's files only, not a user's other .safetensors
    from mtpspec.training.train import _clear_previous_model
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "other.safetensors"):
        (out / name).write_text("w")
    _clear_previous_model(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["other.safetensors"]


@pytest.mark.parametrize("stage, want", [("prepare", "--output-dir is as it was"),
                                         ("cleared", "the earlier model files in --output-dir were removed"),
                                         ("saved", "after the model was saved")])
def test_an_interrupt_outside_the_loop_says_what_is_on_disk(monkeypatch, capsys, stage, want):
    """Ctrl-C / SIGTERM outside the training loop: exit 130 and a message that matches how far the
    run got (a review: "nothing complete was written" was printed after the model was saved, and
    while the earlier model was still intact)."""
    from mtpspec.training import train as train_mod

    def interrupted(cfg, stage=None, at=stage):
        stage["stage"] = at
        raise KeyboardInterrupt
    monkeypatch.setattr(train_mod, "train", interrupted)
    monkeypatch.setattr(train_mod, "check_config", lambda cfg: None)
    assert entry.run(_parse(["--output-dir", "somewhere"])) == 130
    assert want in capsys.readouterr().err


def test_an_interrupted_run_saves_and_exits_130(monkeypatch, capsys):
    """A run stopped by Ctrl-C / SIGTERM inside the training loop saves the model and reports
    ``stop_reason`` "interrupted"; the command then exits 130, not 0, so a script can tell it from a
    finished run (a new-user pass, 2026-12-07)."""
    from mtpspec.training import train as train_mod
    monkeypatch.setattr(train_mod, "train", lambda cfg, stage=None: {"stop_reason": "interrupted", "steps": 7})
    monkeypatch.setattr(train_mod, "check_config", lambda cfg: None)
    assert entry.run(_parse(["--output-dir", "somewhere"])) == 130
    assert "the model trained so far (7 steps) is saved in somewhere" in capsys.readouterr().err
    monkeypatch.setattr(train_mod, "train", lambda cfg, stage=None: {"stop_reason": "max_steps", "steps": 7})
    assert entry.run(_parse(["--output-dir", "somewhere"])) == 0
