#!/usr/bin/env bash
# `make demo`: a local cluster on loopback — a head and four workers in two sites (emulated GPUs) —
# then `geotrain status`, a job submitted and followed through its first events, and a clean stop of
# everything this script started (also on Ctrl-C or an error).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
geotrain="$root/build/bin/geotrain"
[ -x "$geotrain" ] || { echo "demo: $geotrain is missing; run 'make build' first" >&2; exit 1; }

work="$(mktemp -d /tmp/geotrain-demo.XXXXXX)"
export GEOTRAIN_HOME="$work/home"   # keeps the demo's cluster record apart from any real head's
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
metrics=$(free_port)

echo "== starting a head on 127.0.0.1:$port (metrics on :$metrics, state in $work/state)"
"$geotrain" head start --port "$port" --metrics-port "$metrics" --state-dir "$work/state" >"$work/head.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do "$geotrain" status >/dev/null 2>&1 && break; sleep 0.1; done

echo "== joining four workers: site utah (2 x RTX6000), site amsterdam (A30, T4)"
start_worker() {
  "$geotrain" worker start --site "$1" --emulate-device "$2" --metrics-port -1 >"$work/worker-$1-$3.log" 2>&1 &
  pids+=($!)
}
start_worker utah RTX6000 1
start_worker utah RTX6000 2
start_worker amsterdam A30 1
start_worker amsterdam T4 2
for _ in $(seq 100); do
  alive=$("$geotrain" status --json 2>/dev/null | grep -c '"WORKER_ALIVE"' || true)
  [ "$alive" -ge 4 ] && break
  sleep 0.2
done

echo
"$geotrain" status
echo
cat >"$work/job.yaml" <<'SPEC'
name: demo-job
model: {preset: gpt2-demo}
train: {global_batch: 8, seq_len: 64, steps: 20}
parallel: {plan: manual, dp: 2, pp: 2, microbatches: 2}
comm: {wan_codec: bf16}
SPEC
echo "== submitting a job"
"$geotrain" job submit "$work/job.yaml"
"$geotrain" job list
echo
echo "== metrics (a few of them) from http://127.0.0.1:$metrics/metrics"
curl -s "http://127.0.0.1:$metrics/metrics" | grep -E '^geotrain_(workers|jobs)' | head -8
echo
echo "== stopping everything the demo started"
