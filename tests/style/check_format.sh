#!/usr/bin/env bash
# Style check: every C++, CUDA and protobuf source of the project is formatted as .clang-format says.
# Lists each file clang-format would change and how to fix it; exits non-zero if there is one.
# Usage: check_format.sh SOURCE_DIR [--fix]
set -euo pipefail
root="$1"
fix="${2:-}"
formatter="$(command -v clang-format || command -v clang-format-14 || true)"
if [ -z "$formatter" ]; then
  echo "check_format: clang-format not found; run deploy/install-deps.sh (Debian package clang-format)" >&2
  exit 1
fi
cd "$root"
mapfile -t files < <(find . \( -path ./build -o -path './build-*' -o -path ./third_party -o -path ./.git \) -prune -o \
  -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.proto' \) -print | sort)
bad=0
for f in "${files[@]}"; do
  if [ "$fix" = "--fix" ]; then
    "$formatter" -i "$f"
  elif ! "$formatter" --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: ${f#./}"
    bad=$((bad + 1))
  fi
done
if [ "$bad" -gt 0 ]; then
  echo "check_format: $bad of ${#files[@]} files differ from .clang-format; run 'make format' and commit" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
