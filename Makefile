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

# pip byte-compiles every file it installs, on one core (~55 CPU-s for .venv's ~26,000 files, 2/3 of its install).
# The venvs install with --no-compile instead, then compile on every core what a run can import: not the packages'
# own tests nor the model families of transformers that neither raytrn nor peft imports (~20,000 files, ~44 CPU-s;
# `make venv` 95 -> 67-80 s here). A file left out still imports (compiled in memory at each import); a file that is not
# valid on the venv's Python (a package's code for a newer one) is skipped, as pip skips it.
# Installs go through tools/venv_install.py: uv (pinned, into .uv/ by `make uv`) with pip's own settings carried
# over, 3-10x faster than pip here; pip where uv can't be had (docs/testing.md).
UV_PIN := uv==0.13.9
INSTALL := $(PYTHON) tools/venv_install.py
NOT_IMPORTED := '/tests?/|/transformers/models/(?!__init__|auto/|llama/|qwen3/|qwen3_moe/|bloom/|encoder_decoder/)'
compile_site = $(1) -W ignore::SyntaxWarning -m compileall -q -j0 -x $(NOT_IMPORTED) \
	"$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true

# The torch-xla venv: torch 2.9 + torch-xla 2.9, the versions Neuron 2.28 (the last XLA training release) uses.
VENV_XLA := .venv-xla
XLA_PINS := torch==2.9.0 torch-xla==2.9.0

# pyproject.toml's requirements of raytrn[dev], one per line (an extra venv's dependencies, installed before raytrn).
REQUIREMENTS := 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *p["optional-dependencies"]["dev"], sep="\n")'

# The Python 3.12 venv: TorchNeuron (torch-neuronx 2.13/2.14) supports Python 3.12-3.14 only, so the code that
# runs on trn2 is tested on 3.12 too. torch 2.13 for 3.12 is the registry's CUDA build (~4.7 GB venv, CPU use
# here); the venv is kept between runs (rebuilt when pyproject.toml changes).
VENV_PY312 := .venv-py312
PYTHON312 = $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: help uv venv venv-xla venv-py312 venv-deps data demo demo-finetune demo-sweep test test-xla test-py312 unit integration lint format clean bench

help:
	@echo "make demo   - create .venv, install, prepare data/stdlib, train jobs/tiny.yaml on a local Ray"
	@echo "make demo-finetune - after make demo: fine-tune its model (full and LoRA) on stdlib docstrings, compare by val_loss"
	@echo "make demo-sweep - after make demo: a 4-trial learning-rate sweep of the tiny model (Ray Tune, ASHA on val_loss)"
	@echo "make test   - run the test suite (unit, integration, chaos; what CI runs)"
	@echo "make test-xla - build .venv-xla (torch 2.9 + torch-xla 2.9) and run tests/xla on PJRT_DEVICE=CPU"
	@echo "make test-py312 - build .venv-py312 (Python 3.12, TorchNeuron's Python) and run the unit suite + a Ray training test"
	@echo "make lint   - ruff + mypy"
	@echo "make bench  - CPU benchmarks (12-20 min here): bench/results/<date>-<host>.json + the README table (BENCH_ARGS=--quick)"

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml | uv
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(INSTALL) $(BIN)/python "$(TORCH_PIN)" -e ".[dev]"
	$(call compile_site,$(BIN)/python)
	touch $@

# uv for the installs (a 17 MB binary from the package index); where that fails, tools/venv_install.py uses pip.
# Tried once per pin: a new UV_PIN replaces .uv/; a failed download leaves only the stamp, so that the next make
# doesn't wait on the index again (`rm -rf .uv` tries again). The stamp is named by the pin's checksum: a pin may
# hold spaces, `<` or `>` (uv>=0.13, <0.14).
UV_STAMP := .uv/.installed-$(firstword $(shell printf '%s' '$(UV_PIN)' | cksum))
uv: $(UV_STAMP)

$(UV_STAMP):
	rm -rf .uv
	$(PYTHON) -m pip install -q --disable-pip-version-check --target .uv "$(UV_PIN)" || { rm -rf .uv; mkdir -p .uv; \
		echo "make uv: uv could not be installed; the venvs install with pip (rm -rf .uv to try again)" >&2; }
	touch $@

venv-xla: $(VENV_XLA)/bin/.installed

$(VENV_XLA)/bin/.installed: $(VENV_XLA)/bin/.deps
	$(INSTALL) $(VENV_XLA)/bin/python -e ".[dev]" $(XLA_PINS)
	touch $@

# The extra venvs' dependencies, without raytrn itself: two of these can install at once (`make -j2 venv-deps`,
# as CI does beside `make lint`); raytrn's editable install (it writes raytrn.egg-info here) comes after, one at a
# time.
venv-deps: $(VENV_XLA)/bin/.deps $(VENV_PY312)/bin/.deps

$(VENV_XLA)/bin/.deps: pyproject.toml | uv
	test -x $(VENV_XLA)/bin/python || $(PYTHON) -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/python -c $(REQUIREMENTS) > $(VENV_XLA)/requirements.txt
	$(INSTALL) $(VENV_XLA)/bin/python $(XLA_PINS) -r $(VENV_XLA)/requirements.txt
	$(call compile_site,$(VENV_XLA)/bin/python)
	touch $@

