# Two commands for a newcomer: `make demo` (serve a real small model) and `make test`.
PY ?= python3
VENV ?= .venv
# pytest-xdist processes (CI's machine has 2 cores: the suite takes 14 min instead of 27)
TEST_WORKERS ?= 2
BIN = $(VENV)/bin

.PHONY: setup demo test lint device-triton

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.11"
	$(BIN)/pip install -q -e ".[dev]"

demo: setup
	$(BIN)/python -m ninfer.cli.demo

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

lint: setup
	$(BIN)/ruff check ninfer tests bench

# The GPU machine's Triton (3.6, with torch 2.11) beside the CPU one, for the sm_90 builds that bench/sass_*.py
# read: another Triton lays tensors out differently (3.9 put layout conversions in loops 3.6 builds clean).
# Use: PYTHONPATH=.triton-device $(BIN)/python bench/sass_rows.py
device-triton: setup
	$(BIN)/pip install -q --no-deps --target .triton-device triton==3.6.0
