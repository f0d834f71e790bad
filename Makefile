# Two commands set everything up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STDLIB := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
DEMO_DATA := data/stdlib
PYTEST_ARGS ?=

.PHONY: help venv data demo test unit integration lint format clean

help:
	@echo "make demo   - create .venv, install, prepare data/stdlib, train jobs/tiny.yaml on a local Ray"
	@echo "make test   - run the test suite (unit + integration; what CI runs)"
	@echo "make lint   - ruff + mypy"

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH_PIN)"
	touch $@

# The demo corpus: the Python standard library's own top-level modules (on every machine, no download).
data: $(DEMO_DATA)/manifest.json

$(DEMO_DATA)/manifest.json: venv
	$(BIN)/raytrn data prepare --input '$(STDLIB)/*.py' --output $(DEMO_DATA) --seq-len 128 --vocab-size 4096

demo: venv data
	$(BIN)/raytrn train jobs/tiny.yaml

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

unit: venv
	$(BIN)/python -m pytest -q -m unit $(PYTEST_ARGS)

integration: venv
	$(BIN)/python -m pytest -q -m integration $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check raytrn tests
	$(BIN)/ruff format --check raytrn tests
	$(BIN)/mypy raytrn

format: venv
	$(BIN)/ruff format raytrn tests
	$(BIN)/ruff check --fix raytrn tests

clean:
	rm -rf $(VENV) data checkpoints mlruns .pytest_cache .ruff_cache .mypy_cache
