#!/usr/bin/env bash
# Runs one fuzz target: replays its committed corpus, then fuzzes for SECONDS more. New inputs go to WORK_DIR
# (never into the repository's corpus); a crash is saved as WORK_DIR/crash-* and the run fails.
# Usage: run.sh BINARY CORPUS_DIR SECONDS WORK_DIR
# Exit 77 (ctest: skipped) when BINARY is missing: build it with `make fuzz-build`.
set -uo pipefail
binary="$1" corpus="$2" seconds="$3" work="$4"
if [ ! -x "$binary" ]; then
  echo "fuzz: $binary not built; run 'make fuzz-build' (the clang ASan build, build-asan/) first"
  exit 77
fi
mkdir -p "$work/new"
log="$work/fuzz.log"
"$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/new" "$corpus" >"$log" 2>&1
rc=$?
grep -E "^(stat::number_of_executed_units|stat::new_units_added|INFO: seed corpus|Done)" "$log" || true
if [ $rc -ne 0 ]; then
  tail -n 60 "$log"
  echo "fuzz: $(basename "$binary") failed (exit $rc); the input is in $work/ (crash-*, timeout-*, oom-*):"
  echo "  fix the parser, add a regression test beside it, and copy the input into $corpus/"
fi
exit $rc
