"""Host time of an engine step, phase by phase (issue 18: the host's share of a speculative step).

    PYTHONPATH=$PWD python benchmarks/profile_step_host.py [MODEL] --k 3 --batch 64 [--window-detokenizer]

``MODEL`` defaults to a micro GLM-4.5-style model written to a temporary folder (hidden 64, one
layer, the demo tokenizer's 10,007-token vocabulary, random weights), so that on a CPU the model's
compute is small next to the host's per-token work. Decodes of ``--batch`` random 64-token prompts,
forced acceptance ``--rate`` (SYNTHETIC) for ``--k`` > 0, async scheduling on; ``--warmup`` steps,
then ``--steps`` timed. Prints ms a step and us per emitted token of each wrapped phase:
``schedule`` (the scheduler), ``step_input`` (the engine's step description), ``runner._prepare``
(host arrays and the host-to-device copy), ``runner.launch`` (the whole forward: on a CPU it holds
the model's compute; on a GPU its host part), ``update_from_output`` (applying the tokens: stops,
counters, block hashes) and within it ``append_tokens`` (stop checks and detokenization),
``_choose_k`` and ``_observe_spec`` (an adaptive engine's policy: its choice, its bookkeeping).
``--window-detokenizer``: the Python window instead of ``tokenizers``' ``DecodeStream`` (the A/B of
that change). Host times on a shared CPU move from run to run: compare runs of one session.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import sys
import tempfile
import time


def micro_model(folder: str) -> str:
    """A config-only micro model (``load_format="dummy"``) with the demo tokenizer in ``folder``."""
    from mtpspec import demo_model_path
    demo = demo_model_path("glm4_moe")
    cfg = json.load(open(os.path.join(demo, "config.json")))
    cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, first_k_dense_replace=3,
               num_nextn_predict_layers=1, max_position_embeddings=4096)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(demo, "tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    return folder


PHASES = ("schedule", "_choose_k", "step_input", "runner.launch", "  runner._prepare", "update_from_output",
          "  append_tokens", "_observe_spec")


def main() -> None:
    ap = argparse.ArgumentParser(description="Host time of an engine step, phase by phase (issue 18): ms a step and "
                                 "us per emitted token of each phase; see the module docstring",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("model", nargs="?", default=None,
                    help="a model folder (random weights: load_format dummy); default: a micro GLM-4.5-style model")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (0: plain decoding)")
    ap.add_argument("--batch", type=int, default=64, help="max_num_seqs: the sequences decoded together")
    ap.add_argument("--rate", type=float, default=0.8,
                    help="forced acceptance rate of each draft (SYNTHETIC; --k >= 1 only)")
    ap.add_argument("--warmup", type=int, default=10, help="engine steps before the timed ones")
    ap.add_argument("--steps", type=int, default=60, help="timed engine steps")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--window-detokenizer", action="store_true",
                    help="the Python window detokenizer instead of tokenizers' DecodeStream")
    ap.add_argument("--adaptive", action="store_true",
                    help="the adaptive engine (speculative_config adaptive, --k drafts at most; with --rate 0 its "
                         "policy settles on k = 0: the A/B against --k 0's plain decoding)")
    ap.add_argument("--propose", type=int, default=None, metavar="N",
                    help="with --adaptive: a stand-in policy that always proposes N (the engine's cost without "
                         "the policy's)")
    ap.add_argument("--cprofile", default=None, metavar="FILE",
                    help="also cProfile the timed steps; the 25 functions with most own time are printed, the "
                         "pstats written to FILE")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens of each random prompt")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=3000,
                    help="per request; with --requests above --batch, finished requests make room for waiting "
                         "ones, so the timed steps carry prompt chunks (mixed steps)")
    ap.add_argument("--requests", type=int, default=None, help="requests queued at the start (default --batch)")
    ap.add_argument("--smoke", action="store_true",
                    help="4 sequences, 2 + 3 steps (the CPU test): overrides --batch, --warmup, --steps")
    ap.add_argument("--json", default=None, help="also write the figures here: ms a step, tokens a step, and each "
                    "phase's ms a step (keys as printed, without the indent), with the settings")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.warmup, args.steps = 4, 2, 3
    requests = args.batch if args.requests is None else args.requests
    for flag, value, low in (("--k", args.k, 0), ("--batch", args.batch, 1), ("--warmup", args.warmup, 0),
                             ("--steps", args.steps, 1), ("--prompt-len", args.prompt_len, 1),
                             ("--max-tokens", args.max_tokens, 1), ("--requests", requests, 1)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")
    if not 0.0 <= args.rate <= 1.0:
        ap.error(f"--rate must lie in [0, 1], got {args.rate}")
    if args.prompt_len + args.max_tokens > args.max_model_len:
        ap.error(f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} exceed --max-model-len "
                 f"{args.max_model_len}: requests would be cut at the model length")
    if args.adaptive and not args.k:
        ap.error("--adaptive needs --k >= 1")
    if args.propose is not None and not (args.adaptive and 0 <= args.propose <= args.k):
        ap.error(f"--propose {args.propose} needs --adaptive and must lie in [0, --k {args.k}]")
    if args.cprofile and not os.path.isdir(os.path.dirname(os.path.abspath(args.cprofile))):
        ap.error(f"--cprofile {args.cprofile}: its folder does not exist")
    tmp = None
    try:
        if args.model is None:
            tmp = tempfile.mkdtemp(prefix="mtpspec_micro_")
            args.model = micro_model(tmp)
        run(args, requests)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()


def run(args: argparse.Namespace, requests: int) -> None:
    import torch

    from mtpspec import LLM, SamplingParams
    from mtpspec.spec_decode.forced_acceptance import ForcedAcceptance, enable_forced_acceptance
    torch.set_num_threads(1)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = {"num_speculative_tokens": args.k} if args.k else None
    if args.adaptive:
        spec["adaptive"] = True
    llm = LLM(args.model, speculative_config=spec, max_num_seqs=args.batch, max_model_len=args.max_model_len,
              load_format="dummy", dtype="float32" if device == "cpu" else "bfloat16", device=device,
              async_scheduling=True)
    eng = llm.llm_engine
    if args.propose is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_adaptive_fixed_k import ConstantK
        eng.spec_policy = ConstantK(args.propose)
    if args.window_detokenizer and eng.tokenizer is not None:
        eng.tokenizer.stream_backend = None
    if args.k:  # --rate 0 with --adaptive: its policy settles on k = 0
        enable_forced_acceptance(eng, ForcedAcceptance.parse(f"rate:{args.rate}"))
    rng = random.Random(0)
    for i in range(requests):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, eng.vocab_size) for _ in range(args.prompt_len)]},
                        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), str(i))
    for _ in range(args.warmup):
        eng.step()
    spent = dict.fromkeys(PHASES, 0.0)

    def wrap(obj, name, key):
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, timed)
    import mtpspec.engine.scheduler as scheduler_module
    runner = eng.executor.runner
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng, "_step_input", "step_input")
    wrap(runner, "launch", "runner.launch")
    wrap(runner, "_prepare", "  runner._prepare")
    wrap(eng.scheduler, "update_from_output", "update_from_output")
    wrap(scheduler_module, "append_tokens", "  append_tokens")
    wrap(eng, "_choose_k", "_choose_k")  # the adaptive policy's choice (0 without a policy)
    asked = [0, 0]  # timed steps that asked the adaptive policy / that it held (hold_k0_steps, hold_draft_steps)
    policy, choose_k = eng.spec_policy, eng._choose_k
    if policy is not None:  # its one caller is _choose_k, once per asked step
        choose = policy.choose

        def counted_choose(*a, **kw):
            asked[0] += 1
            return choose(*a, **kw)
        policy.choose = counted_choose

    def count(out):
        choose_k(out)
        asked[1] += bool(out.policy_held)
    eng._choose_k = count
    wrap(eng, "_observe_spec", "_observe_spec")  # its bookkeeping of a speculative engine's step
    n0, p0 = eng.metrics.num_output_tokens, eng.metrics.num_prompt_tokens
    prof = None
    if args.cprofile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    if device != "cpu":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if prof is not None:
        import pstats
        prof.disable()
        prof.dump_stats(args.cprofile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    toks, ptoks = eng.metrics.num_output_tokens - n0, eng.metrics.num_prompt_tokens - p0
    if toks == 0:
        sys.exit(f"the {args.steps} timed steps emitted no token (every request finished in the {args.warmup} "
                 "warm-up steps?): raise --max-tokens or --requests, or lower --warmup")
    print(f"{args.model} on {device}: k={args.k}"
          f"{(' adaptive' + ('' if args.propose is None else f' proposing {args.propose}')) if args.adaptive else ''}"
          f" batch={args.batch} requests={requests} detokenizer="
          f"{'window' if args.window_detokenizer else 'stream where it applies'}: {wall / args.steps * 1e3:.2f} ms a "
          f"step, {toks / args.steps:.1f} tokens a step, {ptoks / args.steps:.1f} prompt tokens a step")
    if args.adaptive:
        print(f"  the policy was asked at {asked[0]} of the {args.steps} timed steps, {asked[1]} held")
    for key in PHASES:
        s = spent[key]
        print(f"  {key:22s} {s / args.steps * 1e3:8.3f} ms a step {s / toks * 1e6:8.2f} us a token")
    if args.json:
        settings = {name: getattr(args, name) for name in (
            "model", "k", "batch", "rate", "warmup", "steps", "adaptive", "propose", "prompt_len", "max_tokens",
            "max_model_len", "window_detokenizer", "smoke")}
        with open(args.json, "w") as f:
            json.dump({"device": device, **settings, "requests": requests,
                       "step_ms": wall / args.steps * 1e3, "tokens_per_step": toks / args.steps,
                       "prompt_tokens_per_step": ptoks / args.steps,
                       "phase_ms_per_step": {k.strip(): s / args.steps * 1e3 for k, s in spent.items()},
                       "policy_asked_steps": asked[0] if args.adaptive else None,
                       "held_steps": asked[1] if args.adaptive else None}, f, indent=1)


if __name__ == "__main__":
    main()
