# One-step set-up and the two everyday commands (see README.md).
PYTHON ?= python3
VENV ?= .venv
# CPU machines and CI pin torch 2.13.0 (CPU build); set CONSTRAINTS= on GPU clusters to get CUDA wheels.
CONSTRAINTS ?= constraints-cpu.txt
# DeepSpeed JIT-builds a few C++ ops on first use; keep them between runs, one folder per
# virtual environment (a build made against another environment's torch would be rebuilt each time).
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/swbert/torch_extensions/$(shell echo $(abspath $(VENV)) | cksum | cut -d' ' -f1)
BIN := $(VENV)/bin
# DeepSpeed's accelerator: as set, else cuda where torch sees a GPU, else cpu (evaluated where used)
DS_ACCELERATOR_DEFAULT = $${DS_ACCELERATOR:-$$($(BIN)/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}

.PHONY: setup pretrain finetune docs-check test test-fast test-long test-faults test-gpu lint golden clean

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[dev]"
	# the commit-msg hook (.githooks/commit-msg: subjects of at most 72 characters), in a git clone
	git rev-parse --git-dir >/dev/null 2>&1 && git config core.hooksPath .githooks || true
	# the ops every job loads at start-up, built once here rather than inside the first job (or test)
	DS_ACCELERATOR=$(DS_ACCELERATOR_DEFAULT) $(BIN)/python -m swbert.runtime.extensions
	touch $@

setup: $(BIN)/.installed

# The embedded default recipe on 2 ranks (2 CPU processes here; set NPROC=8 on an 8-GPU node);
# RECIPE=NAME runs another of swbert/recipes/ (RECIPE=modern: the modern encoder recipe, ours).
NPROC ?= 2
RECIPE ?=
pretrain: setup
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=$(DS_ACCELERATOR_DEFAULT) \
	  $(BIN)/deepspeed --num_gpus $(NPROC) launchers/pretrain.py $(if $(RECIPE),--config $(RECIPE)) \
	  --output-dir runs/$(or $(RECIPE),default)-$$(date +%Y%m%d-%H%M%S)

# The fine-tuning half, offline: the newest `make pretrain` export (or CHECKPOINT=DIR) fine-tuned on
# small embedded GLUE-style and SQuAD-style tasks (swbert.finetune.synthetic: a check that the
# pipeline runs and learns, not a benchmark), one seed and one rate each, then the report. A small
# classifier head needs 1e-3 to learn in 3 short epochs; the span head learns at 1e-4 (both seen here).
CHECKPOINT ?= $(lastword $(sort $(wildcard runs/default-*/export)))
ifndef FINETUNE_DIR
FINETUNE_DIR := runs/finetune-$(shell date +%Y%m%d-%H%M%S)
endif
FINETUNE_FLAGS ?= --seeds 1 --batch-size 16
finetune: setup
	@test -n "$(CHECKPOINT)" || { echo "error: no runs/default-*/export: run make pretrain first, or name an export: make finetune CHECKPOINT=DIR" >&2; exit 2; }
	@test -f "$(CHECKPOINT)/config.json" || { echo "error: CHECKPOINT=$(CHECKPOINT) holds no config.json: name an exported model folder (RUN/export)" >&2; exit 2; }
	$(BIN)/python -m swbert.finetune.synthetic --output $(FINETUNE_DIR)/data
	$(BIN)/python launchers/finetune_glue.py --checkpoint $(CHECKPOINT) --data-dir $(FINETUNE_DIR)/data/glue --tasks sst2 \
	  --learning-rates 1e-3 --epochs 3 \
	  $(FINETUNE_FLAGS) --tracking-uri sqlite:///$(abspath $(FINETUNE_DIR))/mlflow.db --output-dir $(FINETUNE_DIR)/glue
	$(BIN)/python launchers/finetune_squad.py --checkpoint $(CHECKPOINT) --versions 1.1 \
	  --train-file 1.1=$(FINETUNE_DIR)/data/squad/train-v1.1.json --dev-file 1.1=$(FINETUNE_DIR)/data/squad/dev-v1.1.json \
	  --max-seq-length 128 --doc-stride 32 --learning-rates 1e-4 --epochs 2 \
	  $(FINETUNE_FLAGS) --tracking-uri sqlite:///$(abspath $(FINETUNE_DIR))/mlflow.db --output-dir $(FINETUNE_DIR)/squad
	$(BIN)/python launchers/report.py --runs-dir $(FINETUNE_DIR) --out $(FINETUNE_DIR)/report \
	  $(if $(wildcard $(CHECKPOINT)/../metrics.jsonl),--pretrain-runs pretrain=$(CHECKPOINT)/..)
	@echo "fine-tuned $(CHECKPOINT): the models, the MLflow store and the report are in $(FINETUNE_DIR)"

# Every shell command of README.md and docs/*.md that runs offline on CPU, run as written in a
# scratch copy of the checkout, in order; one table (benchmarks/docs_commands.py). Not part of
# `make test`: it pretrains and fine-tunes, 15-30 minutes on 2 CPU cores (more when loaded). DOCS_CHECK_FLAGS: the
# script's flags (--list, --only WORD, --scratch DIR, --report FILE ...).
docs-check: setup
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python benchmarks/docs_commands.py --venv $(VENV) $(DOCS_CHECK_FLAGS)

# Test workers: one per core of CI's 2. A third fills some of the time a worker waits on the jobs
# it launched, but the timing tests (a hung neighbour named within a window) then miss their windows.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not long"

# The unit tier: every test that starts no job and takes under about 2 s (under 2 minutes in all);
# `make test` runs these and the end-to-end tests (marked slow) together.
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not long"

# The cases `make test` leaves out to stay within its time, each a repeat of a CI case in another
# configuration: the compiled engine at ZeRO-1 and 2 (CI: ZeRO-3 and TP compiled), eager ZeRO-1 (CI:
# ZeRO-2 and 3), selective checkpointing compiled (CI: none, compiled), the heartbeat through a whole
# job, SIGINT (CI: SIGTERM), skipped non-finite steps at ZeRO-2 (CI: ZeRO-0, and ZeRO-2 inside
# test_pretrain), the sync count at ZeRO-3 (CI: ZeRO-2), two nodes compiled or under the deepspeed
# launcher (CI: torchrun, eager), a killed or hung rank 1 without a launcher (CI: killed rank 0, and
# a hung rank 1 named by the heartbeat), the scaling driver's local grid (CI: the same grid as a SLURM
# job array), the smoke runs of the pretraining, preprocessing and fine-tuning benchmarks (CI: the
# same launches, preprocessing and fine-tuning in tests/), the whole GPU-window rehearsal (CI: the
# steps no other test covers). The quality ladder (about 20 minutes) runs only here.
# Test files reach the 2 workers longest first (tests/conftest.py), hence --no-loadscope-reorder.
test-long: setup
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m long

# The whole kill -9 / non-finite fault matrix (CI runs a sample of it inside `make test`).
test-faults: setup
	SWBERT_FULL_FAULT_MATRIX=1 DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n 2 --dist loadgroup tests/e2e/test_fault_matrix.py tests/e2e/test_nonfinite.py

# The GPU window (benchmarks/gpu_window.py): on a lent GPU machine with no index and no venv, the wheels of
# `make gpu-wheels` installed offline, then each check with its own timeout, within 9 minutes; the report
# in runs/gpu-window/ (gpu-window.md, gpu-window.json). Its interpreter's torch must see the GPU. No
# `setup` first: that machine cannot reach an index. `--rehearse` runs it at tiny sizes on a CPU.
test-gpu:
	$(PYTHON) benchmarks/gpu_window.py $(GPU_WINDOW_FLAGS)

# Rewrite the golden loss curves (tests/assets/losses/) after a change of numerics on purpose;
# the commit that does it says why (tests/golden.py).
golden: setup
	SWBERT_UPDATE_GOLDEN=1 DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m golden

# The wheels a lent GPU machine (Python 3.12, torch 2.11, no package index) lacks for a pretraining
# check: deepspeed (built here, ops left to JIT), megatron-core and transformers at constraints-cpu.txt's
# versions, protobuf (data_prep), and the requirements its image does not hold, for cp312 x86_64 Linux,
# into .whl/ (git-ignored, emptied first, at most 40 MiB; benchmarks/gpu_wheels.py says why each).
# There: pip install --no-index --no-deps --target DIR .whl/*.whl, then DIR first on PYTHONPATH and PATH.
.PHONY: gpu-wheels
gpu-wheels: setup
	$(BIN)/python benchmarks/gpu_wheels.py --dest .whl

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
