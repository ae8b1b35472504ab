"""Benchmark the MLA decode / verify kernel over a paged latent cache against its roofline floor.

Workload (issue 14): ``--seqs`` sequences (64) of ``--context`` tokens (8192) each already in a
paged latent cache ``[blocks, --block-size, kv_lora_rank + rope]`` (bf16, blocks shuffled), with
1 and 4 (= 1 + k) query tokens per sequence (the last ``q`` positions of the context), 16 heads
(DeepSeek-V3 at tp 8) and 128 heads (tp 1), kv_lora_rank 512 + rope 64. Per configuration:

* ``kernel_ms``: :func:`mtpspec.ops.mla_attention.mla_attention` (attention + split combine; the
  KV write is not included), median CUDA-graph replay, each synchronised (``kernel_queued_ms``:
  the mean of replays queued back to back, the launch latency hidden); checked first against the torch
  reference on the first sequences (``max_abs_err``).
* floor: ``max(latent cache bytes (+ queries and outputs) / read bandwidth, FLOPs / bf16 matmul
  rate)``, both measured in this run. Read bandwidth: the larger of a 4 GiB ``x.sum()``
  (benchmarks/_timing.read_bandwidth) and a 4 GiB device copy's read rate (bytes / time);
  matmul rate: a bf16 8192^3 ``torch.mm``. FLOPs: ``2 * heads * (512 + 64 + 512)`` per
  (query, key) pair of each query's causal context. ``x_floor = kernel_ms / floor_ms`` (the
  issue's goal: <= 1.25).
* side by side: ``sdpa_expanded_ms``, SDPA over K/V expanded per head (``[B, H, S, 128 + 64]``
  keys, ``[B, H, S, 128]`` values, dense and pre-expanded: attention only, the expansion
  matmuls not counted; bottom-right causal mask for q > 1), graph replay; and
  ``compile_ref_ms``, ``torch.compile`` of :func:`mla_attention_ref` (the padded torch
  reference) on the same paged cache, graph replay.
* ``--sweep``: the kernel over launch configurations, in two stages (block_m x block_n x warps
  at the default stages / splits, then stages and splits around the fastest); the fastest is
  reported per configuration beside the default's time.

Usage: ``python3 benchmarks/bench_mla_attention.py [--out mla.json] [--sweep] [--no-compile]
[--no-sdpa] [--heads 16,128] [--query-lens 1,4] [--block-size 64]``; ``--smoke`` runs tiny
shapes on the CPU (the kernel under Triton's interpreter, torch.compile with the eager backend)
to prove the script works.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton's interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import Timer, fmt, read_bandwidth  # noqa: E402
import mtpspec.ops.mla_attention as mla  # noqa: E402
from mtpspec.ops import mla_gluon  # noqa: E402
from mtpspec.ops.argmax import num_sms  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence, query tokens included")
    p.add_argument("--query-lens", default="1,4")
    p.add_argument("--heads", default="16,128")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim (expanded path and softmax scale)")
    p.add_argument("--v-head-dim", type=int, default=128, help="(expanded path)")
    p.add_argument("--block-size", type=int, default=64, help="cache block size (MLA models: 64 by default)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the latent cache stored as e4m3 (issue 19; scale 1.0, dequantised in the kernel); "
                        "its bytes counted at 1 per value in the floor")
    p.add_argument("--shared-blocks", type=int, default=0,
                   help="every sequence's block table cycles over the same N cache blocks (N x block size x 1,152 "
                        "bytes: L2-resident for small N), to tell load latency from compute; 0: a random table")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--check-seqs", type=int, default=2, help="sequences checked against the torch reference")
    p.add_argument("--sweep", action="store_true", help="time the kernel over launch configurations")
    p.add_argument("--impls", default="triton,gluon",
                   help="kernels timed side by side (mla_attention's impl=...; 'gluon' where supported; "
                        "'gluon:split' / 'gluon:split-pv' / 'gluon:seesaw' / 'gluon:seesaw-r1' pick the Gluon kernel's dense "
                        "schedule; a suffix '@N' its L2 prefetch distance in key tiles, e.g. 'gluon:split-pv@2')")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter) to test the script")
    a = p.parse_args(argv)
    if a.smoke:
        a.seqs, a.context, a.heads, a.kv_lora_rank, a.rope, a.nope, a.v_head_dim = 2, 40, "2,4", 32, 16, 16, 16
        a.iters, a.check_seqs = 2, 2
    return a


def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def copy_read_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read per second by a device-to-device copy of ``nbytes`` (reads only counted)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = Timer(device, 10).eager(lambda: dst.copy_(src))
    del src, dst
    return nbytes / (ms / 1e3)


def matmul_rate(device: torch.device, n: int) -> float:
    """bf16 FLOP/s of an ``n x n x n`` matmul (fp32 on the CPU)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    ms = Timer(device, 10).eager(lambda: torch.mm(a, b))
    return 2 * n ** 3 / (ms / 1e3)


