# Set-up and entry points. `make run` and `make test` work on a fresh clone: they create
# .venv, install what is needed, then run. On a machine without a GPU, torch is pinned to
# the CPU build first, so pip never pulls a multi-GB CUDA build there.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CPU_TORCH := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: run test setup setup-test clean

run: setup
	$(BIN)/mshpc train configs/tiny.yaml

test: setup-test
	$(BIN)/python -m pytest tests -q

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
	rm -rf $(VENV) .cache runs
