"""The adaptive engine held at one k against the fixed-k and plain engines, in one process, interleaved.

Issue 18: "k = 0 must cost nothing beyond plain decoding". Three engines on one GPU (plain, fixed
k = 3, adaptive k = 3 whose policy is replaced by a constant choice, run once at k = 0 and once at
k = 3), the same prompts each round (random ids; the prefix cache keeps them after round 0, so
later rounds are decode-bound), forced acceptance ``rate:0.8`` for the speculative engines. Per run:
output tokens per second, and the engine's own per-step times (``MTPSPEC_LOG_STEPS`` lines: schedule
+ execute + update ms) split into steps with and without prompt tokens.

    PYTHONPATH=$PWD python3 benchmarks/make_dummy_model.py /tmp/air3 --preset air-8l --num-hidden-layers 3 \\
        --max-position-embeddings 2048
    PYTHONPATH=$PWD python3 benchmarks/bench_adaptive_fixed_k.py /tmp/air3 --concurrency 64 --prompts 128 --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import mtpspec.engine.llm_engine as llm_engine
from mtpspec import LLM, SamplingParams
from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance


class ConstantK:
    """A stand-in policy: every step proposes ``k``."""

    prompt_reserve = 0.0

    def __init__(self, k: int):
        self.k = k

    def choose(self, *args, **kwargs) -> int:
        return self.k

    def observe(self, *args) -> None:
        pass

    def observe_step_time(self, *args, **kwargs) -> None:
        pass

    def observe_catch_up(self, *args) -> None:
        pass

    def end_step(self) -> None:
        pass


def bench_llm(model, spec, max_num_seqs: int, smoke: bool):
    """The engine the adaptive diagnostics build: ``model`` with random weights (``load_format`` dummy),
    bf16, ``max_model_len`` 1,024, ``max_num_seqs``; with ``smoke`` the bundled GLM-4.5 demo model on
    the CPU in fp32, 4 sequences, ``max_model_len`` 256 (``model`` ignored)."""
    if smoke:
        from mtpspec import demo_model_path
        return LLM(demo_model_path("glm4_moe"), speculative_config=spec, max_num_seqs=4, max_model_len=256,
                   device="cpu", dtype="float32")
    return LLM(model, speculative_config=spec, max_num_seqs=max_num_seqs, max_model_len=1024, load_format="dummy",
               dtype="bfloat16")


def _step_ms(lines):
    return sum(float(p.split()[1]) for line in lines for p in line.split(":")[1].split(";")[0].split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm_engine._LOG_STEPS = True
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("step "):
                lines.append(msg)

    log = logging.getLogger(llm_engine.__name__)
    log.addHandler(Collect())
    log.propagate = False
    common = dict(max_num_seqs=args.concurrency, load_format="dummy", max_model_len=args.prompt_len + args.output_len,
                  dtype="bfloat16", seed=0)
    spec = {"num_speculative_tokens": 3}
    arms = {"plain": LLM(args.model, gpu_memory_utilization=0.28, **common),
            "k3": LLM(args.model, speculative_config=spec, gpu_memory_utilization=0.56, **common)}
    arms["adaptive@k0"] = arms["adaptive@k3"] = LLM(args.model, speculative_config={**spec, "adaptive": True},
                                                    gpu_memory_utilization=0.85, **common)
    rng = random.Random(0)
    vocab = arms["plain"].llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rates = {a: [] for a in arms}
    for rnd in range(args.rounds + 1):  # round 0: warm-up
        for name, llm in arms.items():
            eng = llm.llm_engine
            if "@k" in name:
                eng.spec_policy = ConstantK(int(name[-1]))
            if eng.scheduler_config.num_speculative_tokens:
                enable_forced_acceptance(llm, ForcedAcceptance.parse("rate:0.8"))
            lines.clear()
            llm.reset_metrics()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dur = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            pre = [x for x in lines if not x.split(";")[1].strip().startswith("0 prefill")]
            dec = [x for x in lines if x.split(";")[1].strip().startswith("0 prefill")]
            if rnd:
                rates[name].append(toks / dur)
            steps = llm.get_metrics()["num_steps"]
            print(f"round {rnd} {name:12s} {toks / dur:8.0f} tok/s, {dur:.3f} s, {steps} steps: {len(pre)} with "
                  f"prompt tokens {_step_ms(pre):.0f} ms, {len(dec)} decode-only {_step_ms(dec):.0f} ms "
                  f"(mean {_step_ms(dec) / max(len(dec), 1):.2f})", flush=True)
    for name, v in rates.items():
        print(f"{name:12s} median {statistics.median(v):8.0f} tok/s, rounds {[round(x) for x in v]}")


if __name__ == "__main__":
    main()
