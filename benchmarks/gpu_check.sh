#!/usr/bin/env bash
# Engine checks on a CUDA machine (about 5 minutes): the engine tests, CUDA ones included,
# then the engine-vs-transformers benchmark on the GPU.
#
# Needs a venv whose torch is a CUDA build, e.g. `make install TORCH_SPEC=torch`
# (the Makefile's default pins the CPU wheel of this repo's CPU-only machines).
# Writes benchmark rows to ${OUT:-/tmp}/engine_cuda.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 180 "$PY" -m pytest tests/engine -q -x -p no:cacheprovider
timeout 240 "$PY" benchmarks/engine.py --device cuda --repeats 5 --threads 4 \
    --json "${OUT:-/tmp}/engine_cuda.json"
