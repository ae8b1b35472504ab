"""Where two runs' host time differs, function by function (issue 18: the adaptive arm's k = 0 steps
against plain decoding's).

    MTPSPEC_BENCH_PROFILE_DIR=prof python -m mtpspec.entrypoints.cli bench arms --in-process --arms plain,adaptive ...
    python benchmarks/diff_profiles.py prof/s64_plain_1.pstats prof/s64_adaptive_1.pstats [--per N] [--top 40]

Reads two ``cProfile`` dumps (``MTPSPEC_BENCH_PROFILE_DIR``, :mod:`mtpspec.entrypoints.bench_inprocess`)
and prints each side's total profiled time, then the functions whose own time (``tottime``, not
counting callees) differs most, with their call counts, in us per ``--per`` unit (e.g. the run's
engine steps; default 1: us in all). A garbage-collection summary (``.gc.json`` beside each dump)
is printed where there is one. Profiled runs are slower than unprofiled ones (about 1.5-2x): read
the differences, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats


def own_times(path: str):
    """``{(file, line, function): (calls, own s)}`` of a dump."""
    return {k: (v[1], v[2]) for k, v in pstats.Stats(path).stats.items()}


def label(key) -> str:
    file, line, func = key
    return func if file == "~" else f"{os.path.basename(file)}:{line}({func})"  # ("~": a built-in)


def main() -> None:
    ap = argparse.ArgumentParser(description="function-by-function own-time difference of two cProfile dumps")
    ap.add_argument("a", help="the reference dump (e.g. plain decoding's)")
    ap.add_argument("b", help="the compared dump (e.g. the adaptive arm's)")
    ap.add_argument("--per", type=float, default=1.0, help="divide the times by this (e.g. engine steps)")
    ap.add_argument("--top", type=int, default=40, help="functions shown")
    args = ap.parse_args()
    if args.per <= 0:
        ap.error(f"--per must be > 0, got {args.per}")
    a, b = own_times(args.a), own_times(args.b)
    ta, tb = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    print(f"profiled own time: {ta * 1e6 / args.per:.1f} us (a) {tb * 1e6 / args.per:.1f} us (b) per unit, "
          f"b - a = {(tb - ta) * 1e6 / args.per:+.1f} us")
    for path, name in ((args.a, "a"), (args.b, "b")):
        gcp = os.path.splitext(path)[0] + ".gc.json"
        if os.path.exists(gcp):
            by_gen = json.load(open(gcp))["collections_and_ms_by_generation"]
            print(f"gc ({name}): " + ", ".join(f"gen {g}: {n} in {ms:.1f} ms" for g, (n, ms) in sorted(by_gen.items())))
    rows = []
    for key in set(a) | set(b):
        na, sa = a.get(key, (0, 0.0))
        nb, sb = b.get(key, (0, 0.0))
        rows.append((sb - sa, key, na, nb, sa, sb))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"{'b - a':>10} {'a':>10} {'b':>10}  {'calls a':>8} {'calls b':>8}  function  (us per unit)")
    for d, key, na, nb, sa, sb in rows[:args.top]:
        k = 1e6 / args.per
        print(f"{d * k:+10.1f} {sa * k:10.1f} {sb * k:10.1f}  {na:8d} {nb:8d}  {label(key)}")


if __name__ == "__main__":
    main()
