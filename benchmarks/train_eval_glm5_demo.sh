#!/usr/bin/env bash
# Train the GLM-5-architecture demo model (issue 16) and/or evaluate it on GSM8K, as recorded in
# mtpspec/demo_model_glm5/README.md. Usage:
#   benchmarks/train_eval_glm5_demo.sh train OUT_DIR [extra `mtpspec train` flags]
#   benchmarks/train_eval_glm5_demo.sh eval MODEL_DIR RESULTS_DIR DEVICE [LIMIT]
# `eval` runs k = 0, 1, 3 with index sharing off and k = 1, 3 with it on, all fp32 and greedy, one
# after another (each about 25 s on an H200; parallel runs on one GPU failed: each run's
# --gpu-memory-utilization counts the others' memory as in use), and writes eval_k{K}_share{0,1}.json
# per run and the reports in eval.log (GPU_MEM: --gpu-memory-utilization, default 0.5).
set -euo pipefail
PY=${PYTHON:-python3}
usage() { echo "usage: $0 train OUT [flags] | eval MODEL RESULTS DEVICE [LIMIT]" >&2; exit 2; }
[ $# -ge 1 ] || usage
cmd=$1; shift
case "$cmd" in
  train)
    [ $# -ge 1 ] || usage
    out=$1; shift
    $PY -m mtpspec.entrypoints.cli train --arch glm_moe_dsa --output-dir "$out" --overwrite-output-dir "$@" ;;
  eval)
    [ $# -ge 3 ] || usage
    model=$1 res=$2 dev=$3 limit=${4:-}
    mkdir -p "$res"
    rm -f "$res/eval.log"
    lim=(); [ -n "$limit" ] && lim=(--limit "$limit")
    rc=0
    for run in "0 0" "1 0" "3 0" "1 1" "3 1"; do
      set -- $run; k=$1 share=$2
      if [ "$k" = 0 ]; then spec=null; else
        spec="{\"method\":\"mtp\",\"num_speculative_tokens\":$k,\"index_share_for_mtp_iteration\":$([ "$share" = 1 ] && echo true || echo false)}"
      fi
      [ "$k" = 0 ] && [ "$share" = 1 ] && continue
      ( s0=$SECONDS; $PY -m mtpspec.entrypoints.cli eval gsm8k --model "$model" --speculative-config "$spec" \
          --dtype float32 --device "$dev" --gpu-memory-utilization ${GPU_MEM:-0.5} --no-progress "${lim[@]}" --json "$res/eval_k${k}_share${share}.json" \
          > "$res/eval_k${k}_share${share}.log" 2>&1; rc=$?; echo "wall $((SECONDS - s0)) s" >> "$res/eval_k${k}_share${share}.log"; exit $rc ) || rc=1
    done
    tail -n 60 "$res"/eval_k*.log > "$res/eval.log"; rm "$res"/eval_k*.log; cat "$res/eval.log"
    exit $rc ;;
  *) usage ;;
esac
