"""Run a function on ``world_size`` local ranks (spawned processes).

Used by tests, benchmarks and the CLI. Each rank gets the ``torchrun`` variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) on a
free port, initialises the TP group, runs ``fn(*args)`` and sends its return value
back pickled (tensors travel by value: return CPU tensors or plain Python).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.multiprocessing as mp


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in a rank."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def torchrun_world() -> int:
    """The number of ranks of the ``torchrun`` launch this process is one of (``WORLD_SIZE`` > 1 with
    ``RANK`` set), else 0 (:func:`~mtpspec.engine.executor.make_executor` then spawns its own ranks)."""
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    return world if world > 1 and "RANK" in os.environ else 0


def torchrun_follower() -> bool:
    """Whether this process is a rank other than 0 of a ``torchrun`` launch (:func:`torchrun_world`):
    every rank runs the command and gets the same outputs, so only rank 0 reports them (vLLM's
    torchrun example prints on rank 0 alone); a follower's engine metrics are empty (rank 0 schedules)."""
    return bool(torchrun_world()) and int(os.environ["RANK"] or 0) != 0


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: start-ups of the ranks (:func:`launch`, :class:`~mtpspec.engine.executor.MultiprocExecutor`), each on a
#: newly picked port, while rank 0 finds its port taken or the gloo mesh fails to connect (:func:`start_on_free_port`)
PORT_ATTEMPTS = 3


def port_taken(text: str) -> bool:
    """Whether a rank's error (its message and traceback) says that the rendezvous port was taken after it
    was picked (torch's ``DistNetworkError ... EADDRINUSE``)."""
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def mesh_failed(text: str) -> bool:
    """Whether a rank's error says that the ranks' gloo mesh failed to connect inside ``init_process_group``
    (``Gloo connectFullMesh failed ... Connection closed by peer``: seen once in ~1,800 tests on a loaded
    2-core machine, gone on the next start; a known flake of torch's own gloo tests, pytorch/pytorch#53270)."""
    return "connectFullMesh failed" in text and "init_process_group" in text


def restartable(text: str) -> bool:
    """Whether a rank's error is one the ranks start again after, on a new port (:func:`start_on_free_port`):
    :func:`port_taken` or :func:`mesh_failed`, both before any rank ran the caller's code."""
    return port_taken(text) or mesh_failed(text)


_T = TypeVar("_T")


def start_on_free_port(start: Callable[[int], _T], taken: Callable[[BaseException], bool]) -> _T:
    """``start(port)`` on a newly picked free port (:func:`find_free_port`); when it raises an exception
    that ``taken`` says the ranks may start again after (:func:`restartable`), again on a new
    port, up to :data:`PORT_ATTEMPTS` times in all. ``start`` ends the ranks it started before it raises.

    Returns:
        What ``start`` returns.

    Raises:
        What ``start`` raised: any exception ``taken`` rejects, or the last attempt's.
    """
    # the port was free when picked, but another process may bind it before rank 0's store does
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return start(find_free_port())
        except BaseException as exc:
            if not taken(exc):
                raise
    return start(find_free_port())  # the last attempt: whatever it raises is final


def _main_guard_spans(path: str) -> Optional[List[range]]:
    """Line ranges of the top-level ``if __name__ == "__main__":`` blocks of ``path`` (``None``: unreadable)."""
    import ast
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    spans = []
    for node in tree.body:
        t = node.test if isinstance(node, ast.If) else None
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            sides = [t.left, t.comparators[0]]
            if any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and \
                    any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides):
                spans.append(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return spans


def main_guard_hint() -> str:
    """For a rank that died while starting: a hint when the main script (re-imported by spawned
    children) has no top-level ``if __name__ == "__main__":`` block at all; else ``""``."""
    import sys
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if path is None or (spec_name or "").endswith("__main__"):
        return ""
    spans = _main_guard_spans(path)
    if spans is None or spans:
        return ""
    return (f" ({os.path.basename(path)} has no `if __name__ == \"__main__\":` block; spawned ranks re-import it, "
            "so code that starts ranks must sit under that guard)")


def check_main_guard(what: str = "this spawns ranks as new processes") -> None:
    """Raise before spawning when spawned children would re-run the caller (a missing main guard).

    The ``spawn`` start method re-imports the main script in every child (as ``__mp_main__``,
    the rules of :func:`multiprocessing.spawn.get_preparation_data`); when the code that
    spawns runs at import time (not under ``if __name__ == "__main__":``), each child would run
    it again and die in its bootstrapping phase (the parent then saw a bare ``EOFError``). This
    looks at the call stack: a module-level frame of ``__main__`` outside a top-level guard
    block means exactly that. Interactive sessions, ``python -c`` and ``python -m pkg`` (a
    package's ``__main__``) are not re-imported and pass.

    Raises:
        RuntimeError: naming the script, the line and the missing guard; also when called inside
            a spawned child's bootstrapping phase (the same mistake seen from the child).
    """
    import multiprocessing
    import sys
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"{what}, but this process is itself a spawned child still importing the main "
                           "script: create the LLM (or call launch) under `if __name__ == \"__main__\":` "
                           "in the script")
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if main is None or path is None or (spec_name or "").endswith("__main__") or \
            os.path.splitext(os.path.basename(path))[0] == "ipython":
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"):
        frame = frame.f_back
    if frame is None:
        return
    spans = _main_guard_spans(frame.f_code.co_filename)
    if spans is None or any(frame.f_lineno in r for r in spans):
        return
    script = os.path.basename(frame.f_code.co_filename)
    raise RuntimeError(
        f"{what}: multiprocessing 'spawn' re-imports the main script in every new process, and {script} "
        f"line {frame.f_lineno} runs at import time, so each rank would run it again and die while starting. "
        f"Put the code that creates and uses the LLM under `if __name__ == \"__main__\":` in {script} "
        "(see the README's Python example and 'Safe importing of main module' in Python's multiprocessing docs).")


