"""Executors: how the engine's steps reach the ranks (see :mod:`mtpspec.engine.worker`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable, Iterator, List, Optional, Protocol

import torch.distributed as dist
import torch.multiprocessing as mp

from mtpspec.distributed.launcher import main_guard_hint, restartable, start_on_free_port
from mtpspec.engine.config import EngineConfig
from mtpspec.step_io import StepInput, StepOutput
from mtpspec.engine.worker import (
    build_runner, cpu_group, follower_loop, handle_message, init_cache_min_over_ranks,
    spawned_worker_main)


class WorkerError(RuntimeError):
    """A rank failed; the message holds its traceback (``rank_traceback``: the traceback alone).
    :attr:`rank` is the rank whose own error or death it reports (``None``: the executor's, or several
    ranks'). :attr:`summary` is one line for clients (the traceback belongs in the server log)."""

    rank_traceback: str = ""
    rank: Optional[int] = None

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        if rank is not None:
            self.rank = rank

    @property
    def summary(self) -> str:
        """The message when it is one line; else its first line and the traceback's last line (the
        exception, at most 300 characters)."""
        lines = [x.strip() for x in str(self).splitlines() if x.strip()]
        if len(lines) <= 1:
            return lines[0] if lines else type(self).__name__
        tb = [x.strip() for x in self.rank_traceback.splitlines() if x.strip()] or lines
        return f"{lines[0].rstrip(':')}: {tb[-1][:300]}"


class WorkerInputError(WorkerError, ValueError):
    """A rank rejected its input with a ``ValueError`` / ``TypeError`` (a bad checkpoint, config or
    argument: the errors ``LLM(...)`` raises itself at tp 1). The message is the rank's own,
    prefixed by the rank, so callers that report ``ValueError`` s as user errors (the commands'
    ``error: ...``, exit 2) do so at any tp; the traceback is in ``rank_traceback``."""


def rank_error(rank: int, payload: Any) -> WorkerError:
    """The exception for a rank's ``("err", payload)`` reply (:func:`~mtpspec.engine.worker.spawned_worker_main`)."""
    if not isinstance(payload, dict):
        return WorkerError(f"rank {rank} failed:\n{payload}", rank=rank)
    if payload.get("input_error"):
        err: WorkerError = WorkerInputError(f"rank {rank}: {payload['message']}", rank=rank)
    else:
        err = WorkerError(f"rank {rank} failed:\n{payload['traceback']}", rank=rank)
    err.rank_traceback = payload["traceback"]
    return err


class Executor:
    """Runs steps on every rank; ``execute`` returns rank 0's :class:`StepOutput`.

    Attributes:
        num_kv_blocks: KV blocks per layer (minimum over ranks).
    """

    num_kv_blocks: int = 0

    def execute(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    def execute_async(self, step: StepInput) -> "StepHandle":
        """Start a step; its tokens and drafts are read from the returned handle. Here: the whole
        step first (executors whose ranks reply once per step); :class:`InProcessExecutor`
        returns while the step's draft passes still run on the device."""
        return DoneStep(self.execute(step))

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        """Run ``fn(runner, *args)`` on every rank this process can reach; results in rank order."""
        raise NotImplementedError

    def dead_ranks(self) -> str:
        """``"rank R died (exit code C, SIGNAME)"`` for each rank process that exited, ``""`` when all
        live (and for executors without rank processes)."""
        return ""

    def shutdown(self) -> None:
        pass


class StepHandle(Protocol):
    """A started step (:meth:`Executor.execute_async`; :class:`~mtpspec.engine.model_runner.PendingStep`)."""

    def output(self) -> StepOutput:
        """Rank 0's tokens and log-probabilities; ``draft_token_ids`` is ``None``."""

    def drafts(self) -> List[List[int]]:
        """Per sequence, the ``k`` drafts for the next step (``[]`` without)."""

    def catch_up_ms(self) -> Optional[float]:
        """Device ms of the step's catch-up pass (deferred MTP entries), ``None`` without one."""


class DoneStep:
    """The handle of a step that already finished."""

    def __init__(self, out: StepOutput):
        self._drafts = out.draft_token_ids
        self._out = out
        out.draft_token_ids = None

    def output(self) -> StepOutput:
        return self._out

    def drafts(self) -> List[List[int]]:
        return self._drafts

    def catch_up_ms(self) -> Optional[float]:
        return self._out.catch_up_ms


class InProcessExecutor(Executor):
    """tp 1, or rank 0 under ``torchrun`` (then every message is broadcast to the other ranks first)."""

    def __init__(self, cfg: EngineConfig, broadcast: bool = False):
        """Load the model and size and allocate the KV cache.

        Raises:
            what :func:`~mtpspec.engine.worker.build_runner` and
            :func:`~mtpspec.engine.worker.init_cache_min_over_ranks` raise (e.g.
            :class:`~mtpspec.engine.kv_cache.KVCacheMemoryError`, a ``ValueError``: the KV cache
            asked for does not fit in memory). A failed load leaves nothing loaded: the exception's
            traceback keeps no reference to the model (its frames' locals are cleared) and the
            device's cached memory is released.
        """
        self.broadcast = broadcast
        self.group = cpu_group() if broadcast else None
        self.runner = None
        try:
            self.runner = build_runner(cfg)
            self.num_kv_blocks = init_cache_min_over_ranks(self.runner)
        except BaseException as exc:
            self.runner = None
            traceback.clear_frames(exc.__traceback__)  # its frames hold the half-loaded model
            release_device_memory()
            raise

    def _send(self, msg: tuple) -> None:
        if self.broadcast:
            dist.broadcast_object_list([msg], src=0, group=self.group)

    def _check_open(self) -> None:
        if self.runner is None:
            raise WorkerError("the executor was shut down")

    def execute(self, step: StepInput) -> StepOutput:
        self._check_open()
        msg = ("step", step)
        self._send(msg)
        return handle_message(self.runner, msg)

    def execute_async(self, step: StepInput) -> "StepHandle":
        self._check_open()
        self._send(("step", step))
        return self.runner.launch(step)

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        self._check_open()
        msg = ("rpc", fn, args)
        self._send(msg)
        return [handle_message(self.runner, msg)]

    def finish_call(self, payload: Any) -> None:
        """Under ``torchrun``: release the other ranks' :func:`follower_loop` with ``payload``."""
        self._send(("done", payload))

    def shutdown(self) -> None:
        """Under ``torchrun`` every rank calls it: rank 0 sends ``stop``, the others wait for it.
        Then the runner is released (weights, KV caches, CUDA graphs; the CUDA caching allocator's
        free blocks go back to the device), as a spawned rank frees its memory by exiting, so a
        next engine in this process can size its KV cache; later steps raise WorkerError."""
        if self.broadcast and dist.is_initialized():
            self.broadcast = False
            if dist.get_rank() == 0:
                dist.broadcast_object_list([("stop",)], src=0, group=self.group)
            else:
                follower_loop(self.runner, self.group)
            # No rank may exit while a peer still reads the stop message from it: a process that
            # exits with a gloo transfer in flight aborts ("terminate called without an active
            # exception"), seen under a real torchrun.
            dist.barrier(group=self.group)
        if self.runner is not None:
            self.runner = None
            release_device_memory()


def exit_text(code: Optional[int]) -> str:
    """``exit code N``, with the signal's name for a process a signal ended (``exit code -9, SIGKILL``)."""
    named = code is not None and code < 0 and -code in signal.Signals._value2member_map_
    return f"exit code {code}" + (f", {signal.Signals(-code).name}" if named else "")


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold SIGINT off for the block (in the main thread, where Python runs its handler; a signal
    arriving meanwhile is delivered, as ``KeyboardInterrupt``, when the block ends). A process started
    in the block starts with SIGINT blocked (a signal mask survives fork and exec)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def sigint_held_for_spawn() -> Iterator[None]:
    """:func:`sigint_held` for a block that starts processes (``multiprocessing`` spawn): each starts with
    SIGINT blocked from its first instruction, so a Ctrl-C while it still imports prints nothing there.

    The ``multiprocessing`` resource tracker is started first, outside the held block: its start
    (``ResourceTracker.ensure_running``, called by a spawn ``Process.start``) blocks SIGINT for its
    own spawn and then *unblocks* it rather than restoring the mask, so a tracker started inside the
    block let the process spawned next start with SIGINT deliverable (CI saw a rank's
    ``KeyboardInterrupt`` traceback from its ``site`` import).
    """
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    with sigint_held():
        yield


def release_device_memory() -> None:
    """Collect garbage, then return the CUDA caching allocator's free blocks to the device (the
    KV sizing reads the device's free memory, which counts cached blocks as used)."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


#: seconds :meth:`MultiprocExecutor.shutdown` waits for each rank to exit before SIGTERM (then SIGKILL)
SHUTDOWN_JOIN_S = 10.0


def _restartable(exc: "WorkerError") -> bool:
    """Whether a rank failed to start because the rendezvous port was taken meanwhile (torch's
    ``DistNetworkError ... EADDRINUSE``) or the ranks' gloo mesh failed to connect while they
    rendezvoused: :func:`~mtpspec.distributed.launcher.restartable`; either way the ranks start again."""
    return restartable(f"{exc}\n{exc.rank_traceback}")


class MultiprocExecutor(Executor):
    """Spawns ``world_size`` persistent ranks and feeds them steps through pipes.

    Args:
        cfg: the workers' config.
        world_size: number of ranks.
        start_timeout_s: most seconds to wait for the ranks to load and size their caches.
        step_timeout_s: most seconds one message may take on a rank before the engine gives up.

    Raises:
        WorkerError: a rank failed to start (its traceback in the message) or exited without a reply;
            :class:`WorkerInputError` (also a ``ValueError``; the rank's message) where the rank
            raised a ``ValueError`` / ``TypeError`` (e.g. a checkpoint or config error).
        RuntimeError: called at import time of a main script without ``if __name__ == "__main__":``
            (:func:`~mtpspec.distributed.launcher.check_main_guard`; nothing is spawned).
        KeyboardInterrupt: Ctrl-C while the ranks start (they ignore SIGINT, so they print nothing
            of it): they are ended (SIGTERM) first.
    """

    def __init__(self, cfg: EngineConfig, world_size: int, start_timeout_s: float = 600.0,
                 step_timeout_s: float = 600.0):
        from mtpspec.distributed.launcher import check_main_guard
        check_main_guard(f"tensor_parallel_size={world_size} spawns its ranks as new processes")
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // world_size)
        self.step_timeout_s = step_timeout_s

        def start(port: int) -> List[Any]:
            self.conns, self.procs = [], []
            self._closed = False
            self._owed: List[int] = []  # ranks whose reply to the last message is still unread
            try:
                for rank in range(world_size):
                    parent, child = ctx.Pipe()
                    p = ctx.Process(target=spawned_worker_main, args=(rank, world_size, port, cfg, child, threads),
                                    daemon=True)
                    # the rank starts with SIGINT blocked until spawned_worker_main ignores it: a Ctrl-C while it
                    # still imports printed its traceback; and a started rank is always one shutdown ends
                    with sigint_held_for_spawn():
                        p.start()
                        self.conns.append(parent)
                        self.procs.append(p)
                    child.close()
                return self._recv_all(start_timeout_s)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):  # the ranks ignore SIGINT and would load on: end them now
                    for p in self.procs:
                        p.terminate()
                self.shutdown()
                raise

        ready = start_on_free_port(start, lambda exc: isinstance(exc, WorkerError) and _restartable(exc))
        self.num_kv_blocks = int(ready[0])

    def _recv_all(self, timeout_s: float, grace_s: float = 2.0) -> List[Any]:
        """Every rank's reply (the start-up's ``ready``), in rank order, read as they come: the first
        error or death of any rank raises (:meth:`_recv`'s errors) without waiting for the ranks
        before it, which may wait in a collective for the failed rank until its timeout. A lower
        rank that fails too within ``grace_s`` seconds is reported instead (ranks that fail alike,
        e.g. on one checkpoint, report rank 0's error, as when the ranks were read in order)."""
        deadline = time.monotonic() + timeout_s
        replies: dict = {}
        while len(replies) < len(self.conns):
            pending = [r for r in range(len(self.conns)) if r not in replies]
            wait_for_any([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], timeout=0.2)
            for r in pending:
                if self.conns[r].poll() or not self.procs[r].is_alive():
                    try:
                        replies[r] = self._recv(r, timeout_s)
                    except WorkerError as exc:
                        raise self._lowest_failure(r, exc, replies, grace_s) from None
            if len(replies) < len(self.conns) and time.monotonic() > deadline:
                late = [r for r in range(len(self.conns)) if r not in replies]
                raise WorkerError(f"rank {late[0]} did not reply within {timeout_s:.0f} s", rank=late[0])
        return [replies[r] for r in range(len(self.conns))]

    def _lowest_failure(self, rank: int, exc: WorkerError, replies: dict, grace_s: float) -> WorkerError:
        """``exc`` (rank ``rank``'s failure), or that of the lowest rank before it that replies with
        an error or dies within ``grace_s`` seconds (its reply, if any, goes into ``replies``), unless
        ``exc`` is an input error and the lower one is not: a rank that fails alone (its KV cache does
        not fit, say) closes the process group, and the ranks waiting in a collective with it then
        fail with a connection error, which must not hide the cause."""
        deadline = time.monotonic() + grace_s
        for r in range(rank):
            if r in replies:
                continue
            conn, proc = self.conns[r], self.procs[r]
            while time.monotonic() < deadline and proc.is_alive() and not conn.poll(0.05):
                pass
            if conn.poll() or not proc.is_alive():
                try:
                    replies[r] = self._recv(r, grace_s)
                except WorkerError as lower:
                    if isinstance(lower, WorkerInputError) or not isinstance(exc, WorkerInputError):
                        return lower
        return exc

    def _recv(self, rank: int, timeout_s: float) -> Any:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.05):
            if not proc.is_alive():
                if conn.poll(0.5):
                    break
                raise WorkerError(f"rank {rank} died ({exit_text(proc.exitcode)}) without a reply" + main_guard_hint(),
                                  rank=rank)
            if time.monotonic() > deadline:
                raise WorkerError(f"rank {rank} did not reply within {timeout_s:.0f} s", rank=rank)
        with sigint_held():  # a reply is read whole and struck off _owed, or not at all
            try:
                kind, payload = conn.recv()
            except EOFError:  # the rank closed its pipe (exited) without a reply
                proc.join(timeout=5)
                code = proc.exitcode
                if code is not None and code < 0:  # killed by a signal: it wrote nothing about it
                    raise WorkerError(f"rank {rank} died ({exit_text(code)}) without a reply", rank=rank) from None
                raise WorkerError(f"rank {rank} exited ({exit_text(code)}) without a reply; its output "
                                  "above says why" + main_guard_hint(), rank=rank) from None
            if self._owed and self._owed[0] == rank:
                self._owed.pop(0)
        if kind == "err":
            raise rank_error(rank, payload)
        return payload

    def _broadcast(self, msg: tuple) -> List[Any]:
        """Send ``msg`` to every rank and read every reply. A ``KeyboardInterrupt`` while the replies
        are awaited leaves the executor usable: the ranks (which ignore SIGINT) finish the message,
        and their replies are read and dropped before the next one (:attr:`_owed`). SIGINT is held
        off while the message is sent and while a reply is read (:func:`sigint_held`), so the ranks
        never disagree on what they got and a reply is never half read. Any other error shuts the
        ranks down."""
        if self._closed:
            raise WorkerError("the executor was shut down")
        try:
            while self._owed:  # replies of an interrupted message, in rank order (_recv strikes them off)
                self._recv(self._owed[0], self.step_timeout_s)
            with sigint_held():  # every rank gets the message, or none
                for c in self.conns:
                    c.send(msg)
                self._owed = list(range(len(self.conns)))
            return [self._recv(r, self.step_timeout_s) for r in range(len(self.conns))]
        except KeyboardInterrupt:  # the ranks finish the message; its replies stay owed (see above)
            raise
        except BaseException as exc:
            dead_ranks = self._dead()
            dead = ", ".join(self._death(r) for r in dead_ranks)
            self.shutdown()
            if isinstance(exc, WorkerError) and exc.rank is not None and dead_ranks == [exc.rank]:
                raise  # exc is already the one dead rank's own report
            if dead and isinstance(exc, WorkerError) and not isinstance(exc, WorkerInputError):
                # another rank's death surfaces as a collective error on the survivors: name the dead one
                err = WorkerError(f"{dead}; {exc.summary}")
                err.rank_traceback = exc.rank_traceback
                raise err from exc
            if isinstance(exc, (OSError, EOFError)):  # a rank's pipe broke (sending to a dead rank)
                raise WorkerError(f"{dead or 'a rank is gone'}; its pipe broke: {type(exc).__name__}: {exc}") from exc
            raise

    def _dead(self) -> List[int]:
        """The ranks whose process exited (none once shut down: its ranks exited on purpose)."""
        if self._closed:
            return []
        return [r for r, p in enumerate(self.procs) if not p.is_alive() and p.exitcode is not None]

    def _death(self, rank: int) -> str:
        return f"rank {rank} died ({exit_text(self.procs[rank].exitcode)})"

    def dead_ranks(self) -> str:
        return ", ".join(self._death(r) for r in self._dead())

    def execute(self, step: StepInput) -> StepOutput:
        return self._broadcast(("step", step))[0]

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        return self._broadcast(("rpc", fn, args))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive():
                    c.send(("stop",))
            except Exception:
                pass
        # Closed before the joins: a rank still finishing an interrupted message reads "stop" after it,
        # and its reply (nobody reads it) meets a closed pipe and it exits instead of blocking.
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.join(timeout=SHUTDOWN_JOIN_S)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():  # a stopped (SIGSTOP) or otherwise frozen rank outlives SIGTERM; at exit
                p.kill()      # multiprocessing would join it without a timeout: the command never ended
                p.join(timeout=5)


def make_executor(cfg: EngineConfig, tensor_parallel_size: Optional[int] = None) -> Executor:
    """In-process for tp 1 and under ``torchrun`` (``WORLD_SIZE`` set: every rank builds one; rank 0
    broadcasts, the others serve :func:`~mtpspec.engine.worker.follower_loop`); spawned ranks otherwise.

    Raises:
        ValueError: under ``torchrun`` with ``WORLD_SIZE`` different from ``tensor_parallel_size``
            (default ``cfg.parallel_config.tensor_parallel_size``).
    """
    if tensor_parallel_size is None:
        tensor_parallel_size = cfg.parallel_config.tensor_parallel_size
    from mtpspec.distributed.launcher import torchrun_world
    world = torchrun_world()
    if world:
        if world != tensor_parallel_size:
            raise ValueError(f"under torchrun WORLD_SIZE={world} but tensor_parallel_size={tensor_parallel_size}")
        from mtpspec.distributed import get_tp_group, init_distributed_environment
        if get_tp_group().world_size != world:
            init_distributed_environment()
        return InProcessExecutor(cfg, broadcast=True)
    if tensor_parallel_size == 1:
        return InProcessExecutor(cfg)
    return MultiprocExecutor(cfg, tensor_parallel_size)

