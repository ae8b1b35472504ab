"""Benchmark greedy draft tokens: local argmax (``get_top_tokens``) vs ``compute_logits(...).argmax(-1)``.

Part 1, time (GPU; CPU in ``--smoke``): vocab 151552, bf16, hidden 4096 / 6144, tokens 1 / 64, for
* the full vocab on one rank (tp 1): ``LogitsProcessor.get_top_tokens`` (Triton ``local_argmax``,
  1-2 launches) vs ``LogitsProcessor.compute_logits(...).argmax(-1)`` (at tp 1 the collectives are
  no-ops);
* the one-eighth shard a rank holds at tp 8 (18944 rows), simulated in one process:
  local matmul + ``local_top_pairs`` (Triton, 1-2 launches) + ``pick_top_tokens`` (Triton, 1
  launch) on a ``[8, T, 2]`` pair stack, vs local matmul + ``argmax`` over a ``[T, 151552]`` buffer
  standing for the gathered logits. Communication is not timed here (part 2 counts its bytes).
Column "torch ref" is the same local path with the torch references (``local_top_pairs_ref`` +
``pick_top_tokens_ref``: argmax, gather, float64 stack, ~12 small kernels for the pick), i.e. the
implementation before the Triton kernels; "ref/kern" is its time over the kernel path's.
Before timing, the kernels are checked on the device against ``torch.argmax`` (ties, NaN, +-inf,
padding, ids above 2**24, shards long enough to be split into column chunks) and against the
references. Each path is then timed eagerly (CUDA events, median of repeats) and, on CUDA, inside
a CUDA graph (launch overhead removed; capturing also proves the path is graph-safe). "reduce"
times the reduction without the matmul (kernel: ``local_argmax`` at tp 1, ``local_top_pairs`` at
tp 8). ``chunks``: column chunks per row of the kernel's split (1: one launch).

Part 2, bytes (CPU gloo ranks, small hidden): per-rank bytes sent by the collectives of one draft
step at 64 sequences, vocab 151552, bf16 logits, tp 2 / 4 / 8, read from ``comm_stats()``:
full-logits all-gather vs the ``[64, 2]`` float64 pair all-gather, and their ratio.

``--smoke`` runs tiny shapes on CPU; without a GPU it sets ``TRITON_INTERPRET=1`` (before triton is
imported) so the kernel path runs in Triton's interpreter.

Usage: ``python3 benchmarks/bench_top_tokens.py [--smoke] [--no-bytes] [--no-time] [--out r.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv[1:] and not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels in Triton's interpreter on CPU

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mtpspec.distributed import comm_stats, launch, reset_comm_stats  # noqa: E402
from mtpspec.layers import LogitsProcessor, ParallelLMHead  # noqa: E402
from mtpspec.layers.vocab_parallel_embedding import pad_vocab_size  # noqa: E402
from mtpspec.ops.argmax import (local_argmax, local_top_pairs, local_top_pairs_ref, num_sms,  # noqa: E402
                                pick_top_tokens, pick_top_tokens_ref, split_plan)
from mtpspec.ops.triton_utils import use_triton  # noqa: E402

VOCAB = 151552
HIDDEN_SIZES = [4096, 6144]
TOKEN_COUNTS = [1, 64]
BYTES_TP = [2, 4, 8]
BYTES_TOKENS = 64


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny timing shapes on CPU (byte counts stay full size)")
    p.add_argument("--no-bytes", action="store_true", help="skip the gloo byte count")
    p.add_argument("--no-time", action="store_true", help="skip the timing part")
    p.add_argument("--out", help="write results as JSON to this path")
    return p.parse_args(argv)


class Timer:
    """Median time per call in microseconds: CUDA events (+ CUDA graphs) on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, iters: int, repeats: int) -> None:
        self.cuda = device.type == "cuda"
        self.iters, self.repeats = iters, repeats

    def eager_us(self, fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(self.repeats):
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e6 / self.iters)
        return statistics.median(samples)

    def graph_us(self, fn: Callable[[], Any]) -> Optional[float]:
        if not self.cuda:
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / self.iters)
        return statistics.median(samples)


