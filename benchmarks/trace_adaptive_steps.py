"""What the adaptive policy measures, step by step (issue 18): each step's proposed / verified k, batch,
prompt tokens, wall time as the policy sees it and the device table's prediction.

The adaptive arm of ``bench arms --in-process`` chose ``k = 3`` at 64 sequences although plain decoding was
faster (H200, 2026-12-04): its running measure of what ``k = 0`` steps take beyond the device table was
~3 ms there, against ~0.5 ms for the plain engine's steps. This runs the same kind of workload (random
prompts, forced acceptance, every request queued at once, ``--concurrency`` running) on one engine
(``--engine``: plain, adaptive, the adaptive engine held at one k, fixed k = 3) and records every applied
step (its k, verified drafts, prompt tokens, the gap since the step before and, for the adaptive policy,
the wall it observed, the table's prediction and whether the sample counted); it prints them grouped,
plus each counted ``k = 0`` sample with the steps around it, so the samples that carry an excess can
be told apart::

    PYTHONPATH=$PWD python3 benchmarks/make_dummy_model.py /tmp/air3 --preset air-8l --num-hidden-layers 3 \\
        --max-position-embeddings 2048
    PYTHONPATH=$PWD python3 benchmarks/trace_adaptive_steps.py /tmp/air3 --concurrency 64

``--smoke``: the bundled GLM-4.5 demo model on the CPU, a few prompts (the script's own test).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any, Dict, List


def trace(llm: Any, prompts: List[List[int]], output_len: int, concurrency: int) -> List[Dict[str, Any]]:
    """Run ``prompts`` (token ids) with at most ``concurrency`` running; one dict per applied step
    (``LLMEngine._finish``): batch, proposed ``k``, verified ``v``, prompt tokens, ``gap`` (ms since
    the previous step was applied: the engine's throughput view, any engine), and for an adaptive
    engine what its policy saw (``wall``, the device table's ``predicted`` ms, whether the sample
    was ``counted`` into its per-k host measure)."""
    from mtpspec import SamplingParams
    from mtpspec.spec_decode.adaptive import AdaptiveSpecPolicy
    eng = llm.llm_engine
    policy = getattr(eng, "spec_policy", None)
    rows: List[Dict[str, Any]] = []
    # the adaptive policy's observations (not a stand-in policy's, e.g. bench_adaptive_fixed_k.ConstantK)
    real_finish = eng._finish
    real_observe = policy.observe_step_time if isinstance(policy, AdaptiveSpecPolicy) else None
    last: List[Any] = [None]  # when the previous step was applied
    def caught_up() -> int:  # deferred MTP entries scheduled for catch-up so far (no spec metrics: plain decoding)
        return getattr(eng.metrics.spec, "num_mtp_catch_up_tokens", 0)

    caught = [caught_up()]
    real_choose = eng._choose_k
    host = [0.0, 0.0]  # ms in _choose_k in all, and at the previous applied step (the policy's own host work)

    def choose(out):
        t = time.perf_counter()
        asked = real_observe is not None and bool(out.num_proposed_tokens)  # (else _choose_k asks no policy)
        try:
            return real_choose(out)
        finally:
            host[0] += (time.perf_counter() - t) * 1e3
            # whether its k came from an exploration (a decode burst, a prompt step's re-try); None: not asked
            if asked and not getattr(out, "policy_held", False):
                out.trace_explored = policy.last_choice_explored

    def observed(batch, k, wall_ms, verify_k=None, num_prefill_tokens=0, num_emitted=None, **more):
        v = k if verify_k is None else verify_k
        before = policy.steady_steps
        real_observe(batch, k, wall_ms, verify_k, num_prefill_tokens, num_emitted, **more)
        known = k in policy.costs.verify_ms and v in policy.costs.verify_ms
        # the step applied last (the engine times it when the call applying it returns)
        rows[-1].update(wall=wall_ms, counted=policy.steady_steps != before,
                    predicted=policy.costs.step_ms(batch, k, v) if known else None)

    def finish(out, *args, **kwargs):
        res = real_finish(out, *args, **kwargs)
        now = time.perf_counter()
        rows.append(dict(t=now, batch=len(out.scheduled), k=out.num_proposed_tokens, v=out.num_spec_tokens,
                         prefill=out.num_prefill_tokens, gap=(now - last[0]) * 1e3 if last[0] else None,
                         ahead=eng._inflight is not None, wall=None, predicted=None, counted=None,
                         held=getattr(out, "policy_held", False),  # a held step (any k): not timed for the policy
                         explored=getattr(out, "trace_explored", None),  # k from an exploration (None: not asked)
                         # deferred MTP entries scheduled for catch-up since the previous applied step (counted
                         # when a step is prepared: with a step scheduled ahead, they may be the next row's)
                         catch_up=caught_up() - caught[0],
                         # ms in the engine's _choose_k since the previous applied step (as catch_up: with a
                         # step scheduled ahead, it may be the next row's choice)
                         choose_ms=host[0] - host[1]))
        caught[0], host[1] = caught_up(), host[0]
        last[0] = now
        return res

    sched = eng.scheduler.config
    cap, sched.max_num_seqs = sched.max_num_seqs, concurrency
    eng._finish, eng._choose_k = finish, choose
    if real_observe is not None:
        policy.observe_step_time = observed
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        del eng._finish, eng._choose_k
        if real_observe is not None:
            policy.observe_step_time = real_observe
        sched.max_num_seqs = cap
    return rows


def summarise(rows: List[Dict[str, Any]], context: int = 2, show: int = 6) -> Dict[str, Any]:
    """Groups by (proposed k, verified k, prompt tokens or not): steps, median ``gap`` (ms between
    applied steps), and for an adaptive engine the median wall its policy saw, the table's
    prediction and how many samples it counted; prints them and the first ``show`` counted ``k = 0``
    samples with ``context`` steps either side."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"k={r['k']} v={r['v']} {'prefill' if r['prefill'] else 'decode'}", []).append(r)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    out = {}
    for key, rs in sorted(groups.items()):
        g = out[key] = dict(n=len(rs), gap_ms=med(r["gap"] for r in rs), wall_ms=med(r["wall"] for r in rs),
                            predicted_ms=med(r["predicted"] for r in rs), counted=sum(1 for r in rs if r["counted"]),
                            batch=med(r["batch"] for r in rs), gap_total_s=round(sum(r["gap"] or 0 for r in rs) / 1e3, 3),
                            catch_up=sum(r.get("catch_up", 0) for r in rs),
                            explored=sum(1 for r in rs if r.get("explored")),
                            choose_ms=med(r.get("choose_ms") for r in rs))
        print(f"{key:22s} n {g['n']:5d}  gap {g['gap_ms']} ms (total {g['gap_total_s']} s)  policy wall {g['wall_ms']}  "
              f"predicted {g['predicted_ms']}  counted {g['counted']}  batch {g['batch']}  catch-up {g['catch_up']}  "
              f"explored {g['explored']}  choose {g['choose_ms']} ms")
    picked = [i for i, r in enumerate(rows) if r["k"] == 0 and r["counted"]][:show]
    for i in picked:
        print("--")
        for j in range(max(0, i - context), min(len(rows), i + context + 1)):
            r = rows[j]
            print(f"{'>' if j == i else ' '} batch {r['batch']:4d} k {r['k']} v {r['v']} prefill {r['prefill']:6d} "
                  f"gap {r['gap'] or 0:8.3f} wall {r['wall'] or 0:8.3f} predicted {r['predicted'] or 0:7.3f} "
                  f"ahead {int(r['ahead'])} counted {int(bool(r['counted']))}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="What the adaptive policy measures, step by step (issue 18): each step's "
                                 "proposed k, verified drafts v, batch, prompt tokens, wall time and the device "
                                 "table's prediction; see the module docstring")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--engine", default="adaptive", choices=["plain", "adaptive", "adaptive-k0", "adaptive-k3", "k3"],
                    help="adaptive-k0 / adaptive-k3: the adaptive engine whose policy always proposes 0 / 3")
    ap.add_argument("--eager-mtp-kv", action="store_true",
                    help="adaptive engines: k = 0 steps write their MTP KV entries (adaptive_defer_mtp_kv false)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, help="default: 2 x concurrency")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--forced-acceptance", default="rate:0.8", help="'none': the real verifier")
    ap.add_argument("--json", help="write the groups and every row here")
    ap.add_argument("--warmup-full", action="store_true",
                    help="warm up with the whole traced workload once (every shape the traced run meets: first-time "
                         "compiles and allocations out of the trace), not a quarter of the prompts for 16 tokens")
    ap.add_argument("--rounds", type=int, default=1,
                    help="trace the workload this many times on the same engine (its policy's state carried over, "
                         "as in bench arms --in-process rounds); rows carry their round")
    ap.add_argument("--smoke", action="store_true",
                    help="the bundled GLM-4.5 demo model on the CPU, 4 short prompts (sets --concurrency, --num-prompts "
                         "and --output-len itself)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance
    spec = None if a.engine == "plain" else {"num_speculative_tokens": 3, "adaptive": a.engine != "k3"}
    if a.eager_mtp_kv:
        if not (spec and spec["adaptive"]):
            ap.error("--eager-mtp-kv is for the adaptive engines")
        spec["adaptive_defer_mtp_kv"] = False
    if not (a.smoke or a.model):
        ap.error("a model folder is needed (or --smoke)")
    from bench_adaptive_fixed_k import bench_llm
    llm = bench_llm(a.model, spec, max(a.concurrency, 1), a.smoke)
    if a.smoke:
        a.concurrency, a.num_prompts, a.input_len, a.output_len = 2, 4, 16, 24
    if a.engine.startswith("adaptive-k"):
        from bench_adaptive_fixed_k import ConstantK
        llm.llm_engine.spec_policy = ConstantK(int(a.engine[len("adaptive-k"):]))

    def rearm() -> None:  # forced acceptance from its first draw (each traced run makes the same ones)
        if spec is not None and a.forced_acceptance != "none":
            enable_forced_acceptance(llm, ForcedAcceptance.parse(a.forced_acceptance))
    rearm()
    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size
    n = a.num_prompts or 2 * a.concurrency
    prompts = [[rng.randrange(10, vocab) for _ in range(a.input_len)] for _ in range(n)]
    if a.warmup_full:
        trace(llm, prompts, a.output_len, a.concurrency)
        rearm()  # the same draws in the traced run
    else:
        trace(llm, prompts[: max(1, a.concurrency // 4)], 16, a.concurrency)  # warm-up
    llm.reset_prefix_cache()  # the traced run starts cold, whatever the warm-up cached (a warm-up of the whole
    # workload would otherwise turn a prefix-caching engine's prefills into hits: 2026-12-05, plain 2 prompt steps)
    gc_ms: Dict[int, List[float]] = {0: [], 1: [], 2: []}  # the collector's passes in the traced run, per generation
    started: List[float] = []

    def on_gc(phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            gc_ms[info["generation"]].append((time.perf_counter() - started[0]) * 1e3)

    caught_before = llm.llm_engine.get_metrics().get("num_mtp_catch_up_tokens", 0)  # the warm-up's
    gc.callbacks.append(on_gc)
    rows, per_round = [], []
    for i in range(a.rounds):
        if i:  # each round from the same start: forced-acceptance draws re-armed, prefix cache cold
            rearm()
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        got = trace(llm, prompts, a.output_len, a.concurrency)
        per_round.append(time.perf_counter() - t0)
        rows += [dict(r, round=i) for r in got]
        print(f"round {i}: {len(got)} steps in {per_round[-1]:.2f} s, {n * a.output_len / per_round[-1]:.0f} output "
              f"tok/s; proposed k histogram {[sum(1 for r in got if r['k'] == k) for k in range(4)]}")
    took = sum(per_round)
    gc.callbacks.remove(on_gc)
    gc_passes = {g: {"n": len(v), "total_ms": sum(v), "max_ms": max(v, default=0.0)} for g, v in gc_ms.items()}
    print(f"garbage collector passes in the traced run (objects frozen at start-up: {gc.get_freeze_count()}): "
          + ", ".join(f"gen {g} {v['n']} x, {v['total_ms']:.1f} ms, max {v['max_ms']:.1f}" for g, v in gc_passes.items()))
    out_tokens = n * a.output_len * a.rounds
    caught_up = llm.llm_engine.get_metrics().get("num_mtp_catch_up_tokens", 0) - caught_before  # the traced run's
    print(f"{a.engine}{' (eager MTP KV)' if a.eager_mtp_kv else ''}, forced {a.forced_acceptance}: {len(rows)} steps "
          f"in {took:.2f} s, {out_tokens / took:.0f} output tok/s; proposed k histogram "
          f"{[sum(1 for r in rows if r['k'] == k) for k in range(4)]}; deferred MTP rows caught up: {caught_up}")
    fwd = getattr(getattr(llm.llm_engine.executor, "runner", None), "fwd", None)
    capture_failed = getattr(fwd, "capture_failed", None)
    if capture_failed:  # every decode step ran eagerly: the trace is not the graphed engine's
        print(f"WARNING: {capture_failed}")
    groups = summarise(rows)
    policy = llm.llm_engine.spec_policy
    if hasattr(policy, "excess_ms"):
        print("policy's measured host ms beyond the table: "
              + ", ".join(f"b{b} k{k} {v:.2f}" for (b, k), v in sorted(policy.excess_ms.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"engine": a.engine, "eager_mtp_kv": a.eager_mtp_kv, "mtp_catch_up_rows": caught_up,
                       "forced": a.forced_acceptance, "groups": groups, "rows": rows,
                       "seconds": took, "round_seconds": per_round, "output_tokens_per_s": out_tokens / took,
                       "gc_passes": gc_passes,
                       "cuda_graph_capture_failed": capture_failed}, f)


if __name__ == "__main__":
    main()
