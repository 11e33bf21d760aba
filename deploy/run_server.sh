#!/usr/bin/env bash
# README command 1: install dependencies, build, and run kvtrie-server on 127.0.0.1:50051 with its
# RocksDB under ./kvtrie-data. Flags are passed through, e.g. --listen=0.0.0.0:50051 --sync.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install_deps.sh
deploy/build.sh kvtrie-server kvtrie
exec build/server/kvtrie-server --listen=127.0.0.1:50051 --data_dir=./kvtrie-data "$@"