venv-py312: $(VENV_PY312)/bin/.installed

$(VENV_PY312)/bin/.installed: $(VENV_PY312)/bin/.deps
	$(INSTALL) $(VENV_PY312)/bin/python -e ".[dev]" "$(TORCH_PIN)"
	touch $@

$(VENV_PY312)/bin/.deps: pyproject.toml | uv
	@test -n "$(PYTHON312)" || { echo "make test-py312 needs Python 3.12 (python3.12 on PATH, or pyenv's 3.12)" >&2; exit 2; }
	test -x $(VENV_PY312)/bin/python || $(PYTHON312) -m venv $(VENV_PY312)
	$(VENV_PY312)/bin/python -c $(REQUIREMENTS) > $(VENV_PY312)/requirements.txt
	$(INSTALL) $(VENV_PY312)/bin/python "$(TORCH_PIN)" -r $(VENV_PY312)/requirements.txt
	$(call compile_site,$(VENV_PY312)/bin/python)
	touch $@

# The demo corpus: the Python standard library's own top-level modules (on every machine, no download).
data: $(DEMO_DATA)/manifest.json

$(DEMO_DATA)/manifest.json: venv
	$(BIN)/raytrn data prepare --input '$(STDLIB)/*.py' --output $(DEMO_DATA) --seq-len 128 --vocab-size 4096

demo: venv data
	$(BIN)/raytrn train jobs/tiny.yaml
	$(BIN)/raytrn runs compare --experiment raytrn-demo --plot mlruns/compare.png

# Fine-tune the model `make demo` trained on prompt/completion pairs from the standard library: all weights, then
# LoRA; ends with the two compared by val_loss (raytrn/demos/finetune.py). A few minutes here.
demo-finetune: venv
	@test -f mlruns/mlflow.db || { echo "make demo-finetune fine-tunes the model make demo trained: run make demo first" >&2; exit 2; }
	$(BIN)/python -m raytrn.demos.finetune

# A learning-rate sweep of the tiny model (jobs/sweep-tiny.yaml: 4 trials, 2 at a time, ASHA on val_loss): make demo's
# corpus again, with its tokenizer and a validation split. Ends with the trials ranked and best.yaml. ~2 minutes here.
DEMO_VAL_DATA := data/stdlib-val

$(DEMO_VAL_DATA)/manifest.json: $(DEMO_DATA)/manifest.json
	$(BIN)/raytrn data prepare --input '$(STDLIB)/*.py' --output $(DEMO_VAL_DATA) --seq-len 128 \
		--tokenizer $(DEMO_DATA)/tokenizer.json --validation-fraction 0.05

demo-sweep: venv data $(DEMO_VAL_DATA)/manifest.json
	$(BIN)/raytrn sweep jobs/sweep-tiny.yaml --name demo-sweep-$$(date +%Y%m%d-%H%M%S)

# Benchmarks (not part of `make test`): overhead vs bare PyTorch / stock Ray Train, scaling, data, checkpoint,
# MLflow, recovery; writes bench/results/ and rewrites the README's Benchmarks block.
bench: venv data
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# The unit tests first (pure logic, CPU only; UNIT_WORKERS pytest processes, a test file's tests in one of them),
# then the integration and chaos tests (real Ray, MLflow, S3, the simulator) on RAY_WORKERS pytest processes: a test
# module's tests in one of them, the simulator's tests together, the longest first, a test marked `alone` while the
# other process waits (tests/lanes.py). The Ray tests run without the unit tests beside them on purpose: on 2 cores,
# those made both slower and pushed the Ray tests past their time bounds (stop 26: make test took 49 min in CI).
UNIT_WORKERS ?= 2
XDIST := -n $(UNIT_WORKERS) --dist loadfile
RAY_WORKERS ?= 2
RAY_XDIST := -n $(RAY_WORKERS) --dist loadscope --no-loadscope-reorder

test: venv
	$(BIN)/python -m pytest -q $(XDIST) tests/unit $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q $(RAY_XDIST) tests/integration tests/chaos $(PYTEST_ARGS)

test-xla: venv-xla
	PJRT_DEVICE=CPU $(VENV_XLA)/bin/python -m pytest -q tests/xla $(PYTEST_ARGS)

# Python 3.12: the unit suite, then a real-Ray training test (TorchNeuron's Ray backend on gloo, FSDP + compile).
test-py312: venv-py312
	$(VENV_PY312)/bin/python -m pytest -q $(XDIST) tests/unit $(PYTEST_ARGS)
	$(VENV_PY312)/bin/python -m pytest -q $(PYTEST_ARGS) \
		tests/integration/test_backend_in_ray.py::test_torchneuron_ray_backend_sets_the_env_and_trains_like_one_process

unit: venv
	$(BIN)/python -m pytest -q -m unit $(XDIST) $(PYTEST_ARGS)

integration: venv
	$(BIN)/python -m pytest -q -m integration $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check raytrn tests bench tools
	$(BIN)/ruff format --check raytrn tests bench tools
	$(BIN)/mypy raytrn bench tools

format: venv
	$(BIN)/ruff format raytrn tests bench tools
	$(BIN)/ruff check --fix raytrn tests bench tools

clean:
	rm -rf $(VENV) $(VENV_XLA) $(VENV_PY312) .uv data checkpoints mlruns .pytest_cache .ruff_cache .mypy_cache
