"""Import triton once with TRITON_INTERPRET=1 (then restore the variable).

Triton builds its language functions at first import, so its CPU interpreter only works when
``TRITON_INTERPRET=1`` was set at that moment. Doing it here, before any test module imports
``mtpspec.ops``, lets the kernel tests switch the interpreter on per test (``monkeypatch``)
while every other test runs the torch references.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved
