"""Registers, spills and shared memory of the MLA-family kernels, bf16 vs fp8 (E4M3) cache,
compiled ahead of time for sm_90 (no GPU needed; issue 19: the fp8 MLA decode ran at half the
bf16 speed on an H200).

Each variant is compiled by Triton (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, through
:func:`mtpspec.ops.triton_utils.compile_reports`, a child process without ``TRITON_INTERPRET``,
the launch's strides that are multiples of 16 specialised as a launch does). Per variant:
``regs`` and ``spill`` stores / loads (bytes per thread) from ``ptxas -v --gpu-name sm_90a`` on
its PTX (the ptxas Triton picks: Triton 3.6 its bundled ``ptxas``, 3.9 ``ptxas-blackwell``);
``stack`` = cuobjdump's frame of Triton's own cubin (what the compile tests bound); ``smem`` =
shared memory per program (an H200 SM has 228 KB: two programs need at most ~113 KB each);
``shared byte loads`` = single-byte ``ld.shared`` in the PTX (an fp8 tile gathered from shared
memory byte by byte). Variants, at DeepSeek-V3 sizes (kv_lora_rank 512 + rope 64, 64-token cache
blocks, bf16 queries), with the default launch plans (``mla_attention_plan`` /
``sparse_mla_attention_plan``, keys per tile as launched):

* ``mla`` dense decode, 16 heads x 1 query row (16-row tiles, 4 warps) and 128 heads x 4 rows
  (64-row tiles, 8 warps), per-element (pointer) path; ``mla-tma``: 128 heads x 4 rows through
  bulk tensor copies (bf16's default there; fp8 only with ``tma=True``);
* ``sparse`` sparse MLA (16 and 128 heads, top-2048); ``indexer`` logits (64 x 128).

Usage: ``python3 benchmarks/ptxas_spills.py [--kernels mla,mla-tma,sparse,indexer] [--block-n N]
[--json out.json]`` (``--block-n``: keys per tile of every MLA / sparse variant instead of the
launch's choice, ``mla_attention.FP8_BLOCK_N`` for fp8 caches).
Prints one line per variant (the Triton version first). Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtpspec.ops import triton_utils  # noqa: E402

SMS = 132  # H100 / H200
KERNELS = ("mla", "mla-tma", "sparse", "indexer")
ALIGNED = ["ql_ptr", "qp_ptr", "kv_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr"]
#: Strides that are multiples of 16 at these sizes, which a launch specialises on (16-byte
#: vector loads of the cache rows depend on stride_kb / stride_ks).
STRIDES = ["stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_kb", "stride_ks", "stride_ot", "stride_oh"]


def _i32(names: Sequence[str]) -> Dict[str, str]:
    return {n: "i32" for n in names}


def _block_n(block_m: int, cache: str, block_n: Optional[int]) -> int:
    """The launch's keys per tile (``mla_attention.FP8_BLOCK_N`` for fp8 caches) unless given."""
    from mtpspec.ops import mla_attention as mla
    if block_n:
        return block_n
    fp8_block_n = getattr(mla, "FP8_BLOCK_N", {})  # (absent before issue 19's fix: compare older trees)
    return fp8_block_n.get(block_m, mla.BLOCK_N) if cache == "fp8e4nv" else mla.BLOCK_N


def mla_specs(tma: bool, block_n: Optional[int] = None) -> List[Dict[str, Any]]:
    """``_mla_attn`` specs: bf16 and fp8 cache x (16 heads x 1 row, 128 heads x 4 rows)."""
    from mtpspec.ops import mla_attention as mla
    out = []
    for heads, q in ((16, 1), (128, 4)) if not tma else ((128, 4),):
        plan = mla.mla_attention_plan(64, q, heads, 8192, sms=SMS)
        for cache in ("bf16", "fp8e4nv"):
            sig = {"ql_ptr": "*bf16", "qp_ptr": "*bf16", "kv_ptr": f"*{cache}", "out_ptr": "*bf16",
                   "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "bt_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32", "k_scale": "fp32",
                   **_i32(["stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_kb", "stride_ks",
                           "stride_ot", "stride_oh", "stride_bt", "stride_pt", "stride_ph"])}
            bn = _block_n(plan["block_m"], cache, block_n)
            ce = dict(NUM_HEADS=heads, LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, BLOCK_M=plan["block_m"],
                      BLOCK_N=bn, CACHE_BLOCK=64, SPLIT=True, TMA=tma, WARP_SPECIALIZE=False,
                      TAIL_STAGES=1 if tma else mla.NUM_STAGES, DOT_FP32=False, PRECISION="tf32",
                      BF16_BY_BITS=False, FP8=cache == "fp8e4nv")
            if tma:
                sig.update(kvl_desc=f"tensordesc<{cache}[{bn}, 256]>", kvr_desc=f"tensordesc<{cache}[{bn}, 64]>")
            else:
                ce.update(kvl_desc=None, kvr_desc=None)
            out.append({"name": f"mla{'-tma' if tma else ''} {heads}h x {q}q {cache[:4]} (block_m {plan['block_m']}, "
                                f"block_n {bn}, {plan['num_warps']} warps)",
                        "module": "mtpspec.ops.mla_attention", "kernel": "_mla_attn", "signature": sig,
                        "constexprs": ce, "aligned": ALIGNED + ["bt_ptr"] + STRIDES,
                        "num_warps": plan["num_warps"],
                        "num_stages": mla.NUM_STAGES})
    return out


