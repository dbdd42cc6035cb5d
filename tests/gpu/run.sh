#!/usr/bin/env bash
# The GPU check, in one go, on a machine with a CUDA GPU (made for an H100/H200 host with ~16 cores; under
# 8 minutes): configures build-gpu/ with the CUDA backend on, builds the GPU tests, prints the devices,
# runs `ctest -L gpu` (every kernel against the CPU reference, and the whole model where
# tests/gpu/gpu_model_test exists), then the benchmarks that exist: bench_gpu_step (a GPT-2 124M training
# step), a real job on the GPU through head and worker (tests/gpu/job_on_gpu.py) and, with two GPUs or
# more, bench_nccl_allreduce.
#
#   bash tests/gpu/run.sh            # results in $OUT if set, else ./gpu-results/
#   bash tests/gpu/run.sh --plan     # prints the checks it would run, with their limits; runs nothing
#
# What it checks: every kernel and the whole model against the CPU in fp32, bf16 (compute capability 8.0 and
# newer) and fp16, each forced in turn, also against the CPU's emulation of the same precision; NCCL inside the
# GPUs of this machine; a real head-and-worker job in precision auto, fp32, fp16, bf16, and fp16 from a loss scale
# of 2^40 (its overflowing steps skipped on the GPU as on the CPU); the GPT-2 124M step benchmark with its MFU.
#
# Results: one log per step, results.md (pass/fail and time per step, device, ctest summary, benchmark
# figures) and summary.json (the same as JSON), rewritten after every step so that a run cut short still leaves
# them; one line per check on stdout at the end. Each step has its own time
# limit, all of them within an overall budget (GEOTRAIN_GPU_BUDGET_S, default 450 s); a failed step does
# not stop the script, which exits 1 if any step failed.
# Dependencies: if configuring fails, deploy/install-deps.sh runs once and configuring is retried.
set -u -o pipefail
PLAN=0
if [ "${1:-}" = "--plan" ]; then
  PLAN=1
elif [ $# -gt 0 ]; then
  echo "usage: bash tests/gpu/run.sh [--plan]" >&2
  exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
BUILD=${GEOTRAIN_GPU_BUILD:-build-gpu}
RESULTS=${OUT:-$ROOT/gpu-results}
BUDGET_S=${GEOTRAIN_GPU_BUDGET_S:-450}
JOBS=$(nproc)
START_S=$(date +%s)
mkdir -p "$RESULTS"
SUMMARY=$RESULTS/results.md

failed=0
rows=()
checks=()  # "name<TAB>result<TAB>seconds" for summary.json

# The time left in the overall budget, in seconds.
remaining() { echo $((BUDGET_S - ($(date +%s) - START_S))); }

# Rewrites results.md from what is known so far.
write_summary() {
  {
    echo "# geotrain GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host: $(hostname); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- devices: $(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd ';' -)"
    echo "- CUDA architectures: ${CUDA_ARCH:-not configured}; build: $BUILD; $JOBS cores"
    echo
    echo "| step | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    if [ -f "$RESULTS/ctest.log" ]; then
      echo
      echo "## GPU tests (ctest -L gpu)"
      echo
      echo '```'
      grep -E "tests passed|tests failed|Failed|\*\*\*|Not Run|Timeout|seed" "$RESULTS/ctest.log" | head -n 40
      echo '```'
    fi
    for bench in bench_gpu_step bench_nccl_allreduce; do
      if [ -s "$RESULTS/$bench.json" ]; then
        echo
        echo "## $bench"
        echo
        echo '```'
        cat "$RESULTS/$bench.json"
        echo '```'
      fi
    done
  } > "$SUMMARY"
  {
    printf '{"commit": "%s", "plan_only": %s, "checks": [' "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
      "$([ "$PLAN" = 1 ] && echo true || echo false)"
    local first=1 name result seconds
    for c in "${checks[@]}"; do
      IFS=$'\t' read -r name result seconds <<< "$c"
      [ $first = 1 ] || printf ', '
      first=0
      printf '{"name": "%s", "result": "%s", "seconds": %s}' "$name" "${result//\"/\'}" "${seconds:-null}"
    done
    printf ']}\n'
  } > "$RESULTS/summary.json"
}

# step NAME LIMIT_S COMMAND...: runs COMMAND under a time limit (cut to the budget left), its output in
# $RESULTS/NAME.log, and records pass or fail. Returns the command's status.
step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(remaining)
  if [ "$left" -lt 15 ]; then
    skip "$name" "out of time (overall budget ${BUDGET_S}s)"
    failed=1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$PLAN" = 1 ]; then
    echo "would run: $name (limit ${limit}s): $*"
    rows+=("| $name | planned | - |")
    checks+=("$name"$'\t'"planned"$'\t'"null")
    write_summary
    return 0
  fi
  echo "== $name (limit ${limit}s)"
  local begin rc verdict
  begin=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  tail -n 15 "$RESULTS/$name.log"
  verdict=pass
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="FAIL (timed out after ${limit}s)"
  elif [ "$rc" -ne 0 ]; then
    verdict="FAIL (exit $rc)"
  fi
  [ "$rc" -ne 0 ] && failed=1
  rows+=("| $name | $verdict | $(($(date +%s) - begin)) s |")
  checks+=("$name"$'\t'"$verdict"$'\t'"$(($(date +%s) - begin))")
  write_summary
  return "$rc"
}

skip() {
  echo "== $1: skipped ($2)"
  rows+=("| $1 | skipped: $2 | - |")
  checks+=("$1"$'\t'"skipped: $2"$'\t'"null")
  write_summary
}

