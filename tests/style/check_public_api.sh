#!/usr/bin/env bash
# The clients use geotrain's public API only (docs/api.md): no source of the CLI (cli/) or of the Python client
# (clients/python/) names the internal services (proto/internal.proto: geotrain.internal, HeadControl) or includes
# their generated code; the CLI includes the public services' (proto/geotrain/v1/). Lists each offending line.
# Usage: check_public_api.sh SOURCE_DIR
set -euo pipefail
cd "$1"
bad="$(grep -rnE 'internal\.grpc\.pb\.h|control\.grpc\.pb\.h|internal::(HeadControl|Worker)|geotrain\.internal|HeadControl|internal_pb2' \
  cli clients/python --include='*.cc' --include='*.h' --include='*.py' || true)"
if [ -n "$bad" ]; then
  echo "$bad"
  echo "check_public_api: the clients above reach for the internal services; use proto/geotrain/v1 (docs/api.md)" >&2
  exit 1
fi
grep -q '"geotrain/v1/jobs.grpc.pb.h"' cli/support.h || {
  echo "check_public_api: cli/support.h does not include the public Jobs service" >&2
  exit 1
}
echo "check_public_api: cli/ and clients/python/ use the public API only"
