# Two commands do everything on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test lint format bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

## up: create the default model if missing and run one generation on the in-process engine.
## (The four-service stack over NATS replaces this once it lands; see README.)
up: install
	$(VENV)/bin/lamina model init
	$(VENV)/bin/lamina generate "The engine reads a prompt and" --max-tokens 24

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

clean:
	rm -rf $(VENV) build *.egg-info
