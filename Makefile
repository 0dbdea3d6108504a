# gpushare: `make run` starts nodemgr, `make test` runs every check, `make bench` measures,
# `make demo` shows gpushare at work.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SOURCES := setup.py pyproject.toml gpushare-autoload.pth $(wildcard shim/*) $(wildcard sim/*) \
	$(wildcard gpushare/*.py nodemgr/*.py nodemgr/*/*.py client_plugin/*.py placement/*.py placement/*/*.py kube/*.py kube/*/*.py kube/proto/*.proto)
PYTEST_ARGS ?=
# Test files run in parallel, a file's tests on one worker (pytest-xdist); 0 runs them serially.
PYTEST_WORKERS ?= auto
PYTEST := $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile
BENCH_ARGS ?=

.PHONY: all install proto torch-env real-driver run test lint format pytest bench bench-nodemgr bench-shim bench-client bench-timeslice bench-torch bench-qos bench-predict bench-cluster bench-kube bench-gpu bench-gpu-qos bench-gpu-timeslice bench-gpu-predict debug \
	debug-test c-coverage demo clean

all: install

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "setuptools>=77" "cffi>=1.17" wheel
	touch $@

# The package is built and installed like a user's `pip install .`; tests run
# against the installed copy, shim and simulated driver included.
# setuptools copies a source into build/lib only when it is newer than the copy there:
# a file put back to an older version would be skipped. The build starts clean instead.
# The wheel is built once and installed into both venvs (the torch venv's below).
WHEEL_DIR := build/wheel
$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	@echo "make: building gpushare (the shim, the simulated driver) and installing it into $(VENV)"
	rm -rf build/lib.* build/temp.* $(WHEEL_DIR)
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/gpushare-*.whl
	$(BIN)/python -m pip install -q "$$(echo $(WHEEL_DIR)/gpushare-*.whl)"
	touch $@

# What tests, lint and benchmarks need beside the package (`make run` does without).
$(VENV)/.dev: $(VENV)/.installed pyproject.toml
	@echo "make: installing the test and development tools into $(VENV)"
	$(BIN)/python -m pip install -q "$$(echo $(WHEEL_DIR)/gpushare-*.whl)[test,dev]"
	touch $@

install: $(VENV)/.dev

# The kubelet's protocol modules (kube/proto/*_pb2*.py), made from the .proto files there
# by the pinned grpcio-tools and committed; tests/kube checks they are its output.
PROTOS := kube/proto/deviceplugin.proto kube/proto/podresources.proto
proto: $(VENV)/.dev
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. $(PROTOS)

# The real-PyTorch tiers (tests/real_torch/test_torch_sim.py, test_torch_timeline.py, and
# under gpushare test_torch_gpushare.py, test_torch_processes.py, test_torch_timeslice.py,
# test_torch_qos.py, test_torch_kube.py) run a pinned
# PyTorch on the simulated driver from a venv of its own (the main venv's tests import a
# stand-in `torch`). Made once: pip downloads about 3 GB (torch and its nvidia-* CUDA 13.0
# libraries) where it has no local copy, and the venv takes 5.4 GB. The stamp names the version, so a
# new pin makes the venv again. The tier gets the venv's Python in GPUSHARE_TEST_TORCH_PYTHON.
TORCH_VERSION := 2.14.1
TORCH_VENV    := .venv-torch
TORCH_STAMP   := $(TORCH_VENV)/.torch-$(TORCH_VERSION)

$(TORCH_STAMP):
	rm -rf $(TORCH_VENV)
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)"
	touch $@

# gpushare itself goes into the torch venv as a user installs it beside their framework
# (its wheel, `pip install build/wheel/gpushare-*.whl`; the project is not on PyPI): the
# same wheel as the main venv's, so that auto-load and the
# iteration hooks run inside the real torch process.
TORCH_GPUSHARE := $(TORCH_VENV)/.gpushare
$(TORCH_GPUSHARE): $(TORCH_STAMP) $(VENV)/.installed
	$(TORCH_VENV)/bin/python -m pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/gpushare-*.whl
	$(TORCH_VENV)/bin/python -m pip install -q $(WHEEL_DIR)/gpushare-*.whl
	touch $@

torch-env: $(TORCH_GPUSHARE)

# The real-NVIDIA-driver tier (tests/shim/test_real_driver.py) runs Debian's non-free user-space
# driver (libcuda1, libnvidia-ml1, nvidia-smi; no kernel module, no GPU) from build/ without
# installing it: tests/fetch_real_driver.sh downloads and unpacks the packages once, with
# apt on private lists. Where it cannot, it says why in build/real-driver/unavailable, the
# tier is skipped with that reason, and the next run tries again.
REAL_DRIVER := build/real-driver

real-driver:
	@sh tests/fetch_real_driver.sh $(REAL_DRIVER)

run: $(VENV)/.installed
	@if nvidia-smi -L >/dev/null 2>&1; then cfg=configs/nodemgr.toml; \
	else cfg=configs/sim.toml; echo "no NVIDIA driver found: simulated GPUs ($$cfg)"; fi; \
	exec $(BIN)/nodemgr serve --config $$cfg

# The C of shim/, sim/ and tests/c in one style (.clang-format); generated files left out.
C_SOURCES = $(filter-out sim/cuda_api.gen.h,$(wildcard shim/*.c shim/*.h sim/*.c sim/*.h tests/c/*.c))

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/clang-format --dry-run --Werror $(C_SOURCES)

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(C_SOURCES)

# Line and branch coverage of the Python packages, in every process the suite starts
# ([tool.coverage] in pyproject.toml: what is measured, the floor that fails the run). On
# for the whole suite and off when PYTEST_ARGS picks tests, unless COVERAGE=1 (or 0) says.
# The terminal lists the files not wholly covered; build/coverage/python.json has it all.
COVERAGE ?= $(if $(strip $(PYTEST_ARGS)),0,1)
PYTEST_COV = $(if $(filter 1,$(COVERAGE)),--cov --cov-report=term --cov-report=json)

# pytest exits 5 when it collects nothing; that is a failure here, said aloud.
pytest: install torch-env real-driver
	@GPUSHARE_TEST_TORCH_PYTHON=$(CURDIR)/$(TORCH_VENV)/bin/python \
	GPUSHARE_TEST_REAL_DRIVER=$(CURDIR)/$(REAL_DRIVER) $(PYTEST) $(PYTEST_COV) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests - failing" >&2; fi; exit $$rc

# Every step runs even when one before it failed (make -k): a failed pytest does not hide
# the sanitizer tier's result. make still fails, and says which steps did.
TEST_STEPS := lint pytest debug-test c-coverage
test:
	@$(MAKE) --no-print-directory -k $(TEST_STEPS) || { \
		echo "make: test FAILED: the steps marked *** above; each step of $(TEST_STEPS)" \
			"ran unless what it needs failed" >&2; exit 1; }

# Benchmarks: JSON on stdout and in build/bench/NAME.json, one document per
# script (nodemgr: a real daemon on simulated GPUs; shim: the preload library
# against the simulated driver). A missed target is reported there, not failed
# on; BENCH_ARGS=--check makes it a failure, --quick a smoke run. Both scripts
# run even if the first fails; the worse status is make's. --only NAME belongs
# to one script: use bench-nodemgr, bench-shim, bench-client, bench-timeslice,
# bench-torch, bench-qos, bench-predict, bench-cluster or bench-kube for it. The cluster script
# reads the Alibaba GPU v2023 trace from $$GPUSHARE_TRACES (docs/placement.md). The torch, qos and predict scripts run
# the torch venv's PyTorch on the simulated driver (qos on its device timeline); they get
# that Python in GPUSHARE_TORCH_PYTHON.
BENCHES := nodemgr shim client timeslice torch qos predict cluster kube
TORCH_BENCHES := torch qos predict
BENCH_ENV := GPUSHARE_TORCH_PYTHON=$(CURDIR)/$(TORCH_VENV)/bin/python

bench: install torch-env
	@status=0; for b in $(BENCHES); do echo "make: benchmarks/$${b}_bench.py" >&2; \
		$(BENCH_ENV) $(BIN)/python benchmarks/$${b}_bench.py --out build/bench/$$b.json $(BENCH_ARGS); \
		rc=$$?; if [ $$rc -ge 128 ]; then exit $$rc; fi; \
		if [ $$rc -gt $$status ]; then status=$$rc; fi; \
	done; exit $$status

$(addprefix bench-,$(filter-out $(TORCH_BENCHES),$(BENCHES))): bench-%: install
	$(BIN)/python benchmarks/$*_bench.py --out build/bench/$*.json $(BENCH_ARGS)

$(addprefix bench-,$(TORCH_BENCHES)): bench-%: install torch-env
	$(BENCH_ENV) $(BIN)/python benchmarks/$*_bench.py --out build/bench/$*.json $(BENCH_ARGS)

# The shim's cost to a PyTorch program on a real NVIDIA GPU (exits 2 without one, or
# without PyTorch): JSON on stdout and in build/bench/gpu.json. Not part of `bench`,
# which stays GPU-free. BENCH_ARGS as for bench (--quick, --only NAME, --check, --python PY).
bench-gpu: install
	$(BIN)/python benchmarks/gpu_bench.py --out build/bench/gpu.json $(BENCH_ARGS)

# The Python of the GPU benchmarks below: one with PyTorch and gpushare both installed.
PYTHON_TORCH ?= $(BIN)/python

# Latency classes and compute shares on an NVIDIA GPU (exits 2 without one): qos's benchmarks
# with nodemgr on NVML, their jobs in PYTHON_TORCH.
bench-gpu-qos: install
	$(PYTHON_TORCH) benchmarks/qos_bench.py --gpu --python $(PYTHON_TORCH) --out build/bench/gpu_qos.json $(BENCH_ARGS)

# Real PyTorch training loops time-sliced on an NVIDIA GPU (exits 2 without one): it needs
# a Python with PyTorch and gpushare both installed, PYTHON_TORCH.
bench-gpu-timeslice: install
	$(PYTHON_TORCH) benchmarks/gpu_timeslice_bench.py --out build/bench/gpu_timeslice.json $(BENCH_ARGS)

# Prediction on an NVIDIA GPU (exits 2 without one): the dry runs of the zoo on the
# simulated driver against the same jobs on the GPU, in PYTHON_TORCH.
bench-gpu-predict: install
	$(PYTHON_TORCH) benchmarks/predict_bench.py --gpu --python $(PYTHON_TORCH) --out build/bench/gpu_predict.json $(BENCH_ARGS)

# A tour of gpushare on two simulated GPUs (its own nodemgr, two environments,
# a task that waits and one that meets its quota), in a few seconds. Also a
# smoke test: it exits non-zero when something did not happen as it says.
demo: install
	$(BIN)/python demo/demo.py

# ASan/UBSan builds of the shim, the simulated driver and NVML, for the C tests; the shim's
# counts its lines and branches too (gcov, for c-coverage below).
debug: install
	$(BIN)/python shim/build.py --debug address --coverage --out build/debug
	$(BIN)/python sim/build.py --debug address --out build/debug

# The tests that drive the shim and the simulated driver, run against their sanitizer
# builds: ASan+UBSan for all of them, TSan for the threaded ones and the pacer's (their
# clients are built with TSan too). Any report fails the test, since the process then
# exits non-zero.
SANITIZED_TESTS := tests/shim tests/sim tests/e2e/test_enforcement.py tests/daemon/test_reclaim.py
debug-test: debug
	$(BIN)/python shim/build.py --debug thread --out build/tsan
	$(BIN)/python sim/build.py --debug thread --out build/tsan
	GPUSHARE_SHIM=$(CURDIR)/build/debug/libgpushare.so GPUSHARE_TEST_SANITIZE=address \
	GPUSHARE_SIM_DIR=$(CURDIR)/build/debug/sim \
	ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	$(PYTEST) -p no:cacheprovider $(SANITIZED_TESTS) $(PYTEST_ARGS)
	GPUSHARE_SHIM=$(CURDIR)/build/tsan/libgpushare.so GPUSHARE_TEST_SANITIZE=thread \
	GPUSHARE_SIM_DIR=$(CURDIR)/build/tsan/sim \
	TSAN_OPTIONS=halt_on_error=1 \
	$(PYTEST) -p no:cacheprovider tests/shim/test_shim.py tests/shim/test_attach.py \
		tests/shim/test_compute.py -k "threads or test_compute" $(PYTEST_ARGS)

# The shim's line and branch coverage in debug-test's ASan+UBSan run (gcov): a table, the
# figures in build/coverage/c.json, and a failure below the floors in tests/c_coverage.py.
# PYTEST_ARGS may make the run partial: its figures are then reported, the floors not applied.
c-coverage: debug-test
	$(BIN)/python tests/c_coverage.py build/debug --out build/coverage/c.json \
		$(if $(strip $(PYTEST_ARGS)),--no-floor)

clean:
	rm -rf build dist *.egg-info gpushare/lib nodemgr/_ledger*.so nodemgr/_ledger.c