def _worker(rank, world_size, port, backend, timeout_s, fn, args, q, threads):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from mtpspec.distributed.parallel_state import (
        destroy_distributed_environment, init_distributed_environment)
    try:
        init_distributed_environment(world_size, rank, rank, backend=backend, timeout_s=timeout_s)
        result = fn(*args)
        payload = ("ok", rank, pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # unpicklable exception: keep its text
            blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        payload = ("err", rank, (blob, tb))
    q.put(payload)
    try:
        if payload[0] == "ok":
            destroy_distributed_environment()
    finally:
        # Give the parent time to read the queue before the feeder thread dies.
        q.close()
        q.join_thread()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: Optional[str] = None,
           timeout_s: float = 300.0, dist_timeout_s: float = 60.0) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return their results.

    Args:
        fn: a picklable (module-level) function; it runs after the TP group is set up.
        world_size: number of ranks (>= 1).
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL when there is a GPU per rank,
            gloo otherwise).
        timeout_s: wall-clock limit for the whole run, in seconds.
        dist_timeout_s: how long a collective waits for a missing peer before raising.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        The first exception a rank raised (chronologically, which is the root cause when
        other ranks then fail waiting for it), chained to a :class:`RemoteTraceback` that
        holds the rank's traceback. ``RuntimeError`` if a rank dies without reporting or
        the run exceeds ``timeout_s``; every rank is terminated before raising. A rank that
        finds the rendezvous port taken (``EADDRINUSE``: another process bound it after it was
        picked) starts the ranks again on a new port, up to :data:`PORT_ATTEMPTS` times in all.
        ``RuntimeError`` from :func:`check_main_guard` (nothing spawned) when called at import
        time of a main script without ``if __name__ == "__main__":``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_main_guard(f"launch(world_size={world_size}) spawns its ranks as new processes")
    deadline = time.monotonic() + timeout_s

    def start(port: int) -> List[Any]:
        results, first_error = _run_ranks(fn, world_size, args, backend, dist_timeout_s, port, deadline, timeout_s)
        if first_error is not None:
            exc, tb, rank = first_error
            raise exc from RemoteTraceback(f"\n--- traceback of rank {rank} ---\n{tb}")
        return results

    def taken(exc: BaseException) -> bool:  # a rank's own error (chained above), not _run_ranks' RuntimeErrors
        return isinstance(exc.__cause__, RemoteTraceback) and restartable(f"{exc}\n{exc.__cause__.tb}")

    return start_on_free_port(start, taken)


def _run_ranks(fn: Callable[..., Any], world_size: int, args: tuple, backend: Optional[str], dist_timeout_s: float,
               port: int, deadline: float, timeout_s: float) -> Tuple[List[Any], Optional[tuple]]:
    """One start of :func:`launch`'s ranks on ``port``: every rank's result in rank order and ``None``, or
    ``(exception, traceback text, rank)`` of the first rank that raised (every rank is ended then).

    Raises:
        RuntimeError: a rank died without reporting, or ``deadline`` (``time.monotonic()``) passed.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, backend, dist_timeout_s, fn, args, q, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    done = [False] * world_size
    first_error = None
    try:
        while not all(done):
            try:
                kind, rank, data = q.get(timeout=0.2)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"launch: ranks {[r for r in range(world_size) if not done[r]]} "
                                       f"did not finish within {timeout_s:.0f} s")
                for r, p in enumerate(procs):
                    if not done[r] and not p.is_alive() and p.exitcode not in (None, 0):
                        # Drain anything it managed to send before giving up on it.
                        time.sleep(0.5)
                        if q.empty():
                            raise RuntimeError(f"launch: rank {r} died with exit code {p.exitcode} "
                                               "without reporting a result" + main_guard_hint())
                continue
            done[rank] = True
            if kind == "ok":
                results[rank] = pickle.loads(data)
            else:
                blob, tb = data
                first_error = (pickle.loads(blob), tb, rank)
                break
    finally:
        if first_error is not None or not all(done):
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, first_error
