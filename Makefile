# One-step set-up and the two everyday commands (see README.md).
PYTHON ?= python3
VENV ?= .venv
# CPU machines and CI pin torch 2.13.0 (CPU build); set CONSTRAINTS= on GPU clusters to get CUDA wheels.
CONSTRAINTS ?= constraints-cpu.txt
# DeepSpeed JIT-builds a few C++ ops on first use; keep them between runs, one folder per
# virtual environment (a build made against another environment's torch would be rebuilt each time).
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/swbert/torch_extensions/$(shell echo $(abspath $(VENV)) | cksum | cut -d' ' -f1)
BIN := $(VENV)/bin

.PHONY: setup pretrain test test-fast test-long test-faults test-gpu lint golden clean

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[dev]"
	# the commit-msg hook (.githooks/commit-msg: subjects of at most 72 characters), in a git clone
	git rev-parse --git-dir >/dev/null 2>&1 && git config core.hooksPath .githooks || true
	touch $@

setup: $(BIN)/.installed

# The embedded default recipe on 2 ranks (2 CPU processes here; set NPROC=8 on an 8-GPU node).
NPROC ?= 2
pretrain: setup
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=$${DS_ACCELERATOR:-$$($(BIN)/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")} \
	  $(BIN)/deepspeed --num_gpus $(NPROC) launchers/pretrain.py --output-dir runs/default-$$(date +%Y%m%d-%H%M%S)

# Test workers: one more than the 2 cores CI has. A worker spends much of its time waiting on the
# jobs it launched (rendezvous and collective timeouts, SLURM scheduling, a stalled store); the
# third worker runs in those gaps.
TEST_WORKERS ?= 3
test: setup
	$(BIN)/ruff check .
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not long"

# The unit tier: every test that starts no job and takes under about 2 s (under 2 minutes in all);
# `make test` runs these and the end-to-end tests (marked slow) together.
test-fast: setup
	$(BIN)/ruff check .
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not long"

# The cases `make test` leaves out to stay within its time, each a repeat of a CI case in another
# configuration: the compiled engine at ZeRO-1 and 2 (CI: ZeRO-3 and TP compiled), the heartbeat
# through a whole job, SIGINT (CI: SIGTERM), skipped non-finite steps at ZeRO-2 (CI: ZeRO-0, and
# ZeRO-2 inside test_pretrain), the sync count at ZeRO-3 (CI: ZeRO-2), two nodes under the deepspeed
# launcher (CI: torchrun, compiled), a killed rank 1 without a launcher (CI: hung rank 1, killed 0).
# Test files reach the 2 workers longest first (tests/conftest.py), hence --no-loadscope-reorder.
test-long: setup
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m long

# The whole kill -9 / non-finite fault matrix (CI runs a sample of it inside `make test`).
test-faults: setup
	SWBERT_FULL_FAULT_MATRIX=1 DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n 2 --dist loadgroup tests/test_fault_matrix.py tests/test_nonfinite.py

# The first hour on a GPU machine (benchmarks/gpu_hour.py): tests/test_cuda.py, then the GPU checks and
# benchmarks, each with a timeout; one table in runs/gpu-report.md. Without CUDA: one line, exit 77.
test-gpu: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python benchmarks/gpu_hour.py

# Rewrite the golden loss curves (tests/assets/losses/) after a change of numerics on purpose;
# the commit that does it says why (tests/golden.py).
golden: setup
	SWBERT_UPDATE_GOLDEN=1 DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m golden

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
