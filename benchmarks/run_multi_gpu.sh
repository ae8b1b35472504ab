#!/usr/bin/env bash
# Issue 7's multi-GPU session (2, 4 or 8 GPUs of one host), in bounded steps: one failure or hang
# cannot eat the rest, and the whole call stays inside BUDGET_S (default 570 s, under a device
# command's 600 s limit); steps that no longer fit are skipped and the command that resumes them
# is printed. Usage (repo root on the GPU machine; carry .whl):
#   bash benchmarks/run_multi_gpu.sh OUTDIR [STEP ...]
# STEPs (default: all, in this order):
#   collectives      benchmarks/bench_draft_collectives.py at every tp in TPS
#   p2p              benchmarks/bench_p2p_allreduce_rms_norm.py --mode multi-gpu at TPS
#   ckpt             write the random-weight GLM-4.5-Air-shaped checkpoint to AIR_DIR (if missing)
#   arms-air:TP:K    `mtpspec bench arms` batch1,c64 on AIR_DIR, --tp TP -k K, --forced-acceptance FORCED
#   arms-demo:TP:K   `mtpspec bench arms` batch1,c64 on the demo model (GSM8K prompts), --tp TP -k K
# Environment: TPS (default: 2 4 8 up to the GPU count), KS (3 5), SCALE (0.25: preset lengths and
# prompt counts), REPEATS (2), FORCED (rate:0.7), AIR_DIR (/tmp/glm45air_random), AIR_LAYERS (2
# target layers, the first dense, + 1 MTP layer), GSM8K (mtpspec/data/gsm8k), BUDGET_S (570), ARMS_MIN_S (400:
# an arms step starts only with this much budget left). One arms step is ~250 s at SCALE 0.25 on one
# H200 (tp 1, demo model); give each device call one or two arms steps.
set -u
OUT=${1:?usage: run_multi_gpu.sh OUTDIR [STEP ...]}
shift
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
TPS=${TPS:-$(for t in 2 4 8; do [ "$t" -le "$NGPU" ] && printf '%s ' "$t"; done)}
KS=${KS:-3 5}
SCALE=${SCALE:-0.25}
REPEATS=${REPEATS:-2}
FORCED=${FORCED:-rate:0.7}
AIR_DIR=${AIR_DIR:-/tmp/glm45air_random}
AIR_LAYERS=${AIR_LAYERS:-2}
GSM8K=${GSM8K:-mtpspec/data/gsm8k}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The server's wheels (fastapi, uvicorn, pydantic, opentelemetry-api, ...) travel in .whl/.
SITE=/tmp/site
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d "$SITE/fastapi" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >/dev/null 2>&1 || echo "wheel install failed (bench arms needs fastapi/uvicorn)"
fi
export PYTHONPATH=$SITE:$PWD
echo "GPUs: $NGPU; TPS: ${TPS:-none}; KS: $KS; scale $SCALE; repeats $REPEATS; budget ${BUDGET_S}s; $(git rev-parse --short HEAD 2>/dev/null)"
if [ -z "${TPS// }" ]; then echo "no tp size fits $NGPU GPU(s): this script needs 2, 4 or 8 GPUs"; exit 2; fi

if [ $# -eq 0 ]; then
  set -- collectives p2p ckpt
  for k in $KS; do for t in $TPS; do set -- "$@" "arms-air:$t:$k"; done; done
  for k in $KS; do for t in $TPS; do set -- "$@" "arms-demo:$t:$k"; done; done
fi

# step LIMIT_S NAME CMD...: run CMD under timeout (clipped to the budget left), keep the log's tail.
step() {
  local t=$1 name=$2; shift 2
  local left=$((BUDGET_S - ($(date +%s) - T0)))
  [ "$t" -gt "$left" ] && t=$left
  if [ "$t" -lt "${MIN_S:-60}" ]; then echo "=== $name SKIPPED (${left}s of budget left)"; return 3; fi
  echo "=== $name ($(date +%T), limit ${t}s)"
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name rc=$rc ($(( $(date +%s) - T0 ))s elapsed)"
  return 0
}

# The checkpoint helper: a random-weight GLM-4.5-Air-shaped checkpoint (AIR_* variables shrink it for tests).
cat > "$OUT/make_air_ckpt.py" <<'EOF'
import json, math, os, shutil, sys
import torch
from mtpspec.config import ModelConfig
from mtpspec.models.glm4_moe import target_weight_specs
from mtpspec.models.glm4_moe_mtp import mtp_weight_specs
from mtpspec.models.loader import save_checkpoint
path = sys.argv[1]
e = lambda k, d: int(os.environ.get(k, d))
raw = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_act="silu",
           hidden_size=e("AIR_HIDDEN", 4096), intermediate_size=e("AIR_INTERMEDIATE", 10944),
           num_attention_heads=e("AIR_HEADS", 96), num_key_value_heads=e("AIR_KV_HEADS", 8), head_dim=e("AIR_HEAD_DIM", 128),
           vocab_size=e("AIR_VOCAB", 151552), moe_intermediate_size=e("AIR_MOE_INTERMEDIATE", 1408),
           n_routed_experts=e("AIR_EXPERTS", 128), num_experts_per_tok=8, n_shared_experts=1,
           first_k_dense_replace=1, num_hidden_layers=e("AIR_LAYERS", 2), num_nextn_predict_layers=1,
           partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, norm_topk_prob=True,
           routed_scaling_factor=1.0, n_group=1, topk_group=1, rope_theta=1000000.0, rms_norm_eps=1e-5,
           tie_word_embeddings=False, max_position_embeddings=16384, eos_token_id=0, pad_token_id=0,
           bos_token_id=None, torch_dtype="bfloat16", use_cache=True, attention_dropout=0.0)
