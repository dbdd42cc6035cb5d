#!/usr/bin/env bash
# The .deb from CPack (`cpack -G DEB` with the build dir's CPackConfig.cmake, written to a temporary dir): its
# contents (dpkg-deb -c) hold the binaries, the tokenizer files and the deploy files under /usr; its units start
# /usr/bin/geotrain; it depends on the shared libraries the binaries link; its postinst creates the geotrain user.
#   deb_test.sh BUILD_DIR
set -euo pipefail
build="$(cd "$1" && pwd)"
fail() { echo "FAIL: $*" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
(cd "$out" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$out" > cpack.log 2>&1) ||
  fail "cpack failed: $(cat "$out/cpack.log")"
deb="$(ls "$out"/geotrain_*.deb)"
dpkg-deb -c "$deb" | awk '{print $6}' > "$out/contents"
for f in ./usr/bin/geotrain ./usr/bin/geotrain-netem ./usr/share/geotrain/tokenizer/encoder.json \
         ./usr/share/geotrain/tokenizer/vocab.bpe ./usr/share/geotrain/systemd/geotrain-head.service \
         ./usr/share/geotrain/systemd/geotrain-worker.service ./usr/share/geotrain/systemd/worker.env \
         ./usr/share/geotrain/prometheus/prometheus.yml ./usr/share/geotrain/grafana/geotrain-dashboard.json \
         ./usr/share/geotrain/open-ports.sh ./usr/lib/python3/dist-packages/geotrain/__init__.py \
         ./usr/lib/python3/dist-packages/geotrain/v1/jobs_pb2_grpc.py \
         "./usr/share/geotrain/python/geotrain-$(grep -oP 'set\(GEOTRAIN_VERSION \K[0-9.]+' "$(dirname "$0")/../../deploy/CMakeLists.txt")-py3-none-any.whl"; do
  grep -qx "$f" "$out/contents" || { cat "$out/contents" >&2; fail "$(basename "$deb") lacks $f"; }
done
dpkg-deb -x "$deb" "$out/root"
grep -q '^ExecStart=/usr/bin/geotrain worker start' "$out/root/usr/share/geotrain/systemd/geotrain-worker.service" ||
  fail "the packaged worker unit does not start /usr/bin/geotrain"
depends="$(dpkg-deb -f "$deb" Depends)"
for lib in libc6 libgrpc++ libprotobuf libopenblas; do
  [[ "$depends" == *"$lib"* ]] || fail "Depends lacks $lib: $depends"
done
[[ "$(dpkg-deb -f "$deb" Recommends)" == *python3-grpcio* ]] || fail "Recommends lacks python3-grpcio"
dpkg-deb -e "$deb" "$out/control"
grep -q 'useradd --system' "$out/control/postinst" || fail "postinst does not create the geotrain user"
echo "$(basename "$deb"): $(wc -l < "$out/contents") entries; Depends: $depends"
