#!/usr/bin/env bash
# Create the separate virtual environment that holds Mooncake's released implementation
# (the benchmark peer), so it never mixes with halfmoon's own .venv.
#   usage: benchmarks/dataplane/mooncake_env.sh [VENV_DIR]   (default: benchmarks/.mooncake-venv)
# Needs root for apt-get (the Debian package libibverbs1 provides libibverbs.so.1).
set -euo pipefail
cd "$(dirname "$0")/.."  # benchmarks/: the venvs live there
VENV_DIR="${1:-.mooncake-venv}"
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"
if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi
if [ ! -x "$VENV_DIR/bin/python" ]; then
    python3 -m venv "$VENV_DIR"
fi
if ! "$VENV_DIR/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
    "$VENV_DIR/bin/python" -m pip install -q --upgrade pip
    "$VENV_DIR/bin/python" -m pip install -q "$MOONCAKE_PKG" numpy msgpack xxhash
fi
echo "$VENV_DIR"
