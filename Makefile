# One-step set-up and the two everyday commands (see README.md).
PYTHON ?= python3
VENV ?= .venv
# CPU machines and CI pin torch 2.13.0 (CPU build); set CONSTRAINTS= on GPU clusters to get CUDA wheels.
CONSTRAINTS ?= constraints-cpu.txt
# DeepSpeed JIT-builds a few C++ ops on first use; keep them between runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/swbert/torch_extensions
BIN := $(VENV)/bin

.PHONY: setup pretrain test lint clean

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

pretrain: setup
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/deepspeed --num_gpus 2 launchers/pretrain.py

test: setup
	$(BIN)/ruff check .
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
