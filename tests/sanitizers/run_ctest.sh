#!/usr/bin/env bash
# Runs ctest in a sanitizer build (`make test-asan`, `make test-tsan`) with the sanitizers' options set for
# every process the tests start (gtest binaries, and the head, worker and netem processes of the Python
# integration tests, which inherit the environment). Every report also goes to BUILD_DIR/sanitizer-logs/, so a
# finding in a child process whose exit status a test ignores still fails the run: after ctest, any report
# there is printed and the run fails.
# Usage: run_ctest.sh BUILD_DIR address|thread [ctest arguments...]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="$1" kind="$2"
shift 2
logs="$(cd "$build" && pwd)/sanitizer-logs"
rm -rf "$logs"
mkdir -p "$logs"
common="print_stacktrace=1:halt_on_error=1"
# OpenMP threads sleep at barriers rather than spin against the other tests (the Makefile's `test` does the same).
export OMP_WAIT_POLICY=PASSIVE
case "$kind" in
  address)
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0:log_path=$logs/report"
    export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="$common:suppressions=$here/ubsan.supp:log_path=$logs/report"
    ;;
  thread)
    export TSAN_OPTIONS="$common:second_deadlock_stack=1:suppressions=$here/tsan.supp:log_path=$logs/report"
    # libgomp is not instrumented: one OpenMP thread keeps its pool out of the picture.
    export OMP_NUM_THREADS=1
    ;;
  *)
    echo "run_ctest.sh: kind must be address or thread" >&2
    exit 2
    ;;
esac
(cd "$build" && ctest --output-on-failure --timeout 900 "$@")
rc=$?
reports=$(find "$logs" -type f | sort)
if [ -n "$reports" ]; then
  for f in $reports; do
    echo "=== sanitizer report $f"
    head -n 80 "$f"
  done
  echo "run_ctest.sh: $(echo "$reports" | wc -l) sanitizer report(s) in $logs" >&2
  rc=1
fi
if [ $rc -eq 0 ]; then echo "run_ctest.sh: $kind sanitizer run clean"; fi
exit $rc
