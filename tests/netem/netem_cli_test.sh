#!/usr/bin/env bash
# geotrain-netem as a process, the way `geotrain cluster up` runs it: start with a topology and
# routes, wait for the ready file, drive it over the control port with --send, relay bytes, stop it
# with SIGTERM; and its errors (unknown site, port in use). Args: SOURCE_DIR NETEM_BINARY.
set -euo pipefail
src="$1"
bin="$2"
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; [ -f "$tmp/log" ] && cat "$tmp/log" >&2; exit 1; }
topology="$src/deploy/topologies/two-sites-30ms.yaml"

"$bin" --topology "$topology" --route '0=site-a>site-b@127.0.0.1:1' --control-port 0 \
  --ready-file "$tmp/ready" > "$tmp/log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -f "$tmp/ready" ] && break; sleep 0.05; done
[ -f "$tmp/ready" ] || fail "no ready file"
control="$(awk '$1 == "control_port" {print $2}' "$tmp/ready")"
route_port="$(awk '$1 == "route" {sub(/.*:/, "", $3); print $3}' "$tmp/ready")"
[ -n "$control" ] && [ -n "$route_port" ] || fail "ready file: $(cat "$tmp/ready")"
grep -q "geotrain-netem: ready" "$tmp/log" || fail "no ready line on stdout"

stats="$("$bin" --control-port "$control" --send stats)"
echo "$stats"
grep -q '^link site-a>site-b up latency_ms=30 bandwidth_mbps=1000 jitter_ms=0.5 ' <<< "$stats" || fail "stats: $stats"
"$bin" --control-port "$control" --send 'link down site-a site-b' > /dev/null || fail "link down"
grep -q '^link site-b>site-a down' <<< "$("$bin" --control-port "$control" --send stats)" || fail "not down"
"$bin" --control-port "$control" --send 'link up site-a site-b' > /dev/null || fail "link up"
if out="$("$bin" --control-port "$control" --send 'link down site-a nowhere' 2>&1)"; then fail "bad link accepted"; fi
grep -q "no link between 'site-a' and 'nowhere'" <<< "$out" || fail "bad link message: $out"

# Bytes through an emulated link: a second emulator relays site-a>site-b to the first one's control
# port (a TCP server that answers lines), so `--send stats` to the relay crosses 30 ms each way.
"$bin" --topology "$topology" --route "0=site-a>site-b@127.0.0.1:$control" --control-port 0 \
  --ready-file "$tmp/ready2" > "$tmp/log2" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -f "$tmp/ready2" ] && break; sleep 0.05; done
[ -f "$tmp/ready2" ] || fail "second emulator: no ready file"
control2="$(awk '$1 == "control_port" {print $2}' "$tmp/ready2")"
relay_port="$(awk '$1 == "route" {sub(/.*:/, "", $3); print $3}' "$tmp/ready2")"
start_ns="$(date +%s%N)"
relayed="$("$bin" --control-port "$relay_port" --send stats)" || fail "request through the relay"
elapsed_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
grep -q '^link site-a>site-b up' <<< "$relayed" || fail "relayed reply: $relayed"
[ "$elapsed_ms" -ge 60 ] || fail "a round trip over a 30 ms link took only $elapsed_ms ms"
echo "round trip through the emulated link: $elapsed_ms ms"
grep -q '^link site-a>site-b up .* bytes_out=6 ' <<< "$("$bin" --control-port "$control2" --send stats)" \
  || fail "relay stats: $("$bin" --control-port "$control2" --send stats)"
kill -TERM "${pids[1]}"
wait "${pids[1]}" || fail "relay did not exit cleanly on SIGTERM"
unset 'pids[1]'

# A second emulator on the same listen port fails and says how to fix it.
if out="$("$bin" --topology "$topology" --route "$route_port=site-a>site-b@127.0.0.1:1" 2>&1)"; then
  fail "port in use accepted"
fi
grep -q "is already in use" <<< "$out" || fail "port-in-use message: $out"
if out="$("$bin" --topology "$topology" --route '0=site-a>mars@127.0.0.1:1' 2>&1)"; then fail "unknown site accepted"; fi
grep -q "unknown site 'mars'; sites in the topology: site-a, site-b" <<< "$out" || fail "unknown-site message: $out"
if out="$("$bin" --topology "$tmp/missing.yaml" --route '0=a>b@127.0.0.1:1' 2>&1)"; then fail "missing topology accepted"; fi

kill -TERM "${pids[0]}"
wait "${pids[0]}" || fail "did not exit cleanly on SIGTERM"
pids=()
echo "geotrain-netem process: OK"
