"""`mtpspec` command line: one subcommand per module, each with ``add_parser`` / ``run``."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import List, Optional

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "generate": "mtpspec.entrypoints.generate",
    "tp-demo": "mtpspec.entrypoints.tp_demo",
    "train": "mtpspec.entrypoints.train",
    "serve": "mtpspec.entrypoints.serve",
    "bench": "mtpspec.entrypoints.bench",
    "eval": "mtpspec.entrypoints.eval_gsm8k",
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpspec", description=__doc__)
    from mtpspec import __version__
    parser.add_argument("-v", "--version", action="version", version=__version__)  # as `vllm --version`
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    argv = _dashed(sys.argv[1:] if argv is None else list(argv))
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, mod_name in SUBCOMMANDS.items():
        if chosen in SUBCOMMANDS and name != chosen:  # import only the chosen command: inference never imports training
            sub.add_parser(name)
            continue
        mod = importlib.import_module(mod_name)
        mod.add_parser(sub)
        modules[name] = mod
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the (innermost) subcommand's parser ("mtpspec bench serve: error: ..."), with its usage
        p = sub.choices[args.command]
        while True:
            nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = getattr(args, nested[0].dest, None) if nested else None
            if chosen not in (nested[0].choices if nested else {}):
                break
            p = nested[0].choices[chosen]
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: the command's own clean-up ran on the way out; no traceback
        print(f"mtpspec {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # a rank died or failed (rank input errors are ValueErrors, the commands' own: exit 2); the module
        # is loaded when one was raised, and commands that never start ranks need not import torch here
        worker_error = getattr(sys.modules.get("mtpspec.engine.executor"), "WorkerError", None)
        if worker_error is None or not isinstance(exc, worker_error) or isinstance(exc, ValueError):
            raise
        # the rank's traceback says where; the driver's own frames (engine -> executor) add nothing
        if exc.rank_traceback:
            print(f"the failing rank's traceback:\n{exc.rank_traceback.rstrip()}", file=sys.stderr)
        print(f"error: {exc.summary}", file=sys.stderr)
        return 1


_OPTION_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def _dashed(argv: List[str]) -> List[str]:
    """``--tensor_parallel_size 2`` / ``--max_model_len=1024`` spelled with dashes, as vLLM's parser takes
    both: underscores in a long option's name (before any ``=``) become dashes. A word whose part before
    ``=`` is not an option name (letters, digits, ``-``, ``_``) is a value and left alone, as argparse takes
    a word with a space for one (``--server-args '--model /ckpt/glm_air'``, ``--prompt '--a_b c'``); so are
    short options, values after ``=`` and everything after a bare ``--``."""
    out, rest = [], False
    for a in argv:
        name, eq, value = a.partition("=")
        if not rest and _OPTION_NAME.fullmatch(name):
            a = name.replace("_", "-") + eq + value
        rest = rest or a == "--"
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
