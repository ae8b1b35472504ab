"""Import triton once with TRITON_INTERPRET=1 (then restore the variable); the kernel-test fixtures.

Triton builds its language functions at first import, so its CPU interpreter only works when
``TRITON_INTERPRET=1`` was set at that moment. Doing it here, before any test module imports
``mtpspec.ops``, lets the kernel tests switch the interpreter on per test (``monkeypatch``)
while every other test runs the torch references.
"""

import os
import sys

import pytest
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


@pytest.fixture
def interp(monkeypatch):
    """Run Triton kernels on CPU tensors (the interpreter) for this test, here and in spawned ranks."""
    from mtpspec.ops.triton_utils import interpreter_available
    if not interpreter_available():
        pytest.skip("triton was imported without TRITON_INTERPRET=1: see test_interpreter_in_subprocess")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_interp(monkeypatch):
    """Run the torch references on CPU tensors for this test."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def kdev(monkeypatch) -> str:
    """Where a kernel test runs: a CUDA GPU when there is one, else CPU under the interpreter."""
    from mtpspec.ops.triton_utils import interpreter_available
    if torch.cuda.is_available():
        return "cuda"
    if not interpreter_available():
        pytest.skip("no GPU and no Triton interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (tiny ops: threads only add contention); a module
    asks with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


class BusyPort:
    """A port a listening socket holds, and ``launcher.find_free_port`` patched to pick it: :meth:`first`
    (then free ports), :meth:`always`; :attr:`picks`: the ports picked so far."""

    def __init__(self, monkeypatch, sock) -> None:
        from mtpspec.distributed import launcher
        self._mp, self._launcher, self._real = monkeypatch, launcher, launcher.find_free_port
        self.port = sock.getsockname()[1]
        self.picks: list = []

    def _pick(self, always: bool) -> int:
        self.picks.append(self.port if always or not self.picks else self._real())
        return self.picks[-1]

    def first(self) -> None:
        self._mp.setattr(self._launcher, "find_free_port", lambda: self._pick(False))

    def always(self) -> None:
        self._mp.setattr(self._launcher, "find_free_port", lambda: self._pick(True))


@pytest.fixture
def busy_port(monkeypatch):
    """A rendezvous port taken between its pick and rank 0's bind (EADDRINUSE): :class:`BusyPort`."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield BusyPort(monkeypatch, sock)
