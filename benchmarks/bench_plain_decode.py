"""Plain decoding (k = 0) at batch 1 through ``LLM.generate``, against the weight-read floor (issue 18).

Model: random weights (``load_format="dummy"``) at GLM-4.5-Air width (``bench_engine_step``'s
config: hidden 4096, 96 / 8 heads of 128, 128 routed experts of 1408 top 8 + 1 shared, vocab
151,552), ``--layers`` target layers (the first dense), bf16, tp 1, CUDA graphs, no speculative
decoding. One request of ``--context`` random prompt tokens, ``--tokens`` generated with
``ignore_eos``, timed as a user would time ``LLM.generate`` (host clock around the call); the
decode time per token is (generate with ``--tokens`` minus generate with 1 token) / (tokens - 1),
so the prefill and the first token cancel. Median of ``--repeats``.

Floor per token: the bytes one decode step must read once, over the read bandwidth measured in
the same process (``x.sum()`` over 4 GiB): every weight except the embedding table and the
routed experts, plus ``top_k`` routed experts per MoE layer (one token routes to exactly
``top_k`` distinct experts), plus the KV cache of the context. ``x floor`` = time / floor (goal
<= 1.4).

Arms, side by side in one process (one engine at a time): async scheduling on (the default: the
next step is launched before the last one's token is applied, its input filled on the device) and
off (each step waited for whole); ``on_unfused``: on, with the MoE shared experts as their own MLP
(``--disable-shared-experts-fusion``; the default runs them inside the routed experts' kernels).
``--profile``: GPU busy time and the top kernels per token of the first "on" arm. Prints and writes JSON (``--json``).

    python3 benchmarks/bench_plain_decode.py [--layers 8] [--tokens 257] [--json out.json]
    python3 benchmarks/bench_plain_decode.py --smoke      # tiny model on the CPU: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import cuda_kernel_times, read_bandwidth  # noqa: E402
from benchmarks.bench_engine_step import glm_air_config_dict  # noqa: E402
from mtpspec import LLM, SamplingParams  # noqa: E402


def floor_bytes(cfg: Dict[str, Any], context: int, elem: int) -> int:
    """Bytes one batch-1 decode step reads at least once (see the module docstring)."""
    h, v, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * (nh + 2 * nkv) * hd + nh * hd * h  # qkv + o
    dense_mlp = 3 * h * cfg["intermediate_size"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    moe_layers = L - cfg["first_k_dense_replace"]
    moe_read = moe_layers * (cfg["num_experts_per_tok"] + cfg["n_shared_experts"]) * expert
    router = moe_layers * cfg["n_routed_experts"] * h * 2  # fp32 router weights (2 x the bf16 bytes)
    weights = (L * attn + cfg["first_k_dense_replace"] * dense_mlp + moe_read) * elem + router * elem + v * h * elem
    kv = L * context * 2 * nkv * hd * elem
    return weights + kv


def profile_decode(run: Callable[[int], float], tokens: int) -> Dict[str, Any]:
    """Per decode token: GPU busy ms and each kernel's ms (``--profile``), from a ``tokens`` run minus a
    1-token run (kernels inside CUDA graphs included, as CUPTI reports them)."""
    out = []
    for n in (tokens, 1):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            wall = run(n)
        out.append((wall,) + cuda_kernel_times(prof))
    (wall_n, busy_n, k_n), (wall_1, busy_1, k_1) = out
    per = {name: (ms - k_1.get(name, 0.0)) / (tokens - 1) for name, ms in k_n.items()}
    top = sorted(per.items(), key=lambda kv: -kv[1])[:25]
    res = dict(gpu_busy_ms=(busy_n - busy_1) / (tokens - 1), wall_profiled_ms=(wall_n - wall_1) / (tokens - 1) * 1e3,
               kernels_ms={k: round(v, 5) for k, v in top})
    print(f"profile: GPU busy {res['gpu_busy_ms']:.3f} ms/token, wall (profiled) {res['wall_profiled_ms']:.3f}")
    for k, v in top:
        print(f"  {v * 1e3:8.1f} us  {k[:110]}")
    return res


def time_arm(folder: str, a: argparse.Namespace, on: bool, fuse: bool = True) -> Dict[str, Any]:
    llm = LLM(folder, load_format="dummy", max_num_seqs=1, max_model_len=a.context + a.tokens + 16,
              async_scheduling=on, seed=0, enable_prefix_caching=False, disable_shared_experts_fusion=not fuse,
              device="cpu" if a.smoke else None, gpu_memory_utilization=0.85)
    try:
        vocab = llm.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompt = {"prompt_token_ids": torch.randint(3, vocab, (a.context,), generator=g).tolist()}

        def run(n: int) -> float:
            sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            if not a.smoke:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate([prompt], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert len(out[0].outputs[0].token_ids) == n
            return dt
        run(a.tokens)  # warm-up: graphs, Triton's compilations
        run(1)
        per_token = []
        for _ in range(a.repeats):
            full, one = run(a.tokens), run(1)
            per_token.append((full - one) / (a.tokens - 1) * 1e3)
        ms = statistics.median(per_token)
        row = dict(async_scheduling=on, shared_experts_fusion=fuse, ms_per_token=ms, tok_per_s=1e3 / ms,
                   repeats_ms=per_token)
        if a.profile and on and fuse and not a.smoke:
            row["profile"] = profile_decode(run, a.tokens)
        return row
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=257)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also: GPU busy and kernels per token (async arm)")
    ap.add_argument("--arms", default="on,on_unfused,off",
                    help="arms: on / off (async scheduling), on_unfused (on, --disable-shared-experts-fusion)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.context, a.tokens, a.repeats = 2, 16, 9, 1
    dev = torch.device("cpu" if a.smoke else "cuda")
    raw = glm_air_config_dict(a.smoke, a.layers)
    raw["torch_dtype"] = "float32" if a.smoke else "bfloat16"
    bw = read_bandwidth(dev)
    floor_ms = floor_bytes(raw, a.context, 4 if a.smoke else 2) / bw * 1e3
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(raw, f)
        for arm in a.arms.split(","):
            if arm not in ("on", "off", "on_unfused"):
                ap.error(f"--arms: unknown arm {arm!r} (on, off, on_unfused)")
            row = time_arm(folder, a, arm != "off", arm != "on_unfused")
            row["x_floor"] = row["ms_per_token"] / floor_ms
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = dict(bench="plain_decode", layers=a.layers, context=a.context, tokens=a.tokens, read_gbps=bw / 1e9,
               floor_ms=floor_ms, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=rows)
    print(f"floor {floor_ms:.3f} ms/token at {bw / 1e9:.0f} GB/s")
    for r in rows:
        print(f"async scheduling {'on ' if r['async_scheduling'] else 'off'}, shared experts "
              f"{'fused' if r['shared_experts_fusion'] else 'unfused'}: {r['ms_per_token']:.3f} ms/token "
              f"({r['tok_per_s']:.0f} tok/s), {r['x_floor']:.2f}x floor")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
