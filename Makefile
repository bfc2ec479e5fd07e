# Two commands do everything on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test lint format bench gpu-wheels clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
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

## gpu-wheels: what benchmarks/gpu_check.sh carries to a GPU machine that lacks it (in
## .whl/): msgspec, and the trained stories260K fixture, which lives beside the checkout.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 -d .whl "msgspec==0.23.0"
	if [ -d ../shared/fixtures/stories260K ]; then \
		mkdir -p .whl/fixtures && cp -r ../shared/fixtures/stories260K .whl/fixtures/; fi

clean:
	rm -rf $(VENV) build *.egg-info
