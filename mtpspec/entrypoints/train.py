"""`mtpspec train`: the demo-model training recipe (see :mod:`mtpspec.training.train`)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    from mtpspec.training.train import __doc__ as doc, add_arguments
    p = subparsers.add_parser("train", help="train a small GLM-4.5-style (or, --arch glm_moe_dsa, GLM-5-architecture) "
                              "model with an MTP layer on GSM8K",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Train; a flag error (``check_config``, before any data or model is built) or a bad input
    found later (a missing or corrupt ``--init-from`` checkpoint, no GSM8K train split, ...:
    ``ValueError`` / ``FileNotFoundError``) is one ``error:`` line on stderr and exit status 2, as
    argparse reports its own. An interrupt (Ctrl-C, SIGTERM) exits 130, so a script can tell a
    stopped run from a finished one: inside the training loop after saving the model trained so far
    (``stop_reason`` ``"interrupted"`` in summary.json); before it with ``--output-dir`` as it was
    (its earlier model is removed only once everything is read and built); after it with a message
    saying whether the model was saved."""
    from mtpspec.training.train import check_config, config_from_args, train
    stage = {"stage": "prepare"}
    try:
        cfg = config_from_args(args)
        check_config(cfg)
        summary = train(cfg, stage=stage)
        if summary.get("stop_reason") == "interrupted":
            print(f"interrupted: the model trained so far ({summary.get('steps')} steps) is saved in "
                  f"{cfg.output_dir}; exit status 130", file=sys.stderr)
            return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print({"prepare": "interrupted before training started: --output-dir is as it was",
               "cleared": "interrupted before the model was saved: the earlier model files in --output-dir were "
                          "removed and nothing complete was written",
               "saved": "interrupted after the model was saved (its final checks and summary.json were not "
                        "written)"}[stage["stage"]], file=sys.stderr)
        return 130
    return 0
