"""The model registry: which architectures Tandem serves, found from the checkpoint.

vLLM's ``ModelRegistry`` is the model: an architecture name (the checkpoint's
``architectures[0]``, e.g. ``Qwen3ForCausalLM``) maps to the module and class that
implement it, imported only when a model of that kind is built. A Hugging Face
``config.json`` names its architecture in ``architectures`` (or only its
``model_type``); a GGUF file in ``general.architecture``. Both resolve here to one
registered name, which :class:`~tandem.engine.config.ModelConfig` carries as
``architecture`` and :func:`~tandem.engine.model.loader.load_model` builds.

This module imports no torch (the config layer uses it); the model classes are
imported by name on first use. A checkpoint that asks for something the registered
implementation does not do is refused with :class:`UnsupportedModelError`, which
names the config field: a model is never served wrongly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """A checkpoint Tandem does not serve correctly; ``field`` names the config field
    (``"sliding_window"``, ``"rope_parameters.rope_type"``, ...) that decides it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class RegisteredModel:
    """One architecture.

    Attributes:
        module: the module under ``tandem.engine.model`` that defines ``class_name``.
        class_name: the model class (its constructor takes ``(ModelConfig, linear_method)``).
        model_types: the Hugging Face ``model_type`` values of this architecture (a
            config without ``architectures`` is resolved through them).
        gguf_architectures: the GGUF ``general.architecture`` values whose tensors
            the GGUF reader maps to this class's names.
    """

    module: str
    class_name: str
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()


class ModelRegistry:
    """Architecture name -> :class:`RegisteredModel`; one process-wide instance,
    :data:`MODEL_REGISTRY`, fixed at import (no runtime registration: two engines in
    one process see the same set)."""

    def __init__(self, models: dict[str, RegisteredModel]):
        self._models = dict(models)

    @property
    def architectures(self) -> tuple[str, ...]:
        """The registered architecture names, sorted."""
        return tuple(sorted(self._models))

    def info(self, architecture: str) -> RegisteredModel:
        """Raises :class:`UnsupportedModelError` (field ``architectures``) for an
        unregistered name."""
        try:
            return self._models[architecture]
        except KeyError:
            raise UnsupportedModelError(
                "architectures", f"{architecture!r} is not supported; Tandem serves "
                f"{', '.join(self.architectures)}") from None

    def resolve_hf(self, hf_config: dict) -> str:
        """The registered architecture of a Hugging Face ``config.json`` (as a dict):
        the first of its ``architectures`` that is registered, else the one whose
        ``model_types`` holds its ``model_type``.

        Raises:
            UnsupportedModelError: ``architectures`` names only unregistered classes
                (field ``architectures``), or there is none and the ``model_type`` is
                unknown (field ``model_type``).
        """
        names = hf_config.get("architectures") or []
        for name in names:
            if name in self._models:
                return name
        if names:
            raise UnsupportedModelError(
                "architectures", f"{', '.join(map(repr, names))} not supported; Tandem serves "
                f"{', '.join(self.architectures)}")
        model_type = hf_config.get("model_type")
        for name, info in sorted(self._models.items()):
            if model_type in info.model_types:
                return name
        raise UnsupportedModelError(
            "model_type", f"{model_type!r} is not supported; Tandem serves model types "
            f"{', '.join(sorted(t for m in self._models.values() for t in m.model_types))}")

    def resolve_gguf(self, gguf_architecture: str | None) -> str:
        """The registered architecture of a GGUF file's ``general.architecture``.

        Raises:
            UnsupportedModelError: field ``general.architecture``.
        """
        for name, info in sorted(self._models.items()):
            if gguf_architecture in info.gguf_architectures:
                return name
        raise UnsupportedModelError(
            "general.architecture", f"GGUF architecture {gguf_architecture!r} is not "
            f"supported; Tandem reads GGUF "
            f"{', '.join(sorted(a for m in self._models.values() for a in m.gguf_architectures))}")

    def model_class(self, architecture: str) -> type:
        """Import and return the class implementing ``architecture`` (imports torch).

        Raises:
            UnsupportedModelError: an unregistered name.
        """
        info = self.info(architecture)
        module = importlib.import_module(f"tandem.engine.model.{info.module}")
        return getattr(module, info.class_name)


MODEL_REGISTRY = ModelRegistry({
    "LlamaForCausalLM": RegisteredModel("llama", "LlamaForCausalLM", ("llama",), ("llama",)),
    "MistralForCausalLM": RegisteredModel("llama", "MistralForCausalLM", ("mistral",)),
    "Qwen2ForCausalLM": RegisteredModel("qwen", "Qwen2ForCausalLM", ("qwen2",), ("qwen2",)),
    "Qwen3ForCausalLM": RegisteredModel("qwen", "Qwen3ForCausalLM", ("qwen3",), ("qwen3",)),
    "Gemma2ForCausalLM": RegisteredModel("gemma", "Gemma2ForCausalLM", ("gemma2",),
                                         ("gemma2",)),
    "Gemma3ForCausalLM": RegisteredModel("gemma", "Gemma3ForCausalLM", ("gemma3_text",),
                                         ("gemma3",)),
    "Phi3ForCausalLM": RegisteredModel("phi3", "Phi3ForCausalLM", ("phi3",), ("phi3",)),
    "MixtralForCausalLM": RegisteredModel("mixtral", "MixtralForCausalLM", ("mixtral",)),
    "Qwen2MoeForCausalLM": RegisteredModel("qwen_moe", "Qwen2MoeForCausalLM", ("qwen2_moe",),
                                           ("qwen2moe",)),
    "Qwen3MoeForCausalLM": RegisteredModel("qwen_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",),
                                           ("qwen3moe",)),
})
"""The architectures Tandem serves (docs/models.md has the table)."""
