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
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in a rank."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        the run exceeds ``timeout_s``; every rank is terminated before raising.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, backend, dist_timeout_s, fn, args, q, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    done = [False] * world_size
    first_error = None
    deadline = time.monotonic() + timeout_s
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
                                               "without reporting a result")
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
    if first_error is not None:
        exc, tb, rank = first_error
        raise exc from RemoteTraceback(f"\n--- traceback of rank {rank} ---\n{tb}")
    return results
