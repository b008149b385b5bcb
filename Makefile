# The two commands of the contract: `make demo` (the main job) and `make test`.
# Both need only python3 (>= 3.11, as the pinned numpy and matplotlib do): they create .venv here and install into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pins every package to the versions CI uses; torch 2.13.0 is the CPU build on these machines.
CONSTRAINTS := constraints.txt

.PHONY: install demo test lint bench tensorboard clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==26.3
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/main_job.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

tensorboard: $(STAMP)
	$(BIN)/tensorboard --logdir runs

clean:
	rm -rf runs lightning_logs .pytest_cache .ruff_cache
