"""`mtpspec train` / `python -m mtpspec.training.train` flags map onto TrainConfig."""

import argparse

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
