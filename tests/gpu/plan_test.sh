#!/usr/bin/env bash
# tests/gpu/run.sh --plan on a machine without a GPU: it lists every check the GPU run makes (build, the GPU tests,
# the step benchmark, the real job), within an overall budget of at most 10 minutes, writes summary.json, and
# runs, builds and creates nothing else.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
before=$(ls -A "$here/../.." | sort)
OUT="$out" bash "$here/run.sh" --plan > "$out/plan.txt" 2>&1
rc=$?
cat "$out/plan.txt"
fail() { echo "plan_test: FAIL: $*"; exit 1; }
[ "$rc" -eq 0 ] || fail "run.sh --plan exited $rc"
for check in configure build ctest bench_gpu_step build-geotrain job_on_gpu; do
  grep -q "^would run: $check (limit [0-9]*s)" "$out/plan.txt" || fail "no planned check '$check'"
done
grep -q "ctest .* -L gpu" "$out/plan.txt" || fail "the GPU tests are not run by label"
budget=$(grep -o "overall budget [0-9]*s" "$out/plan.txt" | grep -o "[0-9]*")
[ -n "$budget" ] && [ "$budget" -le 600 ] || fail "the overall budget '${budget}' is not within 10 minutes"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['plan_only'] and len(d['checks']) >= 7, d" \
  "$out/summary.json" || fail "summary.json is not the plan"
after=$(ls -A "$here/../.." | sort)
[ "$before" = "$after" ] || fail "run.sh --plan created something in the source tree: $(comm -13 <(echo "$before") <(echo "$after"))"
echo "plan_test: ok (overall budget ${budget}s)"
