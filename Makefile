# gpushare: `make run` starts nodemgr, `make test` runs every check, `make bench` measures.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SOURCES := setup.py pyproject.toml $(wildcard shim/*) \
	$(wildcard nodemgr/*.py nodemgr/cli/*.py client_plugin/*.py)
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: all install run test lint format pytest bench bench-gpu debug clean

all: install

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "setuptools>=70" "cffi>=1.17" wheel
	touch $@

# The package is built and installed like a user's `pip install .`; tests run
# against the installed copy, shim and simulated driver included.
$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(BIN)/python -m pip install -q --no-build-isolation ".[test,dev]"
	touch $@

install: $(VENV)/.installed

run: install
	@if nvidia-smi -L >/dev/null 2>&1; then cfg=configs/nodemgr.toml; \
	else cfg=configs/sim.toml; echo "no NVIDIA driver found: simulated GPUs ($$cfg)"; fi; \
	exec $(BIN)/nodemgr serve --config $$cfg

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# pytest exits 5 when it collects nothing; that is a failure here, said aloud.
pytest: install
	@$(BIN)/pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests - failing" >&2; fi; exit $$rc

test: lint pytest

# Benchmarks of a real nodemgr on simulated GPUs: JSON on stdout and in
# build/bench/nodemgr.json. A missed target is reported there, not failed on;
# BENCH_ARGS=--check makes it a failure (--quick, --only NAME: see --help).
bench: install
	$(BIN)/python benchmarks/nodemgr_bench.py --out build/bench/nodemgr.json $(BENCH_ARGS)

# The shim's cost to a PyTorch program on a real NVIDIA GPU (exits 2 without one, or
# without PyTorch): JSON on stdout and in build/bench/gpu.json. Not part of `bench`,
# which stays GPU-free. BENCH_ARGS as for bench (--quick, --only NAME, --check, --python PY).
bench-gpu: install
	$(BIN)/python benchmarks/gpu_bench.py --out build/bench/gpu.json $(BENCH_ARGS)

# ASan/UBSan builds of the shim and simulated driver, for the C tests.
debug: install
	$(BIN)/python shim/build.py --debug --out build/debug

clean:
	rm -rf build dist *.egg-info client_plugin/lib nodemgr/_ledger*.so nodemgr/_ledger.c
