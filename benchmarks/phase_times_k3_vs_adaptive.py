"""Where a batch-1 decode step's host time goes: the fixed-k3 engine against the adaptive engine held
at k = 3 (a constant policy), in one process (issue 18: the adaptive arm's k = 3 decode steps took
1.67 ms against fixed k3's 1.62 on an H100, 2026-12-07, with the same device kernels). Two more
engines split the difference: ``k3+ahead`` (the fixed engine on the adaptive engine's host path: each
step left in flight, by a constant policy) and ``adaptive@k3,nodefer`` (``adaptive_defer_mtp_kv``
off: no hidden-state cache write in its verify).

Each engine generates ``--requests`` requests of ``--output-len`` tokens, ``--concurrency`` at a time
(``max_num_seqs``; default 1; random 512-token prompts, greedy, ignore_eos), ``--rounds`` times interleaved; the engine's phases are timed with
``time.perf_counter`` wrappers (the same wrappers on both): scheduling, launching a step (the runner's
host work up to the last launch), waiting for a step's tokens, applying them, taking the drafts (waits
for the draft passes), and the caller's time between ``step()`` calls; on a GPU also the device's idle
time between steps: CUDA events recorded just before and just after each step's launch (the runner's
``launch``), so ``start(N) - end(N - 1)`` is the time the stream waited for the host to queue step N
(``device_gap_us``) and ``end(N) - start(N)`` the time from then to the end of its draft passes
(``device_span_us``). Prints us per engine step::

    PYTHONPATH=$PWD python3 benchmarks/phase_times_k3_vs_adaptive.py [--model DIR] [--json OUT]

``--smoke``: on the CPU, one request of 16 tokens, one round, a synthetic step-cost table (no timing).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time

import mtpspec.engine.llm_engine as le
from mtpspec import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adaptive_fixed_k import ConstantK  # noqa: E402

ACC: collections.Counter = collections.Counter()


def _wrap(obj, name: str, label: str) -> None:
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            ACC[label] += time.perf_counter() - t
    setattr(obj, name, g)


def _time_launches(eng) -> list:
    """``[(start, end)]`` CUDA events around each step launch of ``eng``'s in-process runner from now on
    (nothing on a CPU or another executor)."""
    import torch
    events: list = []
    runner = getattr(eng.executor, "runner", None)
    device = getattr(getattr(runner, "device", None), "type", "cpu")
    if runner is None or device != "cuda":
        return events
    real = getattr(runner, "_phase_real_launch", None) or runner.launch
    runner._phase_real_launch = real

    def launch(step):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        try:
            return real(step)
        finally:
            b.record()
            events.append((a, b))
    runner.launch = launch
    return events


def _device_gaps(events: list):
    """Mean device idle before a step's launch (``start(N) - end(N - 1)``) and mean span from its start
    to the end of its launched work, in us, over steps 2..; ``(None, None)`` without events."""
    if len(events) < 3:
        return None, None
    import torch
    torch.cuda.synchronize()
    gaps = [events[i - 1][1].elapsed_time(events[i][0]) * 1e3 for i in range(1, len(events))]
    spans = [a.elapsed_time(b) * 1e3 for a, b in events[1:]]
    return sum(gaps) / len(gaps), sum(spans) / len(spans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled GLM-5 demo model, glm_moe_dsa)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="max_num_seqs (e.g. 64 with --requests 128)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="CPU, 1 request of 16 tokens, 1 round, a synthetic table")
    a = ap.parse_args()
    from mtpspec import demo_model_path
    model = a.model or demo_model_path()
    # four engines share one device: each gets a KV cache of its own, sized for every sequence's whole length
    # (the memory-sized default would give the first engine 90% of the device and leave the others none)
    common = dict(max_num_seqs=a.concurrency, max_model_len=1024, seed=0,  # (blocks of at least 16 tokens)
                  num_kv_blocks=a.concurrency * (1024 // 16 + 1) + 16)
    adaptive = {"num_speculative_tokens": 3, "adaptive": True}
    if a.smoke:
        a.requests, a.output_len, a.rounds = 1, 16, 1
        common["device"] = "cpu"
        sizes = {str(b): 1.0 for b in (1, 2, 4, 8)}  # (the policy is replaced: any table will do)
        table = os.path.join(tempfile.mkdtemp(), "costs.json")
        with open(table, "w") as f:
            json.dump({"verify_ms": {str(k): sizes for k in range(4)}, "draft_ms": {str(k): sizes for k in range(4)}}, f)
        adaptive["adaptive_cost_table"] = table
    # the 2 x 2 (+1) split of the adaptive engine's extra time: the host path (k3: a step applied before the
    # next is scheduled; "+ahead": the adaptive engine's step left in flight, forced on the fixed engine by a
    # constant policy) x the runner (fixed: graphs of k = 3 only; adaptive: graphs of k = 0..3, and with
    # deferred MTP entries its verify writes the hidden-state cache too)
    engines = {"k3": LLM(model, speculative_config={"num_speculative_tokens": 3}, **common),
               "k3+ahead": LLM(model, speculative_config={"num_speculative_tokens": 3}, **common),
               "adaptive@k3,nodefer": LLM(model, speculative_config={**adaptive, "adaptive_defer_mtp_kv": False},
                                          **common),
               "adaptive@k3": LLM(model, speculative_config=adaptive, **common)}
    for name in ("k3+ahead", "adaptive@k3,nodefer", "adaptive@k3"):
        engines[name].llm_engine.spec_policy = ConstantK(3)
    for name in ("_launch", "_finish", "_take_drafts", "_choose_k", "_step_input", "_time_step", "_observe_spec"):
        _wrap(le.LLMEngine, name, name)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 9000) for _ in range(512)]} for _ in range(a.requests)]
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    res = {n: collections.defaultdict(list) for n in engines}
    for rnd in range(a.rounds + 1):
        for name, llm in engines.items():
            eng = llm.llm_engine
            execu = eng.executor
            if not hasattr(execu, "_phase_wrapped"):
                _wrap(execu, "execute_async", "execute_async (launch)")
                execu._phase_wrapped = True
            for p in prompts:
                eng.add_request(p, sp)
            ACC.clear()
            events = _time_launches(eng)
            steps, between, t_end = 0, 0.0, None
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                if t_end is not None:
                    between += t - t_end
                eng.step()
                t_end = time.perf_counter()
                steps += 1
            wall = time.perf_counter() - t0
            gap_us, span_us = _device_gaps(events)
            if rnd:
                r = res[name]
                r["proposed_k3_steps"].append(llm.get_metrics()["num_speculative_tokens_histogram"][3])
                r["us_per_step"].append(wall / steps * 1e6)
                r["steps"].append(steps)
                r["caller_us"].append(between / steps * 1e6)
                for k, v in ACC.items():
                    r[k].append(v / steps * 1e6)
                if gap_us is not None:
                    r["device_gap_us"].append(gap_us)
                    r["device_span_us"].append(span_us)
            print(f"round {rnd} {name:20s} {steps} steps, {wall / steps * 1e3:.3f} ms a step", flush=True)
    out = {n: {k: sorted(v)[len(v) // 2] for k, v in r.items()} for n, r in res.items()}
    keys = sorted({k for r in out.values() for k in r})
    print(f"{'median over rounds, us per step':34s}" + "".join(f"{n:>21s}" for n in out))
    for k in keys:
        print(f"{k:34s}" + "".join(f"{out[n].get(k, 0.0):21.1f}" for n in out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": out, "rounds": {n: dict(r) for n, r in res.items()}}, f, indent=1)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