def _same_pairs(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return bool(torch.equal(a[:, 1], b[:, 1]) and torch.equal(a[:, 0].isnan(), b[:, 0].isnan())
                and torch.equal(a[:, 0].nan_to_num(0.5), b[:, 0].nan_to_num(0.5)))


def check_contract(device: torch.device, cases: int = 200) -> int:
    """On ``device``: the kernel path == the torch references == ``torch.argmax`` (device and CPU).

    Part 1: simulated shards (ties, NaN, +-inf, padding holding would-be winners), all dtypes,
    tp 1..8, ``local_top_pairs`` + ``pick_top_tokens`` and ``local_argmax`` vs ``torch.argmax``.
    Part 2 (CUDA only, or 3 cases off it): long shards (split into column chunks) with ties across
    chunk boundaries, NaN after +inf, all -inf rows, ids above 2**24. Guards the assumption that
    ``torch.argmax`` on this device returns the first maximum and the first NaN. Returns the number
    of cases checked; raises ``AssertionError`` on a mismatch.
    """
    g = torch.Generator().manual_seed(2)
    alphabet = torch.tensor([float("-inf"), float("inf"), float("nan"), -1.0, 0.0, 1.0, 2.0])
    for i in range(cases):
        tp = 1 + i % 8
        v = int(torch.randint(1, 600, (1,), generator=g))
        t = int(torch.randint(0, 5, (1,), generator=g))
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        logits = alphabet[torch.randint(0, len(alphabet), (t, v), generator=g)].to(dtype)
        per = pad_vocab_size(v, tp) // tp
        padded = torch.full((t, per * tp), float("inf") if i % 2 else float("nan"), dtype=dtype)
        padded[:, :v] = logits
        padded = padded.to(device)
        shards = [(padded[:, r * per:(r + 1) * per], r * per, max(0, min(v - r * per, per))) for r in range(tp)]
        pairs = torch.stack([local_top_pairs(*sh) for sh in shards])
        ref_pairs = torch.stack([local_top_pairs_ref(*sh) for sh in shards])
        for r in range(tp):
            assert _same_pairs(pairs[r], ref_pairs[r]), f"local_top_pairs != ref (tp {tp}, rank {r}, {dtype})"
        got = pick_top_tokens(pairs).cpu()
        ref_dev = torch.argmax(logits.to(device), dim=-1).cpu()
        ref_cpu = torch.argmax(logits, dim=-1)
        assert torch.equal(ref_dev, ref_cpu), f"torch.argmax on {device} differs from CPU: {logits}"
        assert torch.equal(got, ref_cpu), f"pick != torch.argmax (tp {tp}, {dtype}): {logits}"
        assert torch.equal(pick_top_tokens_ref(ref_pairs).cpu(), ref_cpu), "pick_top_tokens_ref"
        assert torch.equal(local_argmax(*shards[0]).cpu(), torch.argmax(logits[:, :shards[0][2]], -1)
                           if shards[0][2] else torch.full((t,), -1)), f"local_argmax (tp {tp}, {dtype})"
    long_cases = [(151552, 1), (151552, 3), (18944, 1), (18944, 64), (75776, 5)]
    if device.type != "cuda":
        long_cases = [(5000, 1), (5000, 3), (2100, 2)]
    start = 2**24 + 1
    for j, (v, t) in enumerate(long_cases):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(t, v, generator=g) * 2).round().to(dtype)  # many ties
            c = min(split_plan(t, v - 3, num_sms(device)).chunk, v - 4)
            x[0, c - 1] = x[0, c] = 100.0  # tie across the first chunk boundary
            if t > 1:
                x[1, 7] = float("inf")
                x[1, min(c + 5, v - 4)] = x[1, v - 4] = float("nan")
            if t > 2:
                x[2] = float("-inf")
            x[:, v - 3:] = float("inf")  # padding: would win if read
            x = x.to(device)
            want = torch.argmax(x[:, :v - 3], dim=-1)
            pairs = local_top_pairs(x, start, v - 3)
            assert _same_pairs(pairs, local_top_pairs_ref(x, start, v - 3)), f"long shard {v} {dtype}"
            assert torch.equal(pairs[:, 1].long().cpu(), (want + start).cpu()), f"long shard {v} {dtype}"
            assert torch.equal(local_argmax(x, 0, v - 3), want), f"local_argmax long shard {v} {dtype}"
            assert torch.equal(pick_top_tokens(pairs.unsqueeze(0)).cpu(), (want + start).cpu())
    return cases + 3 * len(long_cases)


