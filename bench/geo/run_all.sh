#!/usr/bin/env bash
# The whole timed-compute study (issue 17; `make study`): the FABRIC experiment (bench/geo/fabric_study.py) and the
# planner's validation at scale (bench/geo/validate_timed.py), each writing CSV, a markdown table and a PNG to
# docs/results/data/geo/. Every figure is EMULATED (docs/timed-compute.md). Usage: bench/geo/run_all.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/tests/lib${PYTHONPATH:+:$PYTHONPATH}"  # the scripts' shared code (tests/lib/geotrain_testing)
build=${1:-build}
geotrain="$build/bin/geotrain"
[[ -x $geotrain ]] || { echo "run_all.sh: no $geotrain; build first (make build)" >&2; exit 1; }
out=docs/results/data/geo
mkdir -p "$out"
start=$(date +%s)
echo "== 1/2 the FABRIC experiment (EMULATED), $(date -u +%FT%TZ)"
/usr/bin/python3 bench/geo/fabric_study.py --geotrain "$geotrain" --out "$out/fabric" 2>&1 | tee "$out/fabric.log"
echo "== 2/2 the planner on timed clusters of 8-16 devices (EMULATED), $(date -u +%FT%TZ)"
/usr/bin/python3 bench/geo/validate_timed.py --geotrain "$geotrain" --out "$out/validation-timed" 2>&1 |
  tee "$out/validation-timed.log"
echo "== the study took $(( ($(date +%s) - start) / 60 )) min; results in $out/fabric.* and $out/validation-timed.*"
