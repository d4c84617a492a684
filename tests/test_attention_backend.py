"""The attention-backend registry, and the kernels package standing on its own."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import tandem.kernels
from tandem.engine.config import EngineConfig
from tandem.kernels.attention_backend import TorchAttentionBackend
from tandem.kernels.registry import ATTENTION_BACKENDS, attention_backend_names, get_attention_backend


def test_registry_names_and_unknown_name():
    assert attention_backend_names() == ["auto", "torch", "cpu", "triton"]
    assert list(ATTENTION_BACKENDS) == attention_backend_names()
    backend = get_attention_backend("torch", torch.device("cpu"), torch.float32)
    assert type(backend) is TorchAttentionBackend and backend.name == "torch"
    assert get_attention_backend("auto", torch.device("cpu"), torch.float16).name == "torch"
    msg = r"^attention_backend: unknown 'flash', expected one of auto, torch, cpu, triton$"
    with pytest.raises(ValueError, match=msg):
        get_attention_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match=msg):
        EngineConfig(attention_backend="flash")


def test_kernels_never_import_the_engine():
    """Neither at module level nor inside functions: the engine depends on the
    kernels, never the reverse."""
    root = pathlib.Path(tandem.kernels.__path__[0])   # a namespace package: no __file__
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                          if n == "tandem.engine" or n.startswith("tandem.engine.")]
    assert offenders == []
    code = ("import sys, tandem.kernels.attention_backend, tandem.kernels.backend, "
            "tandem.kernels.cpu.backend, tandem.kernels.cpu.linear, tandem.kernels.reference; "
            "print(sorted(m for m in sys.modules if m.startswith('tandem.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
