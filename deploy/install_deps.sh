#!/usr/bin/env bash
# Installs what kvtrie needs to build and test on Debian 12 (bookworm), from Debian's archive.
# Idempotent: installs only what is missing. Run as root, or with sudo available.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev libspdlog-dev libzstd-dev libxxhash-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  prometheus-cpp-dev openssl
  # The Python package (client/python) and its tests: pybind11, Debian's python, numpy, pytest,
  # pip for `pip3 install --break-system-packages ./client/python`, venv for installing it into
  # a venv (tests/python/test_install.py); torch (CPU) for the connector's test engine
  # (tests/python/engine.py: vLLM's tensors and layouts).
  pybind11-dev python3-dev python3-numpy python3-pytest python3-pip python3-setuptools
  python3-wheel python3-venv python3-torch
  # tools/train (issue 29): the tokenizer and OpenBLAS for torch's CPU matmuls (Debian's torch
  # links the reference BLAS otherwise, ~8x slower).
  python3-sentencepiece libopenblas0-openmp
)
# `--with-train`: also the packages whose text tools/train trains on (tools/train/manifest.md).
if [[ " $* " == *" --with-train "* ]]; then
  PACKAGES+=(bible-kjv-text python3.11-doc debian-reference-en)
fi
# The sanitizer stages of tests/run_tests.sh (ASan + UBSan, TSan, libFuzzer): clang 14.
if [[ "${1:-}" == "--with-node" || "${1:-}" == "--with-sanitizers" ]]; then
  PACKAGES+=(clang-14 libclang-rt-14-dev)
fi
# The reflection end-to-end test runs a Node.js gRPC client, and tests/deploy validates the
# Kubernetes manifests with Node.js; any Node.js >= 18 will do. (openssl: the TLS tests make
# their certificates with it.)
if [[ "${1:-}" == "--with-node" ]] && ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
