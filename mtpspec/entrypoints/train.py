"""`mtpspec train`: the demo-model training recipe (see :mod:`mtpspec.training.train`)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from mtpspec.training.train import __doc__ as doc, add_arguments
    p = subparsers.add_parser("train", help="train a small GLM-4.5-style (or, --arch glm_moe_dsa, GLM-5-architecture) "
                              "model with an MTP layer on GSM8K",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from mtpspec.training.train import config_from_args, train
    train(config_from_args(args))
    return 0
