"""Layering: the block pool, KV cache manager and scheduler are plain Python.

They must import without torch (STYLE lesson 3), so they can be read, tested and
reasoned about without the model stack. Checked in a fresh interpreter: in this
one, conftest has already imported torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE_MODULES = (
    "tandem.engine.kv.block_pool",
    "tandem.engine.kv.kv_cache_manager",
    "tandem.engine.kv.prefix_cache",
    "tandem.engine.kv.kv_swap",
    "tandem.engine.scheduling.scheduler",
    "tandem.engine.scheduling.scheduler_output",
    "tandem.engine.scheduling.preemption",
    "tandem.engine.scheduling.request",
    "tandem.engine.sampling.sampling_params",
    "tandem.engine.config",
)


def test_scheduling_layers_import_no_torch():
    code = "\n".join([
        "import importlib, sys",
        f"for name in {TORCH_FREE_MODULES!r}:",
        "    importlib.import_module(name)",
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)",
        "print(','.join(heavy))",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"imported by the scheduling layers: {res.stdout.strip()}"


def test_engine_config_names_its_torch_dtype_lazily():
    code = "\n".join([
        "import sys",
        "from tandem.engine.config import EngineConfig",
        "before = 'torch' in sys.modules",
        # Constructing validates the backend and linear-method names against their
        # registries, which live with torch code; importing the module must not.
        "cfg = EngineConfig(dtype='float16')",
        "print(before, cfg.torch_dtype)",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "torch.float16"]


def test_apply_thread_settings_sets_the_process_pool_only_when_asked():
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.runtime.threads import apply_thread_settings

    before = torch.get_num_threads()
    try:
        assert apply_thread_settings(EngineConfig()) == before       # None: left as is
        assert apply_thread_settings(EngineConfig(num_threads=1)) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_engines_leave_the_process_thread_pool_alone():
    """Two engines in one process: neither resizes torch's thread pool."""
    import torch

    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.runtime.llm_engine import LLMEngine

    before = torch.get_num_threads()
    a = LLMEngine(EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=8)))
    LLMEngine(EngineConfig(dtype="float32", num_threads=before + 1,
                           cache=CacheConfig(num_blocks=8)), weights_from=a)
    assert torch.get_num_threads() == before
