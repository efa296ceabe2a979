# Quick start: `make demo` runs torchturbo on the built-in default workload; `make test` runs
# the tests. Both create .venv when missing, install torch ($(TORCH_SPEC)) into it first, then
# the project, editable, with its test extras.
#
# Which torch build you get is pip's choice, not ours: from PyPI, Linux x86 wheels are the CUDA
# build (several GB of CUDA libraries); a machine whose pip is configured with a local wheel or
# index gets that one. Choose with the two variables below, e.g.
#   make TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu demo     # CPU-only build
#   make TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 demo   # CUDA 12.6 build
#   make TORCH_SPEC="torch>=2.6" demo                                  # any supported version
# A torch already in .venv that satisfies TORCH_SPEC is kept as it is.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# The test extras, plus Triton (the CUDA kernel's tests run under its CPU interpreter) and
# torchao (float8): neither pulls a torch of its own.
EXTRAS ?= test,triton,float8
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench dist clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchturbo tune --workload vision --time-budget 150s --out turbo-report

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/techniques.py --workload vision --json benchmarks/results/techniques-vision.json

# The sdist and wheel a user would install, in dist/ (tests/test_package.py builds them from a
# clean copy and runs the wheel in a fresh venv). setuptools re-reads the file list of an old
# src/*.egg-info, so a stale one (with __pycache__ entries) is removed first.
dist: $(STAMP)
	rm -rf build src/*.egg-info
	$(BIN)/python -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache turbo-report