def time_configs(smoke: bool) -> List[Dict[str, Any]]:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    vocab, hiddens, counts = (VOCAB, HIDDEN_SIZES, TOKEN_COUNTS) if not smoke else (1000, [64], [1, 4])
    timer = Timer(device, iters=20 if device.type == "cuda" else 5, repeats=7 if device.type == "cuda" else 3)
    dtype = torch.bfloat16
    rows: List[Dict[str, Any]] = []
    g = torch.Generator(device=device).manual_seed(0)
    for hidden in hiddens:
        for shard in ("full (tp 1)", "1/8 (tp 8)"):
            tp = 1 if shard.startswith("full") else 8
            per = pad_vocab_size(vocab, tp) // tp
            start = (tp - 1) * per if tp > 1 else 0  # the last rank: real rows < per (padding inside)
            num_real = min(vocab - start, per)
            w = torch.randn(per, hidden, generator=g, device=device).to(dtype)
            head = lp = None
            if tp == 1:
                with device:
                    head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
                head.weight.data.copy_(w[:head.num_embeddings_per_partition])
                lp = LogitsProcessor(vocab)
            for n in counts:
                h = torch.randn(n, hidden, generator=g, device=device).to(dtype)
                full_buf = torch.randn(n, per * tp, generator=g, device=device).to(dtype)
                other = torch.randn(tp - 1, n, 2, generator=g, device=device, dtype=torch.float64)
                other[..., 1] = -1.0  # other ranks' pairs: sentinels (values only matter for speed)

                if tp == 1:
                    def local_path() -> torch.Tensor:
                        return lp.get_top_tokens(head, h)

                    def ref_path() -> torch.Tensor:  # get_top_tokens before the kernels
                        pairs = local_top_pairs_ref(F.linear(h, head.weight), 0, num_real)
                        return pick_top_tokens_ref(pairs.unsqueeze(0))

                    def full_path() -> torch.Tensor:
                        return lp.compute_logits(head, h).argmax(-1)
                else:
                    def local_path() -> torch.Tensor:
                        pairs = local_top_pairs(F.linear(h, w), start, num_real)
                        return pick_top_tokens(torch.cat([other, pairs.unsqueeze(0)]))

                    def ref_path() -> torch.Tensor:
                        pairs = local_top_pairs_ref(F.linear(h, w), start, num_real)
                        return pick_top_tokens_ref(torch.cat([other, pairs.unsqueeze(0)]))

                    def full_path() -> torch.Tensor:
                        full_buf[:, start:start + per].copy_(F.linear(h, w))  # this rank's part of the gather
                        return full_buf[:, :vocab].argmax(-1)
                local_logits = F.linear(h, w)
                full_view = full_buf[:, :vocab]

                def local_reduce() -> torch.Tensor:
                    if tp == 1:
                        return local_argmax(local_logits, start, num_real)
                    return local_top_pairs(local_logits, start, num_real)

                def ref_reduce() -> torch.Tensor:
                    return local_top_pairs_ref(local_logits, start, num_real)

                def full_reduce() -> torch.Tensor:
                    return full_view.argmax(-1)

                a, r, b = local_path(), ref_path(), full_path()
                assert torch.equal(a, r), (hidden, shard, n)
                if tp == 1:
                    assert torch.equal(a, b), (hidden, shard, n)
                else:  # the shard's own winner must agree with an argmax over its real columns
                    assert torch.equal(a, local_logits[:, :num_real].argmax(-1) + start), (hidden, shard, n)
                row: Dict[str, Any] = dict(hidden=hidden, shard=shard, tokens=n, rows=per, device=device.type,
                                           kernels=use_triton(local_logits),
                                           chunks=split_plan(n, num_real, num_sms(device)).n_chunks)
                for name, fn in (("local", local_path), ("ref", ref_path), ("full", full_path),
                                 ("local_reduce", local_reduce), ("ref_reduce", ref_reduce),
                                 ("full_reduce", full_reduce)):
                    row[f"{name}_us"] = timer.eager_us(fn)
                    row[f"{name}_graph_us"] = timer.graph_us(fn) if name in ("local", "ref", "full") else None
                rows.append(row)
    return rows