def sparse_specs(block_n: Optional[int] = None) -> List[Dict[str, Any]]:
    """``_sparse_mla`` specs: bf16 and fp8 cache x 16 / 128 heads, top-2048."""
    from mtpspec.ops.sparse_mla_attention import sparse_mla_attention_plan
    out = []
    for heads in (16, 128):
        plan = sparse_mla_attention_plan(64, heads, 2048, SMS)
        for cache in ("bf16", "fp8e4nv"):
            bn = _block_n(plan["block_m"], cache, block_n)
            out.append({"name": f"sparse {heads}h {cache[:4]} (block_m {plan['block_m']}, block_n {bn}, "
                                f"{plan['num_warps']} warps)",
                        "module": "mtpspec.ops.sparse_mla_attention", "kernel": "_sparse_mla",
                        "signature": {"ql_ptr": "*bf16", "qp_ptr": "*bf16", "kv_ptr": f"*{cache}", "slots_ptr": "*i32",
                                      "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                                      "qk_scale": "fp32", "num_topk": "i32", "n_slots": "i32", "num_splits": "i32",
                                      "k_scale": "fp32",
                                      **_i32(["stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_kb",
                                              "stride_ks", "stride_st", "stride_ot", "stride_oh", "stride_pt",
                                              "stride_ph"])},
                        "constexprs": dict(NUM_HEADS=heads, LORA=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                                           BLOCK_M=plan["block_m"], BLOCK_N=bn, SCAN_N=256, CACHE_BLOCK=64, SPLIT=True,
                                           DOT_FP32=False, PRECISION="tf32", BF16_BY_BITS=False,
                                           FP8=cache == "fp8e4nv"),
                        "aligned": ALIGNED + ["slots_ptr"] + STRIDES, "num_warps": plan["num_warps"]})
    return out


def indexer_specs() -> List[Dict[str, Any]]:
    """``_indexer_logits`` specs: bf16 and fp8 key cache, 64 heads x 128."""
    out = []
    for cache in ("bf16", "fp8e4nv"):
        out.append({"name": f"indexer 64h x 128 {cache[:4]}", "module": "mtpspec.ops.indexer",
                    "kernel": "_indexer_logits",
                    "signature": {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": f"*{cache}", "out_ptr": "*fp32",
                                  "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "out_width": "i32",
                                  "k_scale": "fp32", **_i32(["stride_qt", "stride_qh", "stride_wt", "stride_kb",
                                                             "stride_ks", "stride_ot", "stride_bt"])},
                    "constexprs": dict(NUM_HEADS=64, HEAD_DIM=128, BLOCK_H=64, BLOCK_D=128, BLOCK_N=64,
                                       KEYS_PER_PROGRAM=512, CACHE_BLOCK=64, DOT_FP32=False, PRECISION="tf32",
                                       FP8=cache == "fp8e4nv"),
                    "aligned": ["q_ptr", "w_ptr", "k_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kb",
                                "stride_ks"], "num_warps": 4})
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--block-n", type=int, default=None,
                   help="keys per tile of the MLA / sparse variants (default: each launch's choice)")
    p.add_argument("--json", default=None, help="also write the reports here")
    args = p.parse_args(argv)
    kinds = [k for k in args.kernels.split(",") if k]
    unknown = set(kinds) - set(KERNELS)
    if unknown:
        p.error(f"unknown --kernels {sorted(unknown)}; choose from {KERNELS}")
    specs: List[Dict[str, Any]] = []
    for kind in kinds:
        specs += {"mla": lambda: mla_specs(False, args.block_n), "mla-tma": lambda: mla_specs(True, args.block_n),
                  "sparse": lambda: sparse_specs(args.block_n), "indexer": indexer_specs}[kind]()
    import triton
    print(f"triton {triton.__version__}, sm_90a (registers, spill stores / loads in bytes per thread; "
          f"stack = cuobjdump's frame; smem = shared memory per program, bytes; shared byte loads = ld.shared of "
          f"single bytes in the PTX)")
    names = [s.pop("name") for s in specs]
    reports = triton_utils.compile_reports(specs, ptxas=True)
    rows = []
    for name, rep in zip(names, reports):
        rows.append(dict(variant=name, **rep))
        print(f"{name:52s} regs {rep['ptxas_registers']!s:>4}  spill {rep['spill_stores']!s:>5} / "
              f"{rep['spill_loads']!s:<5} stack {rep['spill_bytes']!s:>5}  smem {rep['shared_bytes']!s:>6}  "
              f"shared byte loads {rep['ptx_shared_byte_loads']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "reports": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
