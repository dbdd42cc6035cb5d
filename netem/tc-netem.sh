#!/usr/bin/env bash
# Applies a geotrain topology to real interfaces with Linux `tc netem` (testbeds, network namespaces):
# one netem qdisc per link direction, on the egress interface that carries that direction, with the
# link's delay, jitter and rate and a queue `limit` sized to twice the bandwidth-delay product.
# Commands use `tc qdisc replace`, so rerunning the script reshapes in place. The commands come from
# `geotrain-netem --print-tc` (netem/tc.cc), which validates the topology and every name.
#
#   netem/tc-netem.sh --topology deploy/topologies/two-sites-30ms.yaml \
#       --dev 'site-a>site-b=nsA:veth-a' --dev 'site-b>site-a=nsB:veth-b' [--dry-run] [--clear]
#
# --dev SRC>DST=[NETNS:]IFACE  shape direction SRC>DST on IFACE (inside namespace NETNS if given)
# --dry-run                    print the commands, run nothing (no root needed)
# --clear                      remove the root qdiscs instead
# Needs root (CAP_NET_ADMIN) and the sch_netem kernel module unless --dry-run.
# GEOTRAIN_NETEM names the geotrain-netem binary (default: build/bin/geotrain-netem, then PATH).
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

dry_run=0
clear=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --clear) clear=1; args+=(--clear) ;;
    --topology|--dev)
      [ $# -ge 2 ] || { echo "tc-netem.sh: $1 needs a value" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "tc-netem.sh: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
  shift
done

bin="${GEOTRAIN_NETEM:-}"
if [ -z "$bin" ]; then
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  if [ -x "$here/../build/bin/geotrain-netem" ]; then
    bin="$here/../build/bin/geotrain-netem"
  elif command -v geotrain-netem >/dev/null 2>&1; then
    bin="$(command -v geotrain-netem)"
  else
    echo "tc-netem.sh: geotrain-netem not found; build it (cmake --build build --target geotrain-netem)" \
         "or set GEOTRAIN_NETEM=/path/to/geotrain-netem" >&2
    exit 1
  fi
fi

commands="$("$bin" --print-tc "${args[@]}")" || exit 1

if [ "$dry_run" = 1 ]; then
  printf '%s\n' "$commands"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "tc-netem.sh: shaping needs root (CAP_NET_ADMIN); run it with sudo, or add --dry-run to see the commands" >&2
  exit 1
fi
while IFS= read -r line; do
  [ -n "$line" ] || continue
  read -r -a words <<< "$line"   # geotrain-netem emits only [A-Za-z0-9._:@-] words: no quoting needed
  echo "+ $line"
  if ! "${words[@]}"; then
    if [ "$clear" = 1 ]; then
      continue  # nothing to remove there
    fi
    echo "tc-netem.sh: '$line' failed; check the interface exists and the kernel has netem" \
         "(modprobe sch_netem)" >&2
    exit 1
  fi
done <<< "$commands"