class Case:
    """One (heads, q) configuration: the paged latent cache and the decode / verify metadata."""

    def __init__(self, a: argparse.Namespace, heads: int, q: int, device: torch.device, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.heads, self.q = heads, q
        b, s, bs = a.seqs, a.context, a.block_size
        self.r, self.rope = a.kv_lora_rank, a.rope
        per_seq = -(-s // bs)
        self.num_blocks = b * per_seq
        perm = torch.randperm(self.num_blocks, generator=g)
        self.block_tables = perm.view(b, per_seq).to(torch.int32).to(device)
        if getattr(a, "shared_blocks", 0):
            n = min(a.shared_blocks, self.num_blocks)
            self.block_tables = (torch.arange(per_seq, dtype=torch.int32, device=device) % n)[None].repeat(b, 1)
        cache_dtype = torch.float8_e4m3fn if getattr(a, "kv_cache_dtype", "auto") == "fp8" else dtype
        self.cache = (torch.randn(self.num_blocks, bs, self.r + self.rope, device=device) * 0.5).to(cache_dtype)
        t = b * q
        self.q_latent = torch.randn(t, heads, self.r, device=device).to(dtype)
        self.q_pe = torch.randn(t, heads, self.rope, device=device).to(dtype)
        self.query_start_loc = torch.arange(0, t + 1, q, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
        self.scale = (a.nope + a.rope) ** -0.5
        self.max_q, self.max_s = q, s
        # traffic and work
        elem = torch.empty((), dtype=dtype).element_size()
        self.latent_bytes = b * s * (self.r + self.rope) * self.cache.element_size()
        self.io_bytes = t * heads * (self.r + self.rope + self.r) * elem
        keys = sum(s - q + j + 1 for j in range(q))  # causal keys per sequence over its q rows
        self.flops = 2 * b * heads * keys * (self.r + self.rope + self.r)
        self.expanded_kv_bytes = b * s * heads * (a.nope + a.rope + a.v_head_dim) * elem

    def args(self) -> tuple:
        return (self.q_latent, self.q_pe, self.cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.scale, self.max_q, self.max_s)

    def kernel(self, **cfg: Any) -> Callable[[], torch.Tensor]:
        return lambda: mla.mla_attention(*self.args(), **cfg)

    def check(self, n: int, **cfg: Any) -> float:
        """Max |kernel - torch reference| over the first ``n`` sequences."""
        n = min(n, self.seq_lens.shape[0])
        rows = n * self.q
        args = (self.q_latent[:rows], self.q_pe[:rows], self.cache, self.query_start_loc[:n + 1], self.seq_lens[:n],
                self.block_tables[:n], self.scale, self.max_q, self.max_s)
        got = mla.mla_attention(*args, **cfg).float()
        ref = mla.mla_attention_ref(*args).float()
        return float((got - ref).abs().max())


def time_graph(timer: Timer, fn: Callable[[], Any]) -> Dict[str, Any]:
    """``{"ms", "queued_ms", "timing"}``: the median of single graph replays, each synchronised (the
    graph launch's latency included: the figure every entry before 2026-12-07's session 44 gives),
    and the mean of replays queued back to back (:meth:`Timer.queued`: that latency hidden, as
    in an engine step); eager calls where capture fails."""
    g, why = timer.capture(fn)
    if g is None:
        return {"ms": timer.eager(fn), "queued_ms": timer.queued(fn), "timing": f"eager ({why})"}
    return {"ms": timer.eager(g.replay), "queued_ms": timer.queued(g.replay), "timing": "graph"}


def sdpa_expanded(a: argparse.Namespace, c: Case, device: torch.device, dtype: torch.dtype,
                  timer: Timer) -> Dict[str, Any]:
    """SDPA over pre-expanded per-head K/V (attention only)."""
    b, h, s, q = a.seqs, c.heads, a.context, c.q
    try:
        qx = torch.randn(b, h, q, a.nope + a.rope, device=device, dtype=dtype)
        kx = torch.randn(b, h, s, a.nope + a.rope, device=device, dtype=dtype)
        vx = torch.randn(b, h, s, a.v_head_dim, device=device, dtype=dtype)
        if q > 1:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(q, s)
        else:
            mask = None
        fn = lambda: F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=c.scale)  # noqa: E731
        out = time_graph(timer, fn)
        out["bytes"] = c.expanded_kv_bytes
        del qx, kx, vx
        return out
    except Exception as exc:  # noqa: BLE001 - report, keep going (e.g. out of memory)
        return {"ms": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def compiled_ref(a: argparse.Namespace, c: Case, timer: Timer) -> Dict[str, Any]:
    """torch.compile of the padded torch reference on the paged cache."""
    try:
        backend = "eager" if a.smoke else "inductor"
        fn_c = torch.compile(mla.mla_attention_ref, backend=backend, dynamic=False)
        args = c.args()
        fn = lambda: fn_c(*args)  # noqa: E731
        err = float((fn().float() - mla.mla_attention_ref(*args).float()).abs().max())
        out = time_graph(timer, fn)
        out["max_abs_err_vs_ref"] = err
        out["backend"] = backend
        return out
    except Exception as exc:  # noqa: BLE001
        return {"ms": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def sweep(c: Case, timer: Timer, smoke: bool) -> List[Dict[str, Any]]:
    """Two stages: tiles, warps and the key-tile read (pointer gathers or bulk tensor copies
    where the cache block holds whole tiles) at the default stages and splits, then stages and
    splits around the fastest of those."""
    pairs = c.q * c.heads
    plan = mla.mla_attention_plan(c.seq_lens.shape[0], c.max_q, c.heads, c.max_s, num_sms(c.cache.device))
    bms = [m for m in (16, 32, 64) if m <= max(16, 1 << (pairs - 1).bit_length())][-2:]
    rows: List[Dict[str, Any]] = []

    def run(cfg: Dict[str, Any]) -> None:
        try:
            fn = c.kernel(**cfg)
            fn()
            rows.append(dict(cfg, ms=time_graph(timer, fn)["ms"]))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
            rows.append(dict(cfg, ms=None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"))

    tmas = [False] + [True for bn in (32, 64) if mla.tma_eligible(c.q_latent, c.cache, bn)][:1]
    stage1 = [(bm, bn, w, tma) for bm, bn, w, tma in itertools.product(bms, (32, 64), (4, 8), tmas)
              if not tma or mla.tma_eligible(c.q_latent, c.cache, bn)]
    for bm, bn, w, tma in (stage1[:2] if smoke else stage1):
        run(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=mla.NUM_STAGES, num_splits=plan["num_splits"],
                 tma=tma))
    ok = [r for r in rows if r.get("ms") is not None]
    if not ok:
        return rows
    best = min(ok, key=lambda r: r["ms"])
    splits = sorted({max(1, plan["num_splits"] // 2), plan["num_splits"] * 2, plan["num_splits"] * 4})
    stage2 = [(st, plan["num_splits"], False) for st in (1, 3)] + [(mla.NUM_STAGES, sp, False) for sp in splits
                                                                     if sp != plan["num_splits"]]
    if best["tma"]:
        stage2.append((mla.NUM_STAGES, plan["num_splits"], True))
    for st, sp, ws in (stage2[:1] if smoke else stage2):
        run(dict(block_m=best["block_m"], block_n=best["block_n"], num_warps=best["num_warps"], num_stages=st,
                 num_splits=sp, tma=best["tma"], warp_specialize=ws))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16
    timer = Timer(device, a.iters, warmup=1 if a.smoke else 3)
    t0 = time.time()
    bw_sum = read_bandwidth(device)
    bw_copy = copy_read_bandwidth(device, (4 << 30) if device.type == "cuda" else (64 << 20))
    bw = max(bw_sum, bw_copy)
    mm = matmul_rate(device, 8192 if device.type == "cuda" else 256)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: read {bw_sum / 1e9:.0f} GB/s "
          f"(x.sum), {bw_copy / 1e9:.0f} GB/s (copy reads); bf16 matmul {mm / 1e12:.1f} TFLOP/s")
    results: List[Dict[str, Any]] = []
    for heads in [int(x) for x in a.heads.split(",")]:
        for q in [int(x) for x in a.query_lens.split(",")]:
            c = Case(a, heads, q, device, dtype)
            plan = mla.mla_attention_plan(a.seqs, q, heads, a.context, num_sms(device))
            row: Dict[str, Any] = dict(heads=heads, q=q, seqs=a.seqs, context=a.context, block_size=a.block_size,
                                       plan=plan, latent_bytes=c.latent_bytes, io_bytes=c.io_bytes, flops=c.flops)
            row["max_abs_err"] = c.check(a.check_seqs)
            k = time_graph(timer, c.kernel())
            row["kernel_ms"], row["kernel_queued_ms"], row["kernel_timing"] = k["ms"], k["queued_ms"], k["timing"]
            mem_ms = (c.latent_bytes + c.io_bytes) / bw * 1e3
            cmp_ms = c.flops / mm * 1e3
            row.update(mem_floor_ms=mem_ms, compute_floor_ms=cmp_ms, floor_ms=max(mem_ms, cmp_ms),
                       bound="memory" if mem_ms >= cmp_ms else "compute")
            row["x_floor"] = row["kernel_ms"] / row["floor_ms"]
            row["kernel_tflops"] = c.flops / (row["kernel_ms"] / 1e3) / 1e12
            row["kernel_gbps"] = (c.latent_bytes + c.io_bytes) / (row["kernel_ms"] / 1e3) / 1e9
            row["impls"] = {}
            for name in [x for x in a.impls.split(",") if x]:
                impl, _, schedule = name.partition(":")  # "gluon:split" / "gluon:seesaw": the dense schedule
                schedule, _, ahead = schedule.partition("@")  # "gluon:split-pv@2": L2 prefetch 2 tiles ahead
                keep, keep_ahead = mla_gluon.DENSE_SCHEDULE, mla_gluon.L2_AHEAD
                try:
                    mla_gluon.DENSE_SCHEDULE = schedule or keep
                    mla_gluon.L2_AHEAD = int(ahead) if ahead else keep_ahead
                    err = c.check(a.check_seqs, impl=impl)
                    tg = time_graph(timer, c.kernel(impl=impl))
                    ms, qms = tg["ms"], tg["queued_ms"]
                    row["impls"][name] = dict(ms=ms, x_floor=ms / row["floor_ms"], queued_ms=qms,
                                              queued_x_floor=qms / row["floor_ms"], max_abs_err=err)
                except Exception as e:  # e.g. gluon on a GPU it does not support
                    row["impls"][name] = dict(error=f"{type(e).__name__}: {e}"[:300])
                finally:
                    mla_gluon.DENSE_SCHEDULE, mla_gluon.L2_AHEAD = keep, keep_ahead
                print(f"  impl {name}: {row['impls'][name]}")
            if a.sweep:
                rows = sweep(c, timer, a.smoke)
                ok = [r for r in rows if r.get("ms") is not None]
                row["sweep"] = rows
                if ok:
                    best = min(ok, key=lambda r: r["ms"])
                    row["sweep_best"] = best
                    row["sweep_best_x_floor"] = best["ms"] / row["floor_ms"]
            if not a.no_sdpa:
                row["sdpa_expanded"] = sdpa_expanded(a, c, device, dtype, timer)
            if not a.no_compile:
                row["compile_ref"] = compiled_ref(a, c, timer)
            del c
            if device.type == "cuda":
                torch.cuda.empty_cache()
            results.append(row)
            print(f"H={heads:4d} q={q}: kernel {fmt(row['kernel_ms'])} ms ({row['kernel_timing']}; queued "
                  f"{fmt(row['kernel_queued_ms'])}), floor "
                  f"{fmt(row['floor_ms'])} ms ({row['bound']}; mem {fmt(mem_ms)}, compute {fmt(cmp_ms)}), "
                  f"x floor {row['x_floor']:.2f}, {row['kernel_gbps']:.0f} GB/s, {row['kernel_tflops']:.1f} TFLOP/s; "
                  f"err {row['max_abs_err']:.2e}; sdpa expanded "
                  f"{fmt((row.get('sdpa_expanded') or {}).get('ms'))} ms; compile ref "
                  f"{fmt((row.get('compile_ref') or {}).get('ms'))} ms"
                  + (f"; sweep best {fmt(row['sweep_best']['ms'])} ms {row['sweep_best']}" if row.get("sweep_best")
                     else ""))
            for key in ("sdpa_expanded", "compile_ref"):
                if (row.get(key) or {}).get("error"):
                    print(f"  {key}: {row[key]['error']}")
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
           "torch": torch.__version__, "commit": git_commit(), "args": vars(a),
           "read_bandwidth_sum": bw_sum, "read_bandwidth_copy": bw_copy, "read_bandwidth": bw,
           "bf16_matmul_flops": mm, "defaults": dict(block_m=mla.BLOCK_M, block_n=mla.BLOCK_N,
                                                     num_warps=mla.NUM_WARPS, num_stages=mla.NUM_STAGES),
           "results": results, "seconds": time.time() - t0}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
