#!/usr/bin/env bash
# Lets TCP traffic from SOURCE (an address or CIDR) reach the given ports, or every port when none is given,
# through the host firewall when one is active (ufw or firewalld); without one nothing blocks them, and it
# says so. Idempotent. Used by deploy/fabric/geotrain_fabric.py; see docs/deploy.md for the ports.
#   sudo open-ports.sh 10.128.0.0/10 6380 9470 6381 9471     # head gRPC and metrics, worker gRPC and metrics
#   sudo open-ports.sh 10.128.1.0/24                          # everything from the node's own site (NCCL)
#   open-ports.sh --dry-run SOURCE [PORT...]                  # print the commands only
set -euo pipefail
run=()
if [ "${1:-}" = "--dry-run" ]; then run=(echo); shift; fi
source_net="${1:?usage: open-ports.sh [--dry-run] SOURCE [PORT...]}"
shift
ports=("$@")
for p in "${ports[@]}"; do
  [[ "$p" =~ ^[0-9]+$ ]] || { echo "open-ports.sh: '$p' is not a port number" >&2; exit 2; }
done

if command -v ufw >/dev/null 2>&1 && ufw status 2>/dev/null | grep -q 'Status: active'; then
  if [ ${#ports[@]} -eq 0 ]; then
    "${run[@]}" ufw allow from "$source_net"
  fi
  for p in "${ports[@]}"; do "${run[@]}" ufw allow from "$source_net" to any port "$p" proto tcp; done
elif command -v firewall-cmd >/dev/null 2>&1 && firewall-cmd --state >/dev/null 2>&1; then
  if [ ${#ports[@]} -eq 0 ]; then
    "${run[@]}" firewall-cmd --permanent --add-rich-rule="rule family=ipv4 source address=$source_net accept"
  fi
  for p in "${ports[@]}"; do
    "${run[@]}" firewall-cmd --permanent \
      --add-rich-rule="rule family=ipv4 source address=$source_net port port=$p protocol=tcp accept"
  done
  "${run[@]}" firewall-cmd --reload
else
  echo "open-ports.sh: no host firewall active (ufw, firewalld): $source_net reaches ports ${ports[*]:-all}"
fi
