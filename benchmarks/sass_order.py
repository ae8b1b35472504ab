"""The order of a kernel's wgmma waits against its softmax, from its sm_90 SASS (issue 14): where
ptxas put each ``WARPGROUP.DEPBAR`` among the ``FMNMX`` (row max), ``MUFU.EX2`` (exponentials),
``FADD`` (sums), shared-memory stores and ``HGMMA`` issues. ptxas schedules a wgmma wait freely (no
register operands in PTX); a wait meant to let a product run under the softmax is only useful if it
lands after the softmax. Runs of one opcode are counted (``33 FMNMX``)::

    python3 benchmarks/sass_order.py CUBIN [--cuobjdump PATH]
    python3 benchmarks/sass_order.py --triton-cache [DIR] --kernel _mla_ws_kernel   # the newest cached cubins

``--triton-cache``: every ``KERNEL*.cubin`` under Triton's cache (``TRITON_CACHE_DIR`` or
``~/.triton/cache``), newest first (each specialisation once).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
from typing import List

KEEP = ("WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "HGMMA", "FMNMX", "MUFU.EX2", "FADD", "STS", "STSM",
        "SYNCS.ARRIVE", "SYNCS.PHASECHK")


def ops(sass: str) -> List[str]:
    """The kept opcodes in program order (predicates dropped; a wait keeps its group count)."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);", line)
        if not m:
            continue
        op = m.group(2)
        if not op.startswith(KEEP):
            continue
        if op.startswith("WARPGROUP.DEPBAR"):
            op += "(" + m.group(3).strip().split(",")[-1].strip() + ")"
        elif op.startswith("HGMMA"):
            op = "HGMMA." + op.split(".")[1]
        out.append(op)
    return out


def runs(seq: List[str]) -> List[str]:
    """Consecutive equal opcodes as ``N OP``."""
    res: List[str] = []
    for op in seq:
        if res and res[-1].split(" ", 1)[1] == op:
            n, _ = res[-1].split(" ", 1)
            res[-1] = f"{int(n) + 1} {op}"
        else:
            res.append(f"1 {op}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cubin", nargs="?")
    p.add_argument("--triton-cache", nargs="?", const="", default=None)
    p.add_argument("--kernel", default="_mla_ws_kernel")
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    a = p.parse_args()
    if a.cubin:
        files = [a.cubin]
    else:
        root = a.triton_cache or os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
        files = sorted(glob.glob(os.path.join(root, "**", f"{a.kernel}*.cubin"), recursive=True),
                       key=os.path.getmtime, reverse=True)
        if not files:
            raise SystemExit(f"no {a.kernel}*.cubin under {root}")
    for f in files:
        sass = subprocess.run([a.cuobjdump, "-sass", f], capture_output=True, text=True, check=True).stdout
        print(f"== {f}")
        print(" | ".join(runs(ops(sass))))


if __name__ == "__main__":
    main()
