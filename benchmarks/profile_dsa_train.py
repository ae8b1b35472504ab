"""Where a training step of the GLM-5-architecture demo model spends its time (issue 16).

Times forward + backward (no optimizer) of the recipe's step (:func:`mtpspec.training.step.forward_loss`)
on random token batches of ``B x L`` (65,536 slots, the recipe's batch), for the GLM-4.5 demo preset
(baseline) and the GLM-5 demo preset with DSA training in ``dense`` and ``sparse`` mode, the indexer's KL
over every query row (stride 1) and every 8th (the recipe's ``--indexer-kl-row-stride``), then prints
torch.profiler's top CUDA kernels for one DSA step per mode.

``python3 benchmarks/profile_dsa_train.py [--shapes 32x2048,128x512] [--json out.json]`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(arch: str, device, dtype):
    from mtpspec.config import ModelConfig
    from mtpspec.training.model_setup import build_models, make_config_dict
    cfg = make_config_dict("demo", 10007, 0, arch=arch)
    target, mtp = build_models(ModelConfig.from_dict(cfg), device, dtype)
    dsa = None
    if arch == "glm_moe_dsa":
        from mtpspec.training.dsa import DsaTraining
        dsa = DsaTraining([target, mtp], "dense")
    return target, mtp, dsa


def step_fn(target, mtp, dsa, batch, device):
    from mtpspec.training.step import forward_loss

    def run():
        out = forward_loss(target, mtp, batch, device, 0.6, mtp_depth=3, dsa=dsa)
        out.loss.backward()
        for m in (target, mtp):
            for p in m.parameters():
                p.grad = None
    return run


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    from mtpspec.training.packing import Batch
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x2048,64x1024,128x512,256x256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-shape", default="32x2048")
    ap.add_argument("--profile-stride", type=int, default=8, help="the indexer KL's row stride in the profiled steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": []}
    models = {a: build(a, device, dtype) for a in ("glm4_moe", "glm_moe_dsa")}
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        b, length = map(int, shape.split("x"))
        batch = Batch(torch.randint(1, 10007, (b, length), generator=g), torch.full((b,), length))
        row = {"B": b, "L": length}
        t, m, _ = models["glm4_moe"]
        row["glm4_moe_ms"] = timed(step_fn(t, m, None, batch, device), args.reps) * 1e3
        t, m, dsa = models["glm_moe_dsa"]
        for stride in (1, 8):
            dsa.kl_row_stride = stride
            for mode in ("dense", "sparse"):
                dsa.set_mode(mode)
                row[f"dsa_{mode}_stride{stride}_ms"] = timed(step_fn(t, m, dsa, batch, device), args.reps) * 1e3
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        res["rows"].append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    b, length = map(int, args.profile_shape.split("x"))
    batch = Batch(torch.randint(1, 10007, (b, length), generator=g), torch.full((b,), length))
    t, m, dsa = models["glm_moe_dsa"]
    from torch.profiler import ProfilerActivity, profile
    dsa.kl_row_stride = args.profile_stride
    for mode in ("dense", "sparse"):
        dsa.set_mode(mode)
        fn = step_fn(t, m, dsa, batch, device)
        fn()
        sync()
        acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            fn()
            sync()
        print(f"--- DSA {mode}, {b}x{length}: top CUDA kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=18, max_name_column_width=70))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
