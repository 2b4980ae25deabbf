# The two entry points of the README: `make demo` and `make test` (and `make test-quick` for the edit loop).
# Each sets up .venv first (once). `make setup DEVICE=cuda` / `DEVICE=npu` installs an accelerator's pinned set
# instead (docs/accelerators.md); Python 3.11 or 3.12 (PYTHON=python3.12).
PYTHON ?= python3.11
DEVICE ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mm_rl-installed
# The embedded model of `make demo`: tiny (Qwen2.5-VL), tiny_qwen2_vl, tiny_qwen3_vl, tiny_qwen3_vl_moe, tiny_qwen3_5
# or tiny_qwen3_5_moe.
MODEL ?= tiny
DEMO := output/$(MODEL)_grpo
# Extra pip arguments for torch, e.g. the CPU wheel index on machines without the wheel on disk.
TORCH_PIP_ARGS ?=
# NPU: the pip index that carries triton-ascend 3.2.2 (vllm-ascend 0.23's pin; PyPI has 3.2.0 only, no cp312 wheel).
ASCEND_PIP_INDEX ?=

.PHONY: setup demo test test-quick lint

setup: $(STAMP)

# Re-run only when setup.py changes. CPU: torch 2.13.0 (CPU) goes first so that nothing resolves a CUDA build.
# CUDA: vLLM 0.32.0 brings the CUDA torch it pins. NPU (in a CANN 9.1 environment: its set_env.sh sourced): torch and
# torch-npu first, vLLM 0.23.0 without CUDA kernels, then vllm-ascend (built against CANN) with the rest. MindSpeed
# (optional: mm_rl imports it first on NPU when installed) goes in with `pip install --no-deps -e <its core_r0.16.0>`.
$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(DEVICE),cpu)
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[cpu,dev]'
else ifeq ($(DEVICE),cuda)
	$(BIN)/pip install -q -e '.[cuda,dev]'
else ifeq ($(DEVICE),npu)
	$(BIN)/pip install -q torch==2.10.0 torch-npu==2.10.0.post4
	VLLM_TARGET_DEVICE=empty $(BIN)/pip install -q vllm==0.23.0
	$(BIN)/pip uninstall -q -y triton  # CUDA's; triton-ascend (vllm-ascend's requirement) provides the module
	$(BIN)/pip install -q $(if $(ASCEND_PIP_INDEX),--extra-index-url $(ASCEND_PIP_INDEX)) -e '.[npu,dev]'
else
	@echo "DEVICE=$(DEVICE): use cpu, cuda or npu" && false
endif
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
