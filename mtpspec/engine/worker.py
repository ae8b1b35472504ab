"""Building a rank's :class:`ModelRunner` and the per-rank step loops.

Three ways ranks receive steps, one runner:

* tp 1: the runner lives in the engine's process (:class:`~mtpspec.engine.executor.InProcessExecutor`).
* self-launched tp > 1: persistent spawned worker processes read steps from a pipe and
  acknowledge each one (:func:`spawned_worker_main`).
* ``torchrun``: every process is a rank; rank 0 schedules and broadcasts each step with
  ``broadcast_object_list`` over a CPU (gloo) group (:func:`follower_loop` on the others).
"""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mtpspec.engine.config import EngineConfig
from mtpspec.engine.gc_heap import freeze_gc_heap
from mtpspec.engine.model_runner import ModelRunner


def resolve_device(device: Optional[str]) -> torch.device:
    """This rank's device: the TP group's device for CUDA, else CPU."""
    from mtpspec.distributed import get_tp_group
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda"):
        g = get_tp_group().device
        return g if g.type == "cuda" else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(want)


def p2p_capacity_bytes(cfg: EngineConfig, dtype: torch.dtype) -> int:
    """Capacity of the engine's p2p all-reduce backend: the MTP first pass of a full decode batch,
    ``max_num_seqs * (1 + k) * hidden_size * element_size`` bytes, at most
    :data:`~mtpspec.distributed.allreduce_rms_norm.DEFAULT_P2P_CAPACITY_BYTES` (larger calls,
    e.g. prefills, take the NCCL fallback)."""
    from mtpspec.distributed.allreduce_rms_norm import DEFAULT_P2P_CAPACITY_BYTES
    sched = cfg.scheduler_config
    need = sched.max_num_seqs * sched.decode_query_len * cfg.model_config.hidden_size * dtype.itemsize
    return max(1, min(need, DEFAULT_P2P_CAPACITY_BYTES))


def build_runner(cfg: EngineConfig) -> ModelRunner:
    """Load this rank's shards of the target (and MTP) model, select this rank's fused
    all-reduce + RMSNorm backend (``cfg.parallel_config.allreduce_backend``; a collective at
    tp > 1 for ``"p2p"``) and wrap the models in a runner.

    Raises:
        LocalArgmaxUnsupportedError, ModelConfigError, CheckpointError: see their docs.
        ValueError: ``"p2p"`` on a device it cannot run on (the message says which it needs).
    """
    from mtpspec.distributed.allreduce_rms_norm import init_allreduce_rms_norm_backend
    from mtpspec.models.loader import load_models
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    par = cfg.parallel_config
    target, mtp = load_models(cfg.model, dtype=cfg.dtype, device=device, load_mtp=cfg.speculative_config is not None,
                              fuse_allreduce_rmsnorm=par.fuse_allreduce_rmsnorm,
                              sequence_parallel=par.sequence_parallel, load_format=cfg.load_format,
                              fuse_shared_experts=not cfg.disable_shared_experts_fusion)
    act_dtype = target.get_input_embeddings().weight.dtype
    init_allreduce_rms_norm_backend(par.allreduce_backend, p2p_capacity_bytes(cfg, act_dtype), device)
    return ModelRunner(target, mtp, cfg.speculative_config, cfg.cache_config, cfg.scheduler_config, device,
                       target.config.max_position_embeddings, cfg.graph_mode)


def init_cache_min_over_ranks(runner: ModelRunner) -> int:
    """Profile, take the minimum block count over the TP ranks, allocate; returns the count."""
    from mtpspec.distributed import get_tp_group
    n = runner.profile_and_count_blocks()
    g = get_tp_group()
    if g.world_size > 1:
        t = torch.tensor([n], dtype=torch.int64, device=runner.device if g.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.device_group)
        n = int(t.item())
    runner.init_kv_cache(n)
    return n


def cpu_group() -> Any:
    """A group for pickled control messages: the TP group itself under gloo, else a new gloo group.

    Must be called by every rank at the same point (it may create a group).
    """
    from mtpspec.distributed import get_tp_group
    g = get_tp_group()
    return g.device_group if g.backend == "gloo" else dist.new_group(backend="gloo")


def handle_message(runner: ModelRunner, msg: tuple) -> Any:
    """Execute one control message on this rank: ``("step", StepInput)`` or ``("rpc", fn, args)``."""
    if msg[0] == "step":
        return runner.execute_model(msg[1])
    if msg[0] == "rpc":
        fn: Callable[..., Any] = msg[1]
        return fn(runner, *msg[2])
    raise ValueError(f"unknown worker message {msg[0]!r}")


def follower_loop(runner: ModelRunner, group: Any) -> Any:
    """Ranks > 0 under ``torchrun``: execute broadcast messages until rank 0 says ``done``/``stop``.

    Returns the payload of ``("done", payload)`` or ``None`` for ``("stop",)``.
    """
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        msg = box[0]
        if msg[0] == "done":
            return msg[1]
        if msg[0] == "stop":
            return None
        handle_message(runner, msg)


def spawned_worker_main(rank: int, world_size: int, port: int, cfg: EngineConfig, conn: Any, threads: int) -> None:
    """Entry point of a self-launched rank: set up, report ``("ready", num_blocks)``, then serve.

    Replies to every message: rank 0 with the result, the others with ``("ok", None)`` (an
    acknowledgement; rpc results come back from every rank). SIGINT is ignored (the driver's to
    handle: :class:`~mtpspec.engine.executor.MultiprocExecutor`; it was blocked from the process's start
    (:func:`~mtpspec.engine.executor.sigint_held`), and is unblocked here). Any exception is sent back as
    ``("err", {"traceback", "message", "input_error"})`` (``input_error``: a ``ValueError``
    / ``TypeError``, e.g. a bad checkpoint or config, which the driver re-raises as a
    :class:`~mtpspec.engine.executor.WorkerInputError`) and ends the worker.
    """
    # A terminal's Ctrl-C reaches the whole process group: the driver decides (it stops waiting for
    # the step and aborts its requests, or shuts the ranks down); a rank dying here would take the
    # engine with it. A driver that is gone closes the pipe, which ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since the start (sigint_held); a pending one is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from mtpspec.distributed import destroy_distributed_environment, init_distributed_environment
    try:
        backend = "nccl" if (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") \
            and torch.cuda.device_count() >= world_size else "gloo"
        init_distributed_environment(world_size, rank, rank, backend=backend)
        runner = build_runner(cfg)
        conn.send(("ready", init_cache_min_over_ranks(runner)))
        freeze_gc_heap()  # the rank's model, caches and graphs out of the collector's passes (gc_heap)
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            result = handle_message(runner, msg)
            conn.send(("ok", result if (rank == 0 or msg[0] == "rpc") else None))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver
        try:
            conn.send(("err", {"traceback": traceback.format_exc(), "message": str(exc),
                               "input_error": isinstance(exc, (ValueError, TypeError))}))
        except Exception:
            pass
    finally:
        try:
            from mtpspec.distributed.allreduce_rms_norm import close_allreduce_rms_norm_backend
            close_allreduce_rms_norm_backend()
        except Exception:
            pass
        try:
            destroy_distributed_environment()
        except Exception:
            pass
