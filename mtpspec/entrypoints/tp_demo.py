"""`mtpspec tp-demo`: one MTP draft step's two collectives, fused vs unfused, on CPU ranks.

Runs on ``--tensor-parallel-size`` (``-tp``, ``--tp``) local gloo ranks (or NCCL GPUs): for ``--num-seqs`` sequences it computes the
draft token ids both ways (full-logits all-gather + argmax, and vocab-parallel local argmax)
and the MTP tail both ways (all-reduce then RMSNorm, and ``fused_allreduce_rms_norm``),
checks that each pair agrees, and prints the bytes each rank sent, from the counters. Logits and
hidden states in ``--dtype`` (default bfloat16, as a served model's; the README's byte figures).
CPU ranks are at most the CPU count unless ``--oversubscribe`` is given (exit 2); a rank that dies
(e.g. killed by the out-of-memory killer) is one ``error: ...`` line, exit 1; a rank's allocation
that fails (sizes too large for memory) is one ``error: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse

import torch

from mtpspec.distributed import (comm_stats, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                 launch, reset_comm_stats)


def _rank_main(num_seqs: int, hidden: int, vocab: int, seed: int, allreduce_backend: str = "nccl",
               dtype: str = "bfloat16"):
    from mtpspec.distributed import tensor_model_parallel_all_reduce
    from mtpspec.layers import LogitsProcessor, ParallelLMHead, RMSNorm
    from mtpspec.distributed.allreduce_rms_norm import (close_allreduce_rms_norm_backend, fused_allreduce_rms_norm,
                                                        init_allreduce_rms_norm_backend)

    dt = getattr(torch, dtype)
    init_allreduce_rms_norm_backend(allreduce_backend, num_seqs * hidden * 4)

    g = torch.Generator().manual_seed(seed)
    head_w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    partials = torch.randn(get_tensor_model_parallel_world_size(), num_seqs, hidden, generator=g).to(dt)
    residual = torch.randn(num_seqs, hidden, generator=g).to(dt)
    lm_head = ParallelLMHead(vocab, hidden, params_dtype=dt)
    lm_head.weight.weight_loader(lm_head.weight, head_w.to(dt))
    norm = RMSNorm(hidden, eps=1e-6).to(dt)
    lp = LogitsProcessor(vocab)
    rank = get_tensor_model_parallel_rank()
    rows = {}

    reset_comm_stats()
    y_unfused, _ = norm(tensor_model_parallel_all_reduce(partials[rank].clone()), residual)
    rows["tail: all_reduce, then RMSNorm"] = comm_stats()
    reset_comm_stats()
    y_fused, _ = fused_allreduce_rms_norm(partials[rank].clone(), residual, norm)
    rows["tail: fused_allreduce_rms_norm"] = comm_stats()
    # both all-reduce in the model dtype; the fused tail's residual add and statistics run in fp32
    tol = 1e-5 if dt == torch.float32 else 3e-2
    tail_equal = torch.allclose(y_unfused.float(), y_fused.float(), rtol=tol, atol=tol)

    reset_comm_stats()
    ids_full = lp.compute_logits(lm_head, y_fused).argmax(-1)
    rows["draft ids: compute_logits + argmax"] = comm_stats()
    reset_comm_stats()
    ids_local = lp.get_top_tokens(lm_head, y_fused)
    rows["draft ids: get_top_tokens"] = comm_stats()
    close_allreduce_rms_norm_backend()
    return rows, tail_equal, bool(torch.equal(ids_full, ids_local))


def add_parser(sub) -> None:
    p = sub.add_parser("tp-demo", help="one draft step's collectives, fused vs unfused, on CPU ranks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, default=2,
                   help="tensor-parallel ranks (default 2)")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences in the draft step (default 64)")
    p.add_argument("--hidden-size", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--vocab-size", type=int, default=151552, help="vocabulary (default 151552, GLM-4.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the hidden states, weights and logits (default bfloat16)")
    p.add_argument("--allreduce-backend", default="nccl", choices=["nccl", "p2p"],
                   help="backend of the fused tail (default nccl; p2p needs GPUs, or TRITON_INTERPRET=1 on CPU)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more CPU ranks than CPUs (each rank is a process of about 0.5 GB; by default -tp is "
                        "at most the CPU count when the ranks run on the CPU)")


def cpu_count() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``)."""
    import os
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _rank_death(exc: RuntimeError) -> str:
    """The launcher's own error (a rank that died without reporting, a timeout) as one line, with
    the signal's name and, for SIGKILL, the likely cause."""
    import re
    import signal
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = re.search(r"exit code (-\d+)", msg)
    if m and -int(m.group(1)) in signal.Signals._value2member_map_:
        sig = signal.Signals(-int(m.group(1)))
        msg += f" ({sig.name}" + (": killed, e.g. by the out-of-memory killer when memory runs out; then use fewer "
                                  "ranks (-tp)" if sig == signal.SIGKILL else "") + ")"
    return msg


def run(args) -> int:
    import sys
    for flag, value in (("--tensor-parallel-size", args.tp), ("--num-seqs", args.num_seqs),
                        ("--hidden-size", args.hidden_size), ("--vocab-size", args.vocab_size)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    from mtpspec.distributed.launcher import RemoteTraceback
    from mtpspec.memory import is_out_of_memory
    from mtpspec.distributed.parallel_state import default_backend
    cpus = cpu_count()
    if default_backend(args.tp) == "gloo" and args.tp > cpus and not args.oversubscribe:
        print(f"error: --tensor-parallel-size {args.tp} would start {args.tp} CPU ranks (processes of about 0.5 GB "
              f"each) on {cpus} CPUs; use at most {cpus}, or pass --oversubscribe", file=sys.stderr)
        return 2
    try:
        results = launch(_rank_main, args.tp, args.num_seqs, args.hidden_size, args.vocab_size, args.seed,
                         args.allreduce_backend, args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc.__cause__, RemoteTraceback):  # a rank's own exception
            if is_out_of_memory(exc):
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                print(f"error: a rank ran out of memory ({first}); lower --vocab-size, --hidden-size or --num-seqs",
                      file=sys.stderr)
                return 2
            raise  # a bug: its traceback says where
        print(f"error: {_rank_death(exc)}", file=sys.stderr)  # a rank died (e.g. killed) or the run timed out
        return 1
    rows, tail_equal, ids_equal = results[0]
    print(f"tp={args.tp}  sequences={args.num_seqs}  hidden={args.hidden_size}  vocab={args.vocab_size}  "
          f"dtype={args.dtype}  "
          f"(bytes rank 0 sent, ring model; see mtpspec/distributed/communication_op.py)")
    print(f"{'path':40s} {'collectives':>28s} {'bytes sent':>12s}")
    for name, stats in rows.items():
        ops = ", ".join(f"{op} x{v['calls']}" for op, v in stats.items()) or "none"
        print(f"{name:40s} {ops:>28s} {sum(v['bytes_sent'] for v in stats.values()):>12,d}")
    full = sum(v["bytes_sent"] for v in rows["draft ids: compute_logits + argmax"].values())
    local = sum(v["bytes_sent"] for v in rows["draft ids: get_top_tokens"].values())
    if full:
        print(f"local argmax sends {local / full:.4%} of the full-logits bytes")
    if args.allreduce_backend == "p2p" and args.tp > 1:
        print("fused tail ran on the p2p backend: peer-memory stores, which the ring-model counters do not count")
    print(f"fused tail equals unfused: {tail_equal}; local-argmax ids equal full argmax: {ids_equal}")
    return 0 if (tail_equal and ids_equal and all(r[1] and r[2] for r in results)) else 1
