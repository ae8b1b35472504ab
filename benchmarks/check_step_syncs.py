"""One engine's decode steps: host time in ``ModelRunner.launch``, wall per step, and any synchronising CUDA call.

Issue 18 (adaptive k = 0 vs plain decoding): run once per engine, each in its own process, e.g.

    PYTHONPATH=$PWD python3 benchmarks/make_dummy_model.py /tmp/air3 --preset air-8l --num-hidden-layers 3 \\
        --max-position-embeddings 2048
    for m in plain adaptive0 k3; do PYTHONPATH=$PWD python3 benchmarks/check_step_syncs.py /tmp/air3 $m; done

``adaptive0``: the adaptive engine (k = 3) whose policy always proposes 0. 64 sequences of 64 random prompt
tokens, 20 steps of warm-up, then 40 steps timed with ``torch.cuda.set_sync_debug_mode(1)`` (a synchronising
call warns; the warnings are counted by the Python stack that issued them). ``--profile``: 10 more steps under
``torch.profiler``: GPU busy time and kernel launches a step (kernels inside CUDA graphs too), the top kernels.
"""

from __future__ import annotations

import argparse
import random
import time
import traceback
import warnings

import torch

from mtpspec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("engine", choices=["plain", "adaptive0", "k3"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true",
                    help="then 10 steps under torch.profiler: GPU busy ms and kernel launches a step, top kernels")
    args = ap.parse_args()
    spec = None if args.engine == "plain" else {"num_speculative_tokens": 3, "adaptive": args.engine == "adaptive0"}
    llm = LLM(args.model, speculative_config=spec, max_num_seqs=args.batch, max_model_len=1024, load_format="dummy",
              dtype="bfloat16")
    eng = llm.llm_engine
    if args.engine == "adaptive0":
        from bench_adaptive_fixed_k import ConstantK
        eng.spec_policy = ConstantK(0)
    rng = random.Random(0)
    for i in range(args.batch):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, eng.vocab_size) for _ in range(64)]},
                        SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), str(i))
    for _ in range(20):
        eng.step()
    seen: dict = {}

    def count(message, category, filename, lineno, file=None, line=None):
        where = tuple(s.strip() for s in "".join(traceback.format_stack(limit=12)[:-2]).strip().splitlines()[-2:])
        seen[where] = seen.get(where, 0) + 1

    runner, launch_ms = eng.executor.runner, []
    real = runner.launch

    def timed(step):
        t = time.perf_counter()
        out = real(step)
        launch_ms.append((time.perf_counter() - t) * 1e3)
        return out

    runner.launch = timed
    shown, warnings.showwarning = warnings.showwarning, count
    torch.cuda.set_sync_debug_mode(1)
    t0 = time.perf_counter()
    for _ in range(40):
        eng.step()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / 40 * 1e3
    warnings.showwarning, runner.launch = shown, real
    seen = {k: v for k, v in seen.items() if not any("set_sync_debug_mode" in s for s in k)}
    print(f"{args.engine}: {per_step:.2f} ms a step, launch() median {sorted(launch_ms)[len(launch_ms) // 2]:.2f} ms, "
          f"synchronising calls {sum(seen.values())}")
    for where, n in sorted(seen.items(), key=lambda x: -x[1])[:6]:
        print(f"  {n} x {' | '.join(where)}")
    if args.profile:  # device work a step: is the gap to plain decoding host or device?
        from _timing import cuda_kernel_times, kernel_counts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                eng.step()
            torch.cuda.synchronize()
        busy, _ = cuda_kernel_times(prof)
        kc = kernel_counts(prof, per=10)
        print(f"{args.engine}: GPU busy {busy / 10:.3f} ms a step, {sum(v[1] for v in kc.values()):.1f} kernels a step")
        for name, (us, n) in sorted(kc.items(), key=lambda x: -x[1][0])[:12]:
            print(f"  {us:8.1f} us {n:5.1f} x {name}")
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