# "native" (the GPUs of this machine) when CMake knows it (3.24+) and a GPU answers, else sm_90.
choose_arch() {
  local version
  version=$(cmake --version 2>/dev/null | head -n 1 | awk '{print $3}')
  if [ -n "$version" ] && [ "$(printf '%s\n3.24\n' "$version" | sort -V | head -n 1)" = "3.24" ] &&
    nvidia-smi -L > /dev/null 2>&1; then
    echo native
  else
    echo 90
  fi
}

# configure and configure_or_install run through `bash -c` (exported) so that `step` can time-limit them.
# shellcheck disable=SC2317
configure() {
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGEOTRAIN_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
}

# shellcheck disable=SC2317
configure_or_install() {
  configure && return 0
  echo "configure failed: installing the dependencies (deploy/install-deps.sh) and retrying"
  bash deploy/install-deps.sh && configure
}

# The targets among the arguments that this build defines.
existing_targets() {
  if [ "$PLAN" = 1 ]; then  # nothing is configured: every target counts
    printf '%s\n' "$@"
    return
  fi
  local listing target
  listing=$(cmake --build "$BUILD" --target help 2>/dev/null)
  for target in "$@"; do
    # Makefiles list "... NAME", Ninja "NAME: phony".
    if grep -Eq "^(\.\.\. )?$target(:| |$)" <<< "$listing"; then echo "$target"; fi
  done
}

# The path of a built executable, or nothing.
find_executable() {
  if [ "$PLAN" = 1 ]; then
    echo "$BUILD/bin/$1"
  else
    find "$BUILD" -type f -name "$1" -perm -u+x 2> /dev/null | head -n 1
  fi
}

CUDA_ARCH=$(choose_arch)
export BUILD CUDA_ARCH
export -f configure configure_or_install
write_summary

if [ "$PLAN" = 1 ]; then
  GPU_COUNT=${GEOTRAIN_GPU_PLAN_GPUS:-1}
  echo "== plan for $GPU_COUNT GPU(s) (GEOTRAIN_GPU_PLAN_GPUS), CUDA architectures $CUDA_ARCH, overall budget ${BUDGET_S}s (each check's limit is cut to what is left); nothing runs"
else
  echo "== devices"
  nvidia-smi 2>&1 | tee "$RESULTS/nvidia-smi.log"
  GPU_COUNT=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
fi

if step configure 180 bash -c configure_or_install; then
  mapfile -t test_targets < <(existing_targets gpu_ops_test gpu_model_test)
  if [ "${#test_targets[@]}" -eq 0 ]; then
    skip build "no GPU test target (is the CUDA backend on? see configure.log)"
    failed=1
  elif step build 240 cmake --build "$BUILD" -j "$JOBS" --target "${test_targets[@]}"; then
    step ctest 150 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 120
  fi

  mapfile -t bench_targets < <(existing_targets bench_gpu_step bench_nccl_allreduce)
  if [ "${#bench_targets[@]}" -gt 0 ]; then
    step build-benchmarks 120 cmake --build "$BUILD" -j "$JOBS" --target "${bench_targets[@]}"
  fi

  bench=$(find_executable bench_gpu_step)
  if [ -n "$bench" ]; then
    rm -f "$RESULTS/bench_gpu_step.json"
    step bench_gpu_step 120 "$bench" --out "$RESULTS/bench_gpu_step.json"
  else
    skip bench_gpu_step "not built"
  fi

  # A real job end to end: head, a worker on this machine's GPUs, stage actors training on them (and
  # TP=2 over NCCL, DP=2, with two GPUs or more), losses against the CPU's train --local.
  if step build-geotrain 150 cmake --build "$BUILD" -j "$JOBS" --target geotrain; then
    step job_on_gpu 300 env PYTHONPATH="$ROOT/tests/lib" python3 tests/gpu/job_on_gpu.py "$(find_executable geotrain)"
  fi

  bench=$(find_executable bench_nccl_allreduce)
  if [ "$GPU_COUNT" -lt 2 ]; then
    skip bench_nccl_allreduce "$GPU_COUNT GPU(s): all-reduce needs two or more"
  elif [ -n "$bench" ]; then
    rm -f "$RESULTS/bench_nccl_allreduce.json"
    step bench_nccl_allreduce 60 "$bench" --out "$RESULTS/bench_nccl_allreduce.json"
  else
    skip bench_nccl_allreduce "not built"
  fi
fi

write_summary
echo
cat "$SUMMARY"
echo
# One line per check, with its figure where it has one (the benchmark's MFU, each GPU job's losses).
for c in "${checks[@]}"; do
  IFS=$'\t' read -r name result seconds <<< "$c"
  figure=""
  case "$name" in
    bench_gpu_step) [ -s "$RESULTS/bench_gpu_step.json" ] && figure=$(grep -o '"mfu[^,}]*' "$RESULTS/bench_gpu_step.json" | head -n 1) ;;
    job_on_gpu) [ -f "$RESULTS/job_on_gpu.log" ] && figure=$(grep -cE '^gpu-[a-z0-9-]+: PASS' "$RESULTS/job_on_gpu.log")" jobs passed" ;;
  esac
  [ "$seconds" = null ] && seconds=""
  echo "CHECK $name: $result${seconds:+ (${seconds} s)}${figure:+; $figure}"
done
echo "results: $RESULTS (total $(($(date +%s) - START_S)) s)"
exit "$failed"
