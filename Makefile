# The two commands of the contract: `make demo` (the main job) and `make test`.
# Both need only python3 (>= 3.11, as the pinned numpy and matplotlib do): they create .venv here and install into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pins every package to the versions CI uses; torch 2.13.0 is the CPU build on these machines.
CONSTRAINTS := constraints.txt

.PHONY: install demo figures test test-fast lint bench gpu-check mutations tensorboard clean study diagnose-panel tensorboard-check

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==26.3
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

# The main job writes everything under runs/ (its figures too: runs/demo<n>/comparison.png),
# so a clone stays clean.
demo: $(STAMP)
	$(BIN)/python scripts/main_job.py

# Refreshes the committed docs/figures/*.png that the README shows. Run it on the machine
# whose numbers the README's tables give, the Intel Xeon VM (AVX-512) of this project's CI
# (spike at step 147): the run depends on the CPU's float kernels (an AMD EPYC, AVX2, spikes
# at step 150), and the figures must match the tables beside them.
figures: $(STAMP)
	$(BIN)/python scripts/main_job.py --figures_dir docs/figures

# The suite on one worker per core of CI's machine (pytest-xdist; WORKERS=0: in this
# process, WORKERS=auto: one per core here). A file's tests go to one worker, which trains
# the runs they share once (loadfile: xdist's groups are ignored under pytest 9.2,
# pytest-xdist#1386), the files with slow tests first (tests/conftest.py); the ten
# slowest tests end the log.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(XDIST) --durations=10

# The inner loop: all but the end-to-end runs marked slow (which `make test` and CI run).
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

# The demos' study over 12 seeds, the LR sweep and the early warning (docs/study.md), as
# one configuration of the study of any module: runs/study/report.md. A rerun continues a
# stopped study. `make study STUDY_CONFIG=configs/study/demo-quick.yaml`: the same study on a
# tiny model in a minute or two; STUDY_ARGS adds options (--workers 1).
STUDY_CONFIG ?= configs/study/demo.yaml
study: $(STAMP)
	$(BIN)/python -m lit_spikes.tools.cli study --config $(STUDY_CONFIG) $(STUDY_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python scripts/bench.py
	$(BIN)/python scripts/bench_library.py
	$(BIN)/python scripts/bench_check_resume.py
	$(BIN)/python scripts/bench_forensics.py

# On a GPU machine: exact resume on CUDA (32-true, bf16-mixed), the callbacks' cost and the
# host syncs per step; without CUDA it checks the resume on the CPU and says what it skips.
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

# Breaks each guarantee in a copy of the code (scripts/mutations.py's table) and checks
# that the tests guarding it fail; not part of `make test` (a few minutes).
mutations: $(STAMP)
	$(BIN)/python scripts/mutations.py

# diagnose on spikes planted in two modules of the tests' (docs/recover-and-diagnose.md)
diagnose-panel: $(STAMP)
	PYTHONPATH=. $(BIN)/python scripts/diagnose_panel.py

# What a person sees in TensorBoard of a user's module (fit and recover): read with
# TensorBoard's reader, then in headless Chromium where installed (apt install chromium);
# screenshots in runs/tensorboard_check (TB_ARGS="--out docs/figures/tensorboard": the docs').
tensorboard-check: $(STAMP)
	PYTHONPATH=. $(BIN)/python scripts/tensorboard_check.py $(TB_ARGS)

tensorboard: $(STAMP)
	$(BIN)/tensorboard --logdir runs

clean:
	rm -rf runs lightning_logs .pytest_cache .ruff_cache
