"""What an engine's CUDA graphs take of the GPU, beside its KV cache (issue 18: the adaptive engine's graphs
did not fit an H100 and its decode steps ran eagerly).

    PYTHONPATH=$PWD python benchmarks/graph_memory.py MODEL --engine plain|k3|adaptive [--load-format dummy]

Starts one ``LLM`` (``max_num_seqs`` 256, ``max_model_len`` 1024, bfloat16, default ``gpu_memory_utilization``)
and prints the device memory (torch's allocated / reserved, the device's in use) when the KV cache is sized,
before and after the graphs are captured, and the KV cache's size; then whether the capture failed. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description="What an engine's CUDA graphs take of the GPU beside its KV cache (GPU "
                                 "only): device memory when the KV cache is sized, before and after the capture")
    ap.add_argument("model", help="a model folder (random weights: --load-format dummy)")
    ap.add_argument("--engine", choices=["plain", "k3", "adaptive"], default="adaptive",
                    help="plain decoding, k = 3, or adaptive speculation (k = 0..3: graphs for every verify width)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("graph_memory.py measures CUDA memory: it needs a GPU")
    import mtpspec.engine.kv_cache as kv_cache
    from mtpspec import LLM
    from mtpspec.engine import forward

    figures = {}

    def snap(tag: str) -> None:
        free, total = torch.cuda.mem_get_info()
        figures[tag] = {"allocated_gib": torch.cuda.memory_allocated() / GIB,
                        "reserved_gib": torch.cuda.memory_reserved() / GIB, "in_use_gib": (total - free) / GIB,
                        "total_gib": total / GIB}
        f = figures[tag]
        print(f"{tag:16s} allocated {f['allocated_gib']:6.2f}  reserved {f['reserved_gib']:6.2f}  in use "
              f"{f['in_use_gib']:6.2f} of {f['total_gib']:.2f} GiB", flush=True)

    sizing = kv_cache.available_kv_blocks

    def sized(layers, cfg, dtype, device, max_useful):
        snap("before sizing")
        n = sizing(layers, cfg, dtype, device, max_useful)
        per = kv_cache.bytes_per_block(layers, cfg.block_size, dtype)
        figures["kv_cache"] = {"blocks": n, "gib": n * per / GIB, "gpu_memory_utilization": cfg.gpu_memory_utilization}
        print(f"KV cache         {n} blocks x {per / 2**20:.3f} MiB = {n * per / GIB:.2f} GiB "
              f"(gpu_memory_utilization {cfg.gpu_memory_utilization})", flush=True)
        return n
    kv_cache.available_kv_blocks = sized
    capture = forward.GraphedForward.capture

    def captured(self, proposer):
        snap("before capture")
        capture(self, proposer)
        snap("after capture")
        figures["graphs"] = len(self.graphs)
        figures["capture_failed"] = self.capture_failed
        figures["graphs_gib"] = figures["after capture"]["allocated_gib"] - figures["before capture"]["allocated_gib"]
        print(f"graphs           {len(self.graphs)}, {figures['graphs_gib']:.2f} GiB allocated by the capture; "
              f"capture failed: {self.capture_failed}", flush=True)
        dump()  # now: the adaptive engine's start-up timing after a failed capture runs eagerly and long
    forward.GraphedForward.capture = captured
    def dump() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"engine": a.engine, **figures}, f, indent=1)

    spec = None if a.engine == "plain" else {"num_speculative_tokens": 3, "adaptive": a.engine == "adaptive"}
    llm = LLM(a.model, speculative_config=spec, max_num_seqs=a.max_num_seqs, max_model_len=1024,
              load_format=a.load_format, dtype="bfloat16")
    snap("after LLM()")
    dump()
    llm.shutdown()


if __name__ == "__main__":
    main()
