"""`mtpspec bench`: ``serve`` (a load generator against a running server) and ``arms`` (A/B of
engine arms, one server per arm, interleaved repeated runs, verdicts beyond run-to-run spread)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    from mtpspec.entrypoints import bench_arms, bench_serve
    p = sub.add_parser("bench", help="serving benchmarks: bench serve / bench arms", description=__doc__)
    inner = p.add_subparsers(dest="bench_command", required=True)
    bench_serve.add_parser(inner)
    bench_arms.add_parser(inner)


def run(args: argparse.Namespace) -> int:
    from mtpspec.entrypoints import bench_arms, bench_serve
    if args.bench_command == "serve":
        return bench_serve.run(args)
    return bench_arms.run(args)
