#!/usr/bin/env bash
# CURVE on/off: PD W1 over HTTP (serve --mode pd with its ephemeral keys vs --insecure-cluster), alternated twice,
# then the P->D transfer bandwidth. Run from the repository root with nothing else running.
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
lscpu | grep "Model name"; date
for round in 1 2; do
for mode in keys insecure; do
  flags=""; [ "$mode" = insecure ] && flags="--insecure-cluster"
  .venv/bin/kvfence serve --mode pd --port 8123 $flags > "${TMPDIR:-/tmp}"/kvfence-serve-$mode-$round.log 2>&1 &
  pid=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 0.5; done
  echo "== round $round, PD $mode"
  $PY bench/serve.py --base-url http://127.0.0.1:8123 --workload W1 --json "${TMPDIR:-/tmp}"/kvfence-w1-$mode-$round.json 2>&1 | grep -vi "it/s\|%|" | tail -12
  kill -INT $pid; wait $pid
done
done
$PY bench/transfer.py --skip-ttft --curve both --windows 8 --pages 125,13 --transfers 8 2>&1 | grep -v "^ w=\|wall us/page per step"
