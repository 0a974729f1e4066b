# Set-up and entry points. `make run` and `make test` work on a fresh clone: they create
# .venv, install what is needed, then run. On a machine without a GPU, torch is pinned to
# the CPU build first, so pip never pulls a multi-GB CUDA build there.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CPU_TORCH := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: run test lint setup setup-test system-tools clean slurm-up slurm-down cuda-check

run: setup
	$(BIN)/mshpc train configs/tiny.yaml --set eval.interval_steps=20

test: lint setup-test system-tools slurm-up cuda-check
	$(BIN)/python -m pytest tests -q --durations=15

# ruff (pyflakes, import order, bugbear, pyupgrade) and mypy over the package, as pyproject.toml
# configures them, with the versions its test extra pins. `make test` runs it first: a finding
# fails in seconds, before the Slurm start and the 20-minute suite.
lint: setup-test
	$(BIN)/ruff check mshpc
	$(BIN)/mypy mshpc

# Compile every CUDA kernel (csrc/cuda/*.cu: no torch headers, so nvcc alone suffices) for sm_80
# and sm_90, compile only, so that a CUDA build break fails `make test` on a machine without a
# GPU, in C++20 as torch builds them. Without nvcc it says so, and fails under CI=true.
NVCC ?= nvcc
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
CUDA_OBJECTS := $(patsubst csrc/cuda/%.cu,build/cuda-check/%.o,$(CUDA_SOURCES))

cuda-check:
	@if command -v $(NVCC) >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory $(CUDA_OBJECTS) && \
	  echo "mshpc: nvcc compiled $(words $(CUDA_SOURCES)) CUDA files for sm_80 and sm_90"; \
	elif [ "$$CI" = true ]; then \
	  echo "mshpc: nvcc not found: csrc/cuda cannot be compile-checked (required under CI)"; exit 1; \
	else echo "mshpc: nvcc not found: csrc/cuda is not compile-checked here (CI requires it)"; fi

build/cuda-check/%.o: csrc/cuda/%.cu csrc/cuda/dtype.cuh csrc/mshpc_kernels.h
	@mkdir -p $(@D)
	$(NVCC) -std=c++20 -Werror all-warnings -gencode arch=compute_80,code=sm_80 \
	  -gencode arch=compute_90,code=sm_90 -c $< -o $@

# h5ls/h5dump, which the checkpoint tests use to show a checkpoint opens in the standard tools.
system-tools:
	@command -v h5ls >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  (apt-get install -y -q hdf5-tools >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q hdf5-tools >/dev/null)) ; } || \
	  echo "mshpc: h5ls unavailable (not root): its test will skip"

# The real local Slurm (tests/slurm/cluster.sh): installed and started when root, reused when up.
# Not root: the tests marked `slurm` skip with the reason (and fail instead under CI=true).
slurm-up:
	@if [ "$$(id -u)" = 0 ]; then bash tests/slurm/cluster.sh start; \
	else echo "mshpc: not root: the local Slurm is not started; tests marked slurm will skip"; fi

slurm-down:
	bash tests/slurm/cluster.sh stop

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install -q $(if $(HAS_GPU),torch,$(CPU_TORCH))
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) .cache runs .mypy_cache .ruff_cache
