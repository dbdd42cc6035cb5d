#!/usr/bin/env bash
# tc-netem.sh --dry-run: the commands for a shipped topology, rerunnable (replace) and validated.
# (This kernel has no netem qdisc, so only the dry run is tested.) Args: SOURCE_DIR NETEM_BINARY.
set -euo pipefail
src="$1"
export GEOTRAIN_NETEM="$2"
script="$src/netem/tc-netem.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

out="$("$script" --topology "$src/deploy/topologies/two-sites-30ms.yaml" \
        --dev 'site-a>site-b=nsA:veth-a' --dev 'site-b>site-a=veth-b' --dry-run)"
echo "$out"
[ "$(printf '%s\n' "$out" | wc -l)" = 2 ] || fail "expected two commands"
# 1 Gbit/s x 30.5 ms = 3.81 MB = 2542 packets of 1500 bytes; the limit is twice that.
grep -qx 'ip netns exec nsA tc qdisc replace dev veth-a root netem delay 30ms 0.5ms rate 1000000kbit limit 5084' <<< "$out" \
  || fail "site-a>site-b command"
grep -qx 'tc qdisc replace dev veth-b root netem delay 30ms 0.5ms rate 1000000kbit limit 5084' <<< "$out" \
  || fail "site-b>site-a command"

out="$("$script" --topology "$src/deploy/topologies/cloud-wide.yaml" --dev 'sydney>frankfurt=eth1' --dry-run)"
grep -qx 'tc qdisc replace dev eth1 root netem delay 265ms rate 328000kbit limit 14487' <<< "$out" \
  || fail "cloud-wide: $out"

out="$("$script" --topology "$src/deploy/topologies/cloud-wide.yaml" --dev 'sydney>frankfurt=eth1' --clear --dry-run)"
[ "$out" = 'tc qdisc del dev eth1 root' ] || fail "clear: $out"

# Errors name the problem, and nothing is printed as a command.
if err="$("$script" --topology "$src/deploy/topologies/cloud-wide.yaml" --dev 'sydney>tokyo=eth1' --dry-run 2>&1)"; then
  fail "a device for a missing link was accepted"
fi
grep -q "no link between 'sydney' and 'tokyo'" <<< "$err" || fail "missing-link message: $err"
if err="$("$script" --topology "$src/deploy/topologies/cloud-wide.yaml" --dev 'sydney>frankfurt=eth1;reboot' --dry-run 2>&1)"; then
  fail "an unsafe interface name was accepted"
fi
if "$script" --bogus >/dev/null 2>&1; then fail "unknown argument accepted"; fi
# Without --dry-run on an interface that does not exist: a clear failure (as root: the tc command
# fails; otherwise: root is needed), never a silent success.
if err="$("$script" --topology "$src/deploy/topologies/cloud-wide.yaml" --dev 'sydney>frankfurt=gtnoexist0' 2>&1)"; then
  fail "shaping a missing interface succeeded"
fi
grep -Eq "check the interface exists|needs root" <<< "$err" || fail "missing-interface message: $err"
echo "tc-netem.sh dry run: OK"
