"""Device work of steady decode steps, kernel by kernel: plain decoding vs the adaptive engine (issue 18).

H100, 2026-12-05 (session 27): at 64 sequences the adaptive engine's ``k = 0`` decode steps took 2.07 ms
against plain decoding's 1.75 (Air width, 3 layers), and a CPU profile found the same host work in both.
This runs ``--concurrency`` requests (random prompts, every output long enough that no request finishes:
pure decode steps only), then profiles ``--steps`` engine steps with ``torch.profiler`` and prints per
step: device time summed over kernels (and over memory copies), kernels launched, CUDA-graph launches,
host wall time, the host's CUDA API calls, and the kernels that take the most device time. The engines:
``plain`` (k = 0), ``k3`` (fixed k = 3), ``adaptive-k0`` / ``adaptive-k3`` (the adaptive engine's k = 3
build whose policy always proposes 0 / 3) and ``adaptive`` (its own policy; forced acceptance
``rate:0.8``, SYNTHETIC)::

    PYTHONPATH=$PWD python3 benchmarks/make_dummy_model.py /tmp/air3 --preset air-8l --num-hidden-layers 3 \\
        --max-position-embeddings 2048
    PYTHONPATH=$PWD python3 benchmarks/profile_decode_gpu.py /tmp/air3 --engine plain --json plain.json

``--smoke``: the bundled GLM-4.5 demo model on the CPU, 4 sequences, a few steps (host events only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List


def profile_steps(llm: Any, steps: int) -> Dict[str, Any]:
    """Profile ``steps`` calls of ``llm.llm_engine.step()``; device and host figures per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    eng = llm.llm_engine
    cuda = torch.cuda.is_available() and llm.engine_config.device != "cpu"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: Dict[str, List[float]] = defaultdict(list)
    copies_us = graph_launches = 0.0
    api: Dict[str, List[float]] = defaultdict(list)  # CUDA runtime calls on the host (syncs, copies, launches)
    for e in prof.events():
        if e.device_type.name == "CPU" and (e.name.startswith("cuda") or e.name in ("aten::item", "aten::to")):
            api[e.name].append(e.cpu_time_total)
        dev_us = e.device_time if e.device_type.name == "CUDA" else 0.0
        if dev_us:
            if "Memcpy" in e.name or "Memset" in e.name:
                copies_us += dev_us
            else:
                kernels[e.name].append(dev_us)
        elif e.name == "cudaGraphLaunch":
            graph_launches += 1
    kernel_us = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
            "kernel_ms_per_step": kernel_us / 1e3 / steps, "copy_ms_per_step": copies_us / 1e3 / steps,
            "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
            "graph_launches_per_step": graph_launches / steps,
            "host_api_per_step": {n: {"n": len(v) / steps, "us": sum(v) / steps}
                                  for n, v in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:10]},
            "top_kernels": [{"name": n[:90], "n_per_step": len(v) / steps, "ms_per_step": sum(v) / 1e3 / steps}
                            for n, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description="device work of steady decode steps, plain vs adaptive (issue 18); "
                                             "see the module docstring")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--engine", default="plain", choices=["plain", "k3", "adaptive-k0", "adaptive-k3", "adaptive"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)  # room for 168 x 4 tokens at max_model_len 1024
    ap.add_argument("--warmup-steps", type=int, default=60)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="the bundled demo model on the CPU, a few steps")
    a = ap.parse_args()
    from mtpspec import SamplingParams
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance
    spec = None if a.engine == "plain" else {"num_speculative_tokens": 3, "adaptive": a.engine != "k3"}
    if not (a.smoke or a.model):
        ap.error("a model folder is needed (or --smoke)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_adaptive_fixed_k import ConstantK, bench_llm
    llm = bench_llm(a.model, spec, a.concurrency, a.smoke)
    if a.smoke:
        a.concurrency, a.input_len, a.warmup_steps, a.steps = 4, 16, 4, 4
    if a.engine in ("adaptive-k0", "adaptive-k3"):
        llm.llm_engine.spec_policy = ConstantK(int(a.engine[-1]))
    if spec is not None:
        enable_forced_acceptance(llm, ForcedAcceptance.parse("rate:0.8"))
    eng = llm.llm_engine
    rng = random.Random(0)
    vocab = eng.vocab_size
    room = eng.scheduler_config.max_model_len - a.input_len - 1
    need = a.warmup_steps + a.steps + 8  # decode steps (x 4 tokens at most with drafts) + the prefill steps
    if need * 4 > room:
        ap.error(f"--warmup-steps + --steps = {need} steps could finish a request (room for {room} tokens)")
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    for _ in range(a.concurrency):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(a.input_len)]}, params)
    steps = 0
    while steps < a.warmup_steps or eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
        steps += 1
    res = profile_steps(llm, a.steps)
    res.update(engine=a.engine, concurrency=a.concurrency, input_len=a.input_len,
               proposed_k_histogram=eng.get_metrics().get("num_speculative_tokens_histogram"))
    print(f"{a.engine}: {res['wall_ms_per_step']:.3f} ms a step (host wall), device kernels "
          f"{res['kernel_ms_per_step']:.3f} ms + copies {res['copy_ms_per_step']:.3f} ms, "
          f"{res['kernels_per_step']:.1f} kernels and {res['graph_launches_per_step']:.1f} graph launches a step")
    print("  host CUDA API a step: " + ", ".join(f"{n} x{v['n']:.1f} {v['us']:.0f} us"
                                                 for n, v in res["host_api_per_step"].items()))
    for k in res["top_kernels"]:
        print(f"  {k['ms_per_step']:8.4f} ms  x{k['n_per_step']:5.1f}  {k['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