cfg = ModelConfig.from_dict(raw)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator(device=dev).manual_seed(0)
tensors = {}
for key, spec in {**target_weight_specs(cfg), **mtp_weight_specs(cfg)}.items():
    if spec.ignored or (spec.layout or "").endswith(":per_expert") or key.endswith("shared_head.head.weight"):
        continue  # fused expert layout; the MTP head is tied to lm_head
    shape = spec.shape
    if key.endswith("norm.weight"):
        t = torch.ones(shape, device=dev)
    elif key.endswith("e_score_correction_bias"):
        t = torch.zeros(shape, device=dev)
    elif len(shape) == 1:
        t = 0.02 * torch.randn(shape, generator=g, device=dev)
    elif "embed_tokens" in key or key == "lm_head.weight":
        t = torch.randn(shape, generator=g, device=dev)
    else:
        t = torch.randn(shape, generator=g, device=dev) / math.sqrt(shape[-1])
    tensors[key] = t.to(torch.bfloat16)
save_checkpoint(path, tensors, raw, max_shard_bytes=4 << 30, dtype=torch.bfloat16)
shutil.copy(os.path.join("mtpspec", "demo_model", "tokenizer.json"), path)  # ids past its vocab decode to ""
n = sum(t.numel() for t in tensors.values())
print(f"wrote {path}: {n / 1e9:.2f} B parameters, {len(tensors)} tensors, {cfg.num_hidden_layers} layers + 1 MTP")
EOF

arms() {  # arms MODEL_KIND TP K
  local kind=$1 tp=$2 k=$3 dir="$OUT/arms_$1_tp$2_k$3"
  local model=mtpspec/demo_model extra=(--dataset "$GSM8K/test.jsonl") margs=""
  if [ "$kind" = air ]; then
    model=$AIR_DIR extra=(--random-prompts --ignore-eos --forced-acceptance "$FORCED") margs=" --max-model-len 16384"
    [ -f "$AIR_DIR/config.json" ] || step 240 ckpt python3 "$OUT/make_air_ckpt.py" "$AIR_DIR"
  fi
  MIN_S=${ARMS_MIN_S:-400} step 540 "arms_${kind}_tp${tp}_k${k}" python3 -m mtpspec.entrypoints.cli bench arms --model "$model" \
    --workloads batch1,c64 --scale "$SCALE" --repeats "$REPEATS" --server-args "--tp $tp -k $k$margs" \
    --output-dir "$dir" --no-progress "${extra[@]}"
}

remaining=("$@")
for s in "$@"; do
  case $s in
    collectives) step 420 collectives python3 benchmarks/bench_draft_collectives.py --tp $TPS --out "$OUT/collectives.json" ;;
    p2p) step 300 p2p python3 benchmarks/bench_p2p_allreduce_rms_norm.py --mode multi-gpu --tp $TPS --out "$OUT/p2p.json" ;;
    ckpt) if [ -f "$AIR_DIR/config.json" ]; then echo "=== ckpt: $AIR_DIR exists"; else step 240 ckpt python3 "$OUT/make_air_ckpt.py" "$AIR_DIR"; fi ;;
    arms-air:*:*|arms-demo:*:*) IFS=: read -r a tp k <<< "$s"; arms "${a#arms-}" "$tp" "$k" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
  rc=$?
  if [ $rc -eq 3 ]; then
    echo "out of budget; resume with: bash benchmarks/run_multi_gpu.sh $OUT ${remaining[*]}"
    break
  fi
  remaining=("${remaining[@]:1}")
done
ls "$OUT"
