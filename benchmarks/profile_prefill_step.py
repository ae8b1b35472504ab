"""Where does an eager prefill step's time go? (issue 17: prefix-cache hits as slow as misses.)

Builds ``LLM(MODEL, load_format="dummy")`` (a config-only folder from ``make_dummy_model.py``),
then runs (miss, hit) pairs of 5-shot GSM8K prompts exactly like ``bench serve --shared-prefix``
(prefix cache reset, a miss, the next question as a hit), one engine step at a time, printing each
prefill step's wall time and computed tokens; then profiles one hit prefill step and one miss
with ``torch.profiler`` and prints the top host and device ops.

    python3 benchmarks/profile_prefill_step.py MODEL [--pairs 6] [--gpu-memory-utilization 0.9]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mtpspec.engine.llm import LLM  # noqa: E402
from mtpspec.entrypoints.bench_dataset import load_dataset  # noqa: E402
from mtpspec.entrypoints.bench_prefix import prefix_prompts  # noqa: E402
from mtpspec.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine, prompt: str, profile: bool = False):
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    times = []
    prof = None
    while engine.has_unfinished_requests():
        first = not times
        if first and profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
        if first and profile:
            prof.__exit__(None, None, None)
    return times, prof


GROUPS = (("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "matmul", "splitk")),
          ("attention", ("attn", "attention", "paged", "mla")),
          ("norm / rope / act", ("norm", "rope", "rotary", "silu", "act_and_mul", "elementwise", "vectorized")),
          ("copy / fill", ("memcpy", "memset", "copy", "fill")))


def device_breakdown(ka) -> str:
    """Device time of a profiled step by kernel-name group (first group whose keyword the name holds), ms."""
    tot, by = 0.0, {}
    for e in ka:
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us <= 0 or not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue  # kernels only (a launching CPU op may carry its kernels' time too)
        name = e.key.lower()
        group = next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")
        tot += us
        by[group] = by.get(group, 0.0) + us
    rows = ", ".join(f"{g} {v / 1e3:.3f}" for g, v in sorted(by.items(), key=lambda x: -x[1]))
    return f"device time {tot / 1e3:.3f} ms: {rows}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    a = ap.parse_args()
    llm = LLM(a.model, load_format="dummy", speculative_config={"num_speculative_tokens": 3},
              max_model_len=10240, max_num_seqs=64, gpu_memory_utilization=a.gpu_memory_utilization,
              enforce_eager=a.enforce_eager)
    eng = llm.llm_engine
    prompts, _ = prefix_prompts(load_dataset(None), 2 * a.pairs + 2, 5, 0)
    for i in range(a.pairs + 1):
        eng.reset_prefix_cache()
        miss, _ = run(eng, prompts[2 * i])
        hit, _ = run(eng, prompts[2 * i + 1])
        print(f"pair {i}: miss prefill {miss[0]:.1f} ms (decode {sum(miss[1:]) / max(1, len(miss) - 1):.1f}), "
              f"hit prefill {hit[0]:.1f} ms", flush=True)
    for kind, p in (("miss", prompts[-2]), ("hit", prompts[-1])):
        if kind == "miss":
            eng.reset_prefix_cache()
        times, prof = run(eng, p, profile=True)
        print(f"\n===== {kind} prefill step {times[0]:.1f} ms (profiled)")
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        print(device_breakdown(ka))


if __name__ == "__main__":
    main()