def _bytes_rank(vocab: int, hidden: int, n: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, torch.randn(vocab, hidden, generator=g))
    h = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    lp = LogitsProcessor(vocab)
    reset_comm_stats()
    logits = lp.compute_logits(head, h)
    full = comm_stats()
    reset_comm_stats()
    top = lp.get_top_tokens(head, h)
    pairs = comm_stats()
    return dict(full=full, pairs=pairs, agree=bool(torch.equal(top, logits.argmax(-1))),
                per=head.num_embeddings_per_partition)


def count_bytes() -> List[Dict[str, Any]]:
    rows = []
    for tp in BYTES_TP:
        res = launch(_bytes_rank, tp, VOCAB, 8, BYTES_TOKENS, backend="gloo")
        full = [r["full"]["all_gather"] for r in res]
        pairs = [r["pairs"]["all_gather"] for r in res]
        assert all(r["agree"] for r in res), f"tp {tp}: get_top_tokens != argmax(compute_logits)"
        assert all(set(r["pairs"]) == {"all_gather"} and p["calls"] == 1 for r, p in zip(res, pairs))
        rows.append(dict(tp=tp, per_rank=res[0]["per"], tokens=BYTES_TOKENS,
                         full_bytes_per_rank=full[0]["bytes_sent"], pair_bytes_per_rank=pairs[0]["bytes_sent"],
                         full_bytes_all_ranks=sum(f["bytes_sent"] for f in full),
                         pair_bytes_all_ranks=sum(p["bytes_sent"] for p in pairs),
                         ratio=pairs[0]["bytes_sent"] / full[0]["bytes_sent"]))
    return rows


def _fmt(v: Optional[float]) -> str:
    return f"{'-':>9}" if v is None else f"{v:9.1f}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    out: Dict[str, Any] = {"torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if not args.no_time:
        dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        out["contract_cases"] = check_contract(dev, cases=200 if dev.type == "cuda" else 40)
        out["time"] = time_configs(args.smoke)
    if not args.no_bytes:
        out["bytes"] = count_bytes()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    print(f"\ntorch {out['torch']} on {out['device']}")
    if "time" in out:
        print(f"argmax contract (ties, NaN, +-inf, padding) checked on {out['device']}: "
              f"{out['contract_cases']} cases ok")
        kern = "Triton kernels" if all(r["kernels"] for r in out["time"]) else "torch references (no kernels here)"
        print(f"\nGreedy token time per call, us (eager | CUDA graph); local = kernel path ({kern}),"
              " torch ref = the same path on the torch references, full = argmax of the full logits;"
              " reduce = reduction only, no matmul")
        print(f"{'hidden':>6} {'shard':>12} {'T':>3} {'rows':>7} {'chunks':>6} | {'local':>9} {'torch ref':>9} "
              f"{'full':>9} {'ref/kern':>8} {'full/kern':>9} | {'local g':>9} {'ref g':>9} {'full g':>9} | "
              f"{'red kern':>9} {'red ref':>9} {'red full':>9}")
        for r in out["time"]:
            print(f"{r['hidden']:>6} {r['shard']:>12} {r['tokens']:>3} {r['rows']:>7} {r['chunks']:>6} | "
                  f"{_fmt(r['local_us'])} {_fmt(r['ref_us'])} {_fmt(r['full_us'])} "
                  f"{r['ref_us'] / r['local_us']:8.2f} {r['full_us'] / r['local_us']:9.2f} | "
                  f"{_fmt(r['local_graph_us'])} {_fmt(r['ref_graph_us'])} {_fmt(r['full_graph_us'])} | "
                  f"{_fmt(r['local_reduce_us'])} {_fmt(r['ref_reduce_us'])} {_fmt(r['full_reduce_us'])}")
    if "bytes" in out:
        print(f"\nBytes sent per rank, one draft step, {BYTES_TOKENS} sequences, vocab {VOCAB}, bf16 logits")
        print(f"{'tp':>3} {'rows/rank':>9} | {'full logits':>12} {'pairs':>8} {'ratio':>9} | "
              f"{'all ranks: full':>15} {'pairs':>8}")
        for r in out["bytes"]:
            print(f"{r['tp']:>3} {r['per_rank']:>9} | {r['full_bytes_per_rank']:>12} {r['pair_bytes_per_rank']:>8} "
                  f"{100 * r['ratio']:8.4f}% | {r['full_bytes_all_ranks']:>15} {r['pair_bytes_all_ranks']:>8}")


if __name__ == "__main__":
    main()
