# Quick start: `make demo` runs torchturbo on the built-in default workload; `make test` runs
# the tests. Both create .venv when missing and install the CPU build of torch first (a plain
# `pip install torch` would pull a multi-GB CUDA build), then the project with its test extras.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchturbo tune --workload vision --time-budget 150s --out turbo-report

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/techniques.py --workload vision --json benchmarks/results/techniques-vision.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache turbo-report
