#!/usr/bin/env bash
# One H200 session's GPU work, in order of importance; each step bounded so one failure or
# hang cannot eat the rest. Usage (on the GPU machine, repo root): bash benchmarks/run_h200.sh OUTDIR
# GSM8K is read from $GSM8K (default mtpspec/data/gsm8k, the copy bundled with the package).
set -u
OUT=${1:?output folder}
GSM8K=${GSM8K:-mtpspec/data/gsm8k}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() { local t=$1 name=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$t" "$@" 2>&1 | tail -n 40; echo "=== $name rc=${PIPESTATUS[0]}"; }
step 90 top_tokens python3 benchmarks/bench_top_tokens.py --no-bytes --out "$OUT/top.json"
step 120 cuda_graphs python3 benchmarks/check_cuda_graphs.py --json "$OUT/graphs.json"
step 90 engine_step python3 benchmarks/bench_engine_step.py --graph-mode cuda --json "$OUT/engine.json"
eval_() { local t=$1 k=$2; shift 2
  step "$t" "eval_k$k $*" python3 -m mtpspec.entrypoints.cli eval gsm8k --model mtpspec/demo_model \
      --data "$GSM8K/test.jsonl" --train "$GSM8K/train.jsonl" -k "$k" --no-progress --json "$OUT/eval_k$k.json" "$@"; }
eval_ 150 3 --arms baseline,fusion,both   # all 1319 questions, the three arms
eval_ 60 0                                # the target alone: the lossless reference
eval_ 45 1 --limit 300                    # acceptance at k = 1
step 60 p2p_shared_gpu python3 benchmarks/bench_p2p_allreduce_rms_norm.py --mode shared-gpu --tp 2 4 --no-timing --out "$OUT/p2p.json"
