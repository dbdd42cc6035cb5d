#!/usr/bin/env bash
# `make fuzz`: runs every fuzz target of BUILD_DIR for SECONDS each, one after the other, starting from the
# committed seeds (fuzz/corpus/<target>/) plus what earlier runs found (BUILD_DIR/corpus/<target>/), and prints
# one line per target: executions, corpus size, and whether it found something.
# Usage: run_all.sh BUILD_DIR SECONDS
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$1" seconds="$2"
failed=0
summary=""
for binary in "$build"/fuzz/fuzz_*; do
  [ -x "$binary" ] || continue
  name="${binary##*/fuzz_}"
  work="$build/fuzz-runs/$name"
  mkdir -p "$work" "$build/corpus/$name"
  "$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$work/" "$build/corpus/$name" "$root/fuzz/corpus/$name" >"$work/fuzz.log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log")
  corpus=$(ls "$build/corpus/$name" | wc -l)
  result="ok"
  if [ $rc -ne 0 ]; then
    result="FOUND A BUG (exit $rc): see $work/fuzz.log and $work/crash-*"
    failed=1
  fi
  line=$(printf "%-22s %12s executions in %ss  %6s new inputs kept  %s" "$name" "${execs:-?}" "$seconds" "$corpus" "$result")
  echo "$line"
  summary+="$line"$'\n'
done
echo
echo "fuzz summary ($seconds s per target):"
printf "%s" "$summary"
exit $failed
