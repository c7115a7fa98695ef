PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test lint typecheck pytest demo bench docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# `make test` runs the tests marked `numerics` a second time on another code path of the CPU:
# ATen's and inductor's scalar kernels (ATEN_CPU_CAPABILITY=default), which round differently
# from the vectorized code of any AVX2 or AVX-512 machine, so that a tolerance tuned to one
# machine's results fails on the developer's machine too (tests/README.md).
SECOND_CPU_PATH ?= default
# pytest-xdist workers (one per core of the 2-core CI machines; `make test PYTEST_WORKERS=0` runs
# in one process).
PYTEST_WORKERS ?= 2

pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile
	ATEN_CPU_CAPABILITY=$(SECOND_CPU_PATH) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m numerics

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/python examples/demo.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --scaling --cold --distributed

docs: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) demo-out site
