#!/usr/bin/env bash
# Issue 17's two GPU goals against one `mtpspec serve` of a config-only model with random weights
# (--load-format dummy; benchmarks/make_dummy_model.py): TTFT of prefix-cache hits vs misses on
# 5-shot GSM8K prompts (`bench serve --shared-prefix`), and, when the workload exists, the ITL of
# running decodes while long prompts are prefilled in chunks (`bench serve --prefill-interference`).
# Usage: benchmarks/run_serving_goals.sh OUT [PRESET] [extra serve flags]
# (SKIP_PREFIX=1 / SKIP_INTERFERENCE=1 leave out one of the two benches; LAYERS=N overrides the preset's depth;
# THROUGHPUT_ARGS="..." adds one plain `bench serve` run with those flags, e.g. to see a serve flag's cost at load)
set -uo pipefail
out=$1; preset=${2:-dense-70b-16l}; shift; shift || true
PY=${PYTHON:-python3}
port=8011
mkdir -p "$out"
$PY benchmarks/make_dummy_model.py /tmp/dummy_model --preset "$preset" ${LAYERS:+--num-hidden-layers $LAYERS} || exit 1
$PY -m mtpspec.entrypoints.cli serve --model /tmp/dummy_model --load-format dummy -k 3 --max-model-len 10240 \
    --port $port "$@" > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for i in $(seq 1 300); do
  curl -sf http://127.0.0.1:$port/health > /dev/null && break
  kill -0 $server 2>/dev/null || { echo "server died"; tail -30 "$out/serve.log"; exit 1; }
  sleep 1
done
echo "server up after ${SECONDS}s"
[ -n "${SKIP_PREFIX:-}" ] || $PY -m mtpspec.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --shared-prefix --json "$out/prefix_ttft.json"
if [ -z "${SKIP_INTERFERENCE:-}" ] && $PY -m mtpspec.entrypoints.cli bench serve --help | grep -q -- --prefill-interference; then
  $PY -m mtpspec.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --prefill-interference \
      --json "$out/prefill_interference.json" ${INTERFERENCE_ARGS:-}
fi
if [ -n "${THROUGHPUT_ARGS:-}" ]; then
  $PY -m mtpspec.entrypoints.cli bench serve --base-url http://127.0.0.1:$port --no-progress $THROUGHPUT_ARGS \
      --json "$out/throughput.json"
fi
