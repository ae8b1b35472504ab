"""Check that decode steps capture as CUDA graphs, and time paged attention and the MoE paths.

1. Engine check (correctness): a tiny random GLM-4.5-family checkpoint (with an MTP layer),
   served by ``LLM(..., graph_mode="cuda")`` (verify, MTP first pass and every draft step
   captured per padded batch size) and by ``LLM(..., graph_mode="off")`` (eager), greedy, for
   batches of 1, 3 and ``max_num_seqs`` prompts, speculative (``k``) and plain decoding.
   Passes when capture succeeded (no ``capture_failed``), ``num_eager_fallbacks == 0``, graph
   steps ran (decode steps, and one-sequence prefill steps: the batch of 1), and the fp32 tokens equal eager's (bf16 token agreement is reported, not required:
   eager and padded graph batches may split attention keys differently).
2. Paged attention: the Triton kernel vs the torch SDPA path of ``Attention`` (both sync-free,
   each timed eagerly and as a CUDA graph), bf16, 32 query heads x 128, 8 kv heads, block 16,
   1 and 64 sequences x context 1024 and 8192, decode (q = 1) and verify (q = 1 + k); the KV
   write of the step's rows is included. ``GB/s``: K/V bytes attended / kernel time.
   The outputs of both paths are compared (max abs difference).
3. MoE: ``FusedMoE`` paths (Triton ``kernel``, torch ``gather`` / ``dense`` / ``grouped``) at
   GLM-4.5-Air width (128 experts, hidden 4096, 1408, top 8), bf16, for 1..256 tokens; each
   path's output is compared with the kernel's. ``floor``: routed experts' weight bytes / read
   bandwidth.

Usage (GPU): ``python3 benchmarks/check_cuda_graphs.py [--k 3] [--json out.json]``; exit status 1
when the engine check fails. ``--smoke`` runs everything tiny on CPU (graph_mode "static",
Triton interpreter) to prove the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

if "--smoke" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mtpspec.attention.backends.paged_gqa as attention_mod  # noqa: E402
from mtpspec.layers.attention import Attention, build_attention_metadata, set_forward_context  # noqa: E402
from mtpspec.layers.fused_moe import FusedMoE, MoEGate  # noqa: E402
from benchmarks._timing import Timer, fmt, read_bandwidth  # noqa: E402

#: Untimed calls before each measurement and before a graph capture.
WARMUP = 2


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", default="", help="comma list of parts to skip: engine,attention,moe")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (static graph mode, Triton interpreter)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- 1. engine
def engine_check(device: torch.device, k: int, smoke: bool) -> List[Dict[str, Any]]:
    from mtpspec import LLM, SamplingParams
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import make_tiny_checkpoint  # test helper (needs transformers)

    mode = "static" if smoke else "cuda"
    max_num_seqs = 4 if smoke else 8
    rows = []
    with tempfile.TemporaryDirectory() as path:
        overrides = {} if smoke else dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                          intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                                          num_experts_per_tok=4, max_position_embeddings=1024)
        _, cfg = make_tiny_checkpoint(path, seed=7, **overrides)
        g = torch.Generator().manual_seed(1)
        lens = [1, 9, 30, 4, 17, 2, 23, 12][:max_num_seqs]
        prompts = [{"prompt_token_ids": torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()} for n in lens]
        max_tokens = 6 if smoke else 40
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for dtype in (["float32"] if smoke else ["float32", "bfloat16"]):
            for spec_k in (k, 0):
                spec = {"num_speculative_tokens": spec_k} if spec_k else None
                kw = dict(dtype=dtype, device=device.type, speculative_config=spec, max_num_seqs=max_num_seqs,
                          max_model_len=128 if smoke else 512, block_size=16, num_kv_blocks=256, seed=0)
                outs, accepted = {}, {}
                info: Dict[str, Any] = {}
                for gm in ("off", mode):
                    t0 = time.perf_counter()
                    with LLM(path, graph_mode=gm, **kw) as llm:
                        got = []
                        for n in (1, 3, max_num_seqs):
                            got += [o.outputs[0].token_ids for o in llm.generate(prompts[:n], sp, use_tqdm=False)]
                        outs[gm] = got
                        accepted[gm] = llm.get_metrics().get("num_accepted_tokens", 0)
                        if gm != "off":
                            fwd = llm.executor.runner.fwd
                            info = dict(capture_failed=fwd.capture_failed, graphs=len(fwd.graphs),
                                        graph_steps=fwd.num_graph_steps,
                                        prefill_graph_steps=fwd.num_prefill_graph_steps,
                                        mixed_graph_steps=fwd.num_mixed_graph_steps,
                                        fallbacks=llm.get_metrics()["num_eager_fallbacks"],
                                        seconds=time.perf_counter() - t0)
                same = sum(a == b for a, b in zip(outs["off"], outs[mode]))
                ok = info["capture_failed"] is None and info["fallbacks"] == 0 and info["graph_steps"] > 0 and \
                    info["prefill_graph_steps"] > 0 and \
                    (mode == "static" or info["graphs"] > 0)
                # steps of several prompts run their draft steps (k > 1) through the step units
                ok = ok and (info["mixed_graph_steps"] > 0) == (spec_k > 1)
                if dtype == "float32":  # the same tokens, and the same drafts accepted
                    ok = ok and same == len(outs["off"]) and accepted["off"] == accepted[mode]
                rows.append(dict(dtype=dtype, k=spec_k, mode=mode, requests=len(outs["off"]), same_tokens=same, ok=ok,
                                 accepted_eager=accepted["off"], accepted_graphs=accepted[mode], **info))
    return rows


def engine_table(rows: List[Dict[str, Any]]) -> str:
    out = [f"{'dtype':<9} {'k':>2} {'mode':<7} {'graphs':>6} {'graph steps':>11} {'mixed':>5} {'fallbacks':>9} "
           f"{'same tokens':>11} {'accepted eager/graphs':>21}  result"]
    for r in rows:
        out.append(f"{r['dtype']:<9} {r['k']:>2} {r['mode']:<7} {r['graphs']:>6} {r['graph_steps']:>11} "
                   f"{r['mixed_graph_steps']:>5} {r['fallbacks']:>9} {r['same_tokens']:>5}/{r['requests']:<5} "
                   f"{r['accepted_eager']:>10}/{r['accepted_graphs']:<10}  "
                   f"{'OK' if r['ok'] else 'FAIL'} {r['capture_failed'] or ''}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- 2. attention
def attention_bench(device: torch.device, k: int, timer: Timer, smoke: bool) -> List[Dict[str, Any]]:
    if smoke:
        nh, nkv, hd, dtype, batches, contexts = 4, 2, 32, torch.float32, (1, 2), (40, 100)
    else:
        nh, nkv, hd, dtype, batches, contexts = 32, 8, 128, torch.bfloat16, (1, 64), (1024, 8192)
    bs = 16
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=device).manual_seed(0)
    for b in batches:
        for ctx in contexts:
            per_seq = -(-(ctx + k + 1) // bs)
            nb = b * per_seq
            layer = Attention(nh, hd, hd ** -0.5, nkv)
            layer.kv_cache = torch.empty(2, nb, bs, nkv, hd, device=device, dtype=dtype).normal_(generator=gd)
            perm = torch.randperm(nb, generator=g).view(b, per_seq).tolist()  # scattered blocks
            for q_len in (1, 1 + k):
                t = b * q_len
                meta = build_attention_metadata([q_len] * b, [ctx + q_len] * b, perm, bs, device)
                q = torch.randn(t, nh * hd, generator=g).to(device=device, dtype=dtype)
                kv = torch.randn(t, 2 * nkv * hd, generator=g).to(device=device, dtype=dtype)
                kk, vv = kv[:, :nkv * hd], kv[:, nkv * hd:]
                res: Dict[str, Any] = dict(batch=b, context=ctx, q_len=q_len)
                outs = {}
                for path, limit in (("kernel", 16), ("sdpa", 0)):
                    attention_mod.KERNEL_MAX_QUERY_LEN = limit

                    def fn(_l=layer, _m=meta):
                        with set_forward_context(_m):
                            return _l(q, kk, vv)
                    with torch.inference_mode():
                        outs[path] = fn().float()
                        try:
                            res[f"{path}_ms"] = timer.eager(fn)
                        except torch.OutOfMemoryError:
                            res[f"{path}_ms"] = None
                            torch.cuda.empty_cache()
                        res[f"{path}_graph_ms"], note = timer.graph(fn, why_chars=60) if res[f"{path}_ms"] is not None else (None, "")
                        res[f"{path}_note"] = note or ""
                attention_mod.KERNEL_MAX_QUERY_LEN = 16
                res["max_abs_diff"] = float((outs["kernel"] - outs["sdpa"]).abs().max())
                kv_bytes = 2 * b * (ctx + q_len) * nkv * hd * layer.kv_cache.element_size()
                best = res["kernel_graph_ms"] or res["kernel_ms"]
                res["kernel_GBps"] = kv_bytes / (best * 1e-3) / 1e9 if best else None
                rows.append(res)
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def attention_table(rows: List[Dict[str, Any]]) -> str:
    out = [f"{'B':>3} {'ctx':>5} {'q':>2} {'kernel ms':>9} {'graph ms':>9} {'GB/s':>7} {'sdpa ms':>9} "
           f"{'graph ms':>9} {'speedup':>7} {'max|diff|':>9}  note"]
    for r in rows:
        kb = r["kernel_graph_ms"] or r["kernel_ms"]
        sb = r["sdpa_graph_ms"] or r["sdpa_ms"]
        sp = sb / kb if kb and sb else None
        out.append(f"{r['batch']:>3} {r['context']:>5} {r['q_len']:>2} {fmt(r['kernel_ms'], 4):>9} "
                   f"{fmt(r['kernel_graph_ms'], 4):>9} {fmt(r['kernel_GBps'], 0):>7} {fmt(r['sdpa_ms'], 4):>9} "
                   f"{fmt(r['sdpa_graph_ms'], 4):>9} {fmt(sp, 1):>7} {r['max_abs_diff']:>9.2e}  "
                   f"{r['kernel_note'] or r['sdpa_note']}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- 3. MoE
def moe_bench(device: torch.device, timer: Timer, bw: float, smoke: bool) -> List[Dict[str, Any]]:
    if smoke:
        e, h, inter, top, dtype, sizes = 8, 64, 32, 2, torch.float32, (1, 4, 9)
    else:
        e, h, inter, top, dtype, sizes = 128, 4096, 1408, 8, torch.bfloat16, (1, 4, 8, 16, 64, 256)
    g = torch.Generator(device="cpu").manual_seed(2)
    gd = torch.Generator(device=device).manual_seed(2)
    with torch.device(device):
        moe = FusedMoE(e, h, inter, params_dtype=dtype)
        gate = MoEGate(h, e, top)
    with torch.no_grad():
        moe.w13_weight.normal_(generator=gd).mul_(h ** -0.5)
        moe.w2_weight.normal_(generator=gd).mul_(inter ** -0.5)
        gate.weight.normal_(generator=gd)
    expert_bytes = 3 * h * inter * moe.w13_weight.element_size()
    budgets = dict(moe.__dict__)
    rows = []
    for t in sizes:
        x = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
        with torch.inference_mode():
            tw, tid = gate(x)
        n_used = int(torch.unique(tid).numel())
        res: Dict[str, Any] = dict(tokens=t, experts_used=n_used, floor_ms=n_used * expert_bytes / bw * 1e3)
        ref = None
        for path in ("kernel", "gather", "dense", "grouped"):
            moe.kernel_budget_bytes = budgets["kernel_budget_bytes"]
            moe.gather_budget_bytes = 2 ** 40 if path == "gather" else 0
            moe.dense_budget_bytes = 2 ** 40 if path == "dense" else 0
            if path != "kernel":
                os.environ["TRITON_INTERPRET"] = "0"  # torch paths: no Triton on CPU
            forced = path
            try:
                if path == "gather" and 3 * t * top > e:
                    raise RuntimeError("gather only for 3 * tokens * top_k <= experts")
                if device.type == "cuda" and path != "kernel":
                    # On CUDA every size takes the kernel path; call the torch paths directly.
                    fn = {"gather": lambda: _gather(moe, x, tw, tid), "dense": lambda: moe._forward_dense(x, tw, tid),
                          "grouped": lambda: moe._forward_grouped(x, tw, tid)}[path]
                else:
                    assert moe.select_path(t, top, x) == forced, (moe.select_path(t, top, x), forced)
                    fn = (lambda: moe(x, tw, tid))
                with torch.inference_mode():
                    out = fn().float()
                    if ref is None:
                        ref = out
                    res[f"{path}_diff"] = float((out - ref).abs().max())
                    res[f"{path}_ms"] = timer.eager(fn)
                    res[f"{path}_graph_ms"], _ = timer.graph(fn, why_chars=60)
            except (RuntimeError, AssertionError, torch.OutOfMemoryError) as exc:
                res[f"{path}_ms"] = res[f"{path}_graph_ms"] = res[f"{path}_diff"] = None
                res[f"{path}_note"] = str(exc).splitlines()[0][:40]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            finally:
                if "--smoke" in sys.argv:
                    os.environ["TRITON_INTERPRET"] = "1"
        rows.append(res)
    return rows


def _gather(moe: FusedMoE, x: torch.Tensor, tw: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
    from mtpspec.ops.moe_gemm import moe_experts_ref
    return moe_experts_ref(x, moe.w13_weight, moe.w2_weight, tw, tid)


def moe_table(rows: List[Dict[str, Any]]) -> str:
    paths = ("kernel", "gather", "dense", "grouped")
    out = [f"{'T':>4} {'experts':>7} {'floor ms':>8} " + " ".join(f"{p + ' ms':>10} {'graph':>7}" for p in paths)
           + "  max|diff| vs kernel"]
    for r in rows:
        diffs = ", ".join(f"{p} {r[p + '_diff']:.1e}" for p in paths[1:] if r.get(p + "_diff") is not None)
        out.append(f"{r['tokens']:>4} {r['experts_used']:>7} {r['floor_ms']:>8.4f} "
                   + " ".join(f"{fmt(r.get(p + '_ms'), 4):>10} {fmt(r.get(p + '_graph_ms'), 4):>7}" for p in paths)
                   + f"  {diffs}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.iters = min(args.iters, 2)
    skip = set(filter(None, args.skip.split(",")))
    timer = Timer(device, args.iters, WARMUP)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    print(f"device {name}, torch {torch.__version__}, k={args.k}")
    results: Dict[str, Any] = {}
    status = 0
    if "engine" not in skip:
        rows = engine_check(device, args.k, args.smoke)
        results["engine"] = rows
        print("\n== engine: CUDA-graph steps vs eager ==")
        print(engine_table(rows))
        status = 0 if all(r["ok"] for r in rows) else 1
    bw = read_bandwidth(device, cpu_bytes=32 << 20, warmup=WARMUP)
    results["read_bandwidth_GBps"] = bw / 1e9
    if "attention" not in skip:
        rows = attention_bench(device, args.k, timer, args.smoke)
        results["attention"] = rows
        print(f"\n== paged attention (layer forward incl. KV write): Triton kernel vs SDPA path; read bw "
              f"{bw / 1e9:.0f} GB/s ==")
        print(attention_table(rows))
    if "moe" not in skip:
        rows = moe_bench(device, timer, bw, args.smoke)
        results["moe"] = rows
        print("\n== FusedMoE paths (ms; graph = CUDA-graph replay) ==")
        print(moe_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=name, **results), f, indent=1, default=str)
    print(f"\nengine check: {'PASS' if status == 0 else 'FAIL'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
