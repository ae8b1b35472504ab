"""Where a kernel's warps stall, from Nsight Compute's per-SASS-line page (issue 14's profiles):
``ncu --import X.ncu-rep --page source --print-source sass --csv | gzip > X.sass.csv.gz`` (what
``run_goals_h200.sh mla-ncu`` writes). Prints the stall reasons summed over the kernel, then the lines
with the most samples (their address order ``L``, executions, instruction and top three reasons), and
the samples between ``--range A:B`` line pairs (e.g. one warpgroup's loop)::

    python3 benchmarks/ncu_sass_stalls.py benchmarks/results/ncu_mla_split_128x1_sb0_h100_2026-12-07s42.sass.csv.gz \\
        --top 20 --range 2481:2627 --range 2627:2900

The reasons are the page's columns (it has none for ``gmma`` waits: those samples count in the total
only, 4% of it in session 42's split profile). Each sample is one warp seen at one line (``Warp Stall Sampling (All Samples)``); warps parked at a
barrier for the whole kernel (a partition's idle warps) show up as lines executed once per program.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from typing import Dict, List, Tuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> Tuple[List[str], List[List[str]]]:
    """``(header, rows)`` of the CSV (gzip or plain): the row after the kernel-name line is the header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if SAMPLES in r)
    return rows[start], rows[start + 1:]


def summary(header: List[str], rows: List[List[str]], top: int, ranges: List[Tuple[int, int]]) -> Dict[str, object]:
    ix = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    num = lambda r, k: int(r[ix[k]] or 0) if r[ix[k]].strip() not in ("", "-") else 0  # noqa: E731
    total = sum(num(r, SAMPLES) for r in rows)
    reasons = sorted(((sum(num(r, s) for r in rows), s[6:]) for s in stalls), reverse=True)
    order = sorted(range(len(rows)), key=lambda i: -num(rows[i], SAMPLES))[:top]
    lines = [dict(line=i, samples=num(rows[i], SAMPLES), executed=rows[i][ix[EXECUTED]], sass=rows[i][1].strip(),
                  reasons=sorted(((num(rows[i], s), s[6:]) for s in stalls), reverse=True)[:3]) for i in order]
    spans = [dict(lines=f"{a}:{b}", samples=sum(num(r, SAMPLES) for r in rows[a:b])) for a, b in ranges]
    return dict(total=total, reasons=reasons, lines=lines, ranges=spans)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", help="the source page as CSV, gzip or plain")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--range", action="append", default=[], help="A:B, lines A .. B-1: their samples summed")
    a = p.parse_args()
    ranges = [tuple(int(x) for x in r.split(":")) for r in a.range]
    s = summary(*read(a.csv), a.top, ranges)
    total = max(1, s["total"])
    print(f"{s['total']} samples; by reason: " + ", ".join(f"{n} {k} ({100 * n / total:.1f}%)"
                                                          for n, k in s["reasons"] if n))
    for ln in s["lines"]:
        why = ", ".join(f"{k} {n}" for n, k in ln["reasons"] if n)
        print(f"{ln['samples']:7d} {100 * ln['samples'] / total:5.1f}% L{ln['line']:<5d} x{ln['executed']:>8} "
              f"{ln['sass'][:64]:64s} {why}")
    for r in s["ranges"]:
        print(f"lines {r['lines']}: {r['samples']} samples ({100 * r['samples'] / total:.1f}%)")


if __name__ == "__main__":
    main()
