"""``python -m mtpspec ...``: the ``mtpspec`` command, as the console script runs it (for an
environment where the script is not on ``PATH``, or a source tree on ``PYTHONPATH``)."""

import sys

from mtpspec.entrypoints.cli import main

if __name__ == "__main__":  # tp > 1 spawns ranks that re-import the main module: run nothing then
    sys.exit(main())
