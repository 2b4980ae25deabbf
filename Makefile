# The two entry points of the README: `make demo` and `make test` (and `make test-quick` for the edit loop).
# Each sets up .venv first (once).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mm_rl-installed
# The embedded model of `make demo`: tiny (Qwen2.5-VL), tiny_qwen2_vl, tiny_qwen3_vl or tiny_qwen3_vl_moe.
MODEL ?= tiny
DEMO := output/$(MODEL)_grpo
# Extra pip arguments for torch, e.g. the CPU wheel index on machines without the wheel on disk.
TORCH_PIP_ARGS ?=

.PHONY: setup demo test test-quick lint

setup: $(STAMP)

# Re-run only when setup.py changes. torch 2.13.0 (CPU) goes first so that nothing resolves a CUDA build.
$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[cpu,dev]'
	$(BIN)/python -m mm_rl.platform.cpu_wheels
	touch $@

demo: $(STAMP)
	$(BIN)/ascendfactory-cli config --af_model_name $(MODEL) --exp_name $(MODEL)_grpo --output_file_path $(DEMO)/job.yaml
	$(BIN)/ascendfactory-cli check $(DEMO)/job.yaml
	$(BIN)/ascendfactory-cli train $(DEMO)/job.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

# The edit loop: unit, algorithm, config, conversion and parity tests; no whole job or learning run (marked slow),
# no test on the real Ray / engine / rank stack (marked stack). About 2 minutes on 2 cores.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not stack"

lint: $(STAMP)
	$(BIN)/ruff check mm_rl cli tests bench
	$(BIN)/ruff format --check mm_rl cli tests bench
