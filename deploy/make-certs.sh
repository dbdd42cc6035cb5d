#!/usr/bin/env bash
# Makes a private CA and certificates for TLS between geotrain's head, workers and CLI.
#   deploy/make-certs.sh OUT_DIR [HOST_OR_IP ...]
# Writes ca.pem/ca.key, server.pem/server.key (valid for the given names plus localhost and 127.0.0.1)
# and client.pem/client.key. Every node (head and workers) serves and dials: give each --tls-cert server.pem
# --tls-key server.key --tls-ca ca.pem (server.pem is valid for clients too, for mutual TLS), and the CLI
# --tls-ca ca.pem (with mutual TLS also --tls-cert client.pem --tls-key client.key).
set -euo pipefail
out="${1:?usage: make-certs.sh OUT_DIR [HOST_OR_IP ...]}"
shift || true
mkdir -p "$out"
cd "$out"
umask 077
san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san="$san,IP:$name"; else san="$san,DNS:$name"; fi
done
openssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj "/CN=geotrain CA" \
  -keyout ca.key -out ca.pem 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -subj "/CN=geotrain $who" -keyout "$who.key" -out "$who.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$san" \
    "$([ "$who" = server ] && echo serverAuth,clientAuth || echo clientAuth)" > "$who.ext"
  openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
    -extfile "$who.ext" -out "$who.pem" 2>/dev/null
  rm -f "$who.csr" "$who.ext"
done
rm -f ca.srl
echo "certificates in $out: ca.pem, server.pem/server.key, client.pem/client.key (SAN $san)"
