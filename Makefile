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
BENCH_ARGS ?=

# The torch-xla venv: torch 2.9 + torch-xla 2.9, the versions Neuron 2.28 (the last XLA training release) uses.
VENV_XLA := .venv-xla
XLA_PINS := torch==2.9.0 torch-xla==2.9.0

.PHONY: help venv venv-xla data demo test test-xla unit integration lint format clean bench

help:
	@echo "make demo   - create .venv, install, prepare data/stdlib, train jobs/tiny.yaml on a local Ray"
	@echo "make test   - run the test suite (unit + integration; what CI runs)"
	@echo "make test-xla - build .venv-xla (torch 2.9 + torch-xla 2.9) and run tests/xla on PJRT_DEVICE=CPU"
	@echo "make lint   - ruff + mypy"
	@echo "make bench  - CPU benchmarks (~15 min): bench/results/<date>-<host>.json + the README table (BENCH_ARGS=--quick)"

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH_PIN)"
	touch $@

venv-xla: $(VENV_XLA)/bin/.installed

$(VENV_XLA)/bin/.installed: pyproject.toml
	test -x $(VENV_XLA)/bin/python || $(PYTHON) -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/python -m pip install -q --upgrade pip
	$(VENV_XLA)/bin/python -m pip install -q $(XLA_PINS)
	$(VENV_XLA)/bin/python -m pip install -q -e ".[dev]" $(XLA_PINS)
	touch $@

# The demo corpus: the Python standard library's own top-level modules (on every machine, no download).
data: $(DEMO_DATA)/manifest.json

$(DEMO_DATA)/manifest.json: venv
	$(BIN)/raytrn data prepare --input '$(STDLIB)/*.py' --output $(DEMO_DATA) --seq-len 128 --vocab-size 4096

demo: venv data
	$(BIN)/raytrn train jobs/tiny.yaml
	$(BIN)/raytrn runs compare --experiment raytrn-demo --plot mlruns/compare.png

# Benchmarks (not part of `make test`): overhead vs bare PyTorch / stock Ray Train, scaling, data, checkpoint,
# MLflow, recovery; writes bench/results/ and rewrites the README's Benchmarks block.
bench: venv data
	$(BIN)/python -m bench.run $(BENCH_ARGS)

test: venv
	$(BIN)/python -m pytest -q --ignore=tests/xla $(PYTEST_ARGS)

test-xla: venv-xla
	PJRT_DEVICE=CPU $(VENV_XLA)/bin/python -m pytest -q tests/xla $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(VENV_XLA) data checkpoints mlruns .pytest_cache .ruff_cache .mypy_cache
