"""Building a model from its files: the registered architecture's class, filled
strictly from a GGUF file or a Hugging Face checkpoint directory.

The architecture comes from the checkpoint (:mod:`tandem.engine.model.registry`);
every architecture loads through the same steps: build on ``meta``, materialise,
copy the tensors in through the model's declared name mapping, let each linear
layer's method re-lay its weights out, build the RoPE table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.model.linear import process_weights_after_loading
from tandem.engine.model.registry import MODEL_REGISTRY
from tandem.engine.quantization.checkpoint import linear_method_for
from tandem.engine.runtime.huge_pages import HugePagesForNewMemory

if TYPE_CHECKING:
    from tandem.engine.parallel.communicator import Communicator

logger = logging.getLogger(__name__)

_DEQUANTIZED_CACHE_FORMAT = "4"   # bump when iter_gguf_tensors' output changes


def gguf_checkpoint(files, native: bool = False
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """A GGUF model's config and its ``(hf_name, tensor)`` pairs
    (:func:`~tandem.engine.model.weights.iter_gguf_tensors`), converted once per file:
    dequantized to float32, or with ``native`` the projections' blocks as stored
    (``qweight`` / ``qweight_type``, for the ``gguf`` linear method).

    Opening a GGUF file parses every metadata field (the tokenizer's vocabulary and
    merges element by element: seconds) and dequantizing takes seconds more, every
    worker start. The first load saves the dequantized tensors and the config as one
    safetensors file in the model-file cache
    (:func:`~tandem.engine.model.model_files.derived_path`: keyed by the file's path,
    size, mtime and the ``gguf`` version); later loads read that file (under a
    second). The write is atomic; a cache that cannot be written is skipped.

    Raises:
        UnsupportedModelError: an architecture or feature not served (see
            :meth:`ModelConfig.from_gguf_fields`).
        ValueError: a required GGUF key missing.
        WeightLoadError: an unknown tensor name.
    """
    from importlib.metadata import version

    from tandem.engine.model import weights

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.engine.model.model_files import derived_path, publish

    target = derived_path(files, "weights-native" if native else "weights", version("gguf"),
                          _DEQUANTIZED_CACHE_FORMAT)
    if target is not None:
        target += ".safetensors"
        if os.path.isfile(target):
            with safe_open(target, framework="pt") as f:
                cfg = ModelConfig(**json.loads(f.metadata()["model_config"]))

            def cached() -> Iterator[tuple[str, torch.Tensor]]:
                with safe_open(target, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            return cfg, cached()
    cfg, reader = _gguf_config(files.path)
    if target is None:
        return cfg, weights.iter_gguf_tensors(reader, cfg, native)
    tensors = dict(weights.iter_gguf_tensors(reader, cfg, native))
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        os.close(fd)
        save_file(tensors, tmp, metadata={"model_config": json.dumps(dataclasses.asdict(cfg))})
        publish(tmp, target)
    except OSError as exc:
        logger.debug("dequantized weight cache %s not written: %s", target, exc)
    return cfg, iter(tensors.items())


def _gguf_config(path: str):
    """A GGUF file's ModelConfig and its open reader (the metadata parsed: seconds)."""
    from tandem.engine.model import weights

    fields, reader = weights.read_gguf(path)
    names = tuple(t.name for t in reader.tensors)
    rope_factors = {t.name: [float(x) for x in t.data] for t in reader.tensors
                    if t.name in weights.GGUF_CONFIG_TENSORS}
    return ModelConfig.from_gguf_fields(fields, "output.weight" in names, names, rope_factors), reader


def checkpoint_config(files) -> ModelConfig:
    """A checkpoint's :class:`ModelConfig` without its weights: ``config.json``, or
    a GGUF file's metadata (parsed whole: about 2 s for the default model).

    Raises:
        UnsupportedModelError, ValueError: as :meth:`ModelConfig.from_hf_config` and
            :meth:`ModelConfig.from_gguf_fields`.
    """
    if files.format == "gguf":
        return _gguf_config(files.path)[0]
    return ModelConfig.from_hf_config(files.path)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every ``meta`` parameter and buffer of ``model`` uninitialised storage on
    ``device``, floating-point ones directly in ``dtype`` (what ``to_empty(device)``
    then ``.to(dtype)`` gives, without allocating and converting float32 copies
    first, and without ``to_empty``'s per-tensor meta-stride bookkeeping: together
    ~0.3 s of a worker's start on the default model)."""
    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                           device=device)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(fresh(p), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = fresh(b)


def load_model(files, dtype: torch.dtype, device: torch.device, quantization: str = "none",
               batch_invariant: bool = False, activation_quantization: str = "none",
               comm: "Communicator | None" = None,
               enable_expert_parallel: bool = False,
               small_batch_linear: bool | None = False) -> tuple[nn.Module, ModelConfig]:
    """Build the model from a GGUF file or a Hugging Face checkpoint directory.

    The class is the registered one of the checkpoint's architecture
    (``ModelConfig.architecture``, :data:`~tandem.engine.model.registry.MODEL_REGISTRY`).

    The module is created on the ``meta`` device (no random init), materialised on
    ``device`` in ``dtype``, filled strictly from the checkpoint, and then each
    linear layer's method prepares its weights for its kernel. On the CPU the
    memory the weights took is then backed by transparent huge pages
    (:class:`~tandem.engine.runtime.huge_pages.HugePagesForNewMemory`).

    Args:
        files: a resolved :class:`~tandem.engine.model.model_files.ModelFiles`.
        dtype: weights and activations dtype.
        device: where the weights live.
        quantization: the linear method's config string (``EngineConfig.quantization``);
            a checkpoint with a ``quantization_config`` (GPTQ) brings its own method
            when this is ``none`` (:func:`~tandem.engine.quantization.checkpoint.linear_method_for`).
        batch_invariant: batch-invariant linear kernels (``EngineConfig.batch_invariant``).
        activation_quantization: ``EngineConfig.activation_quantization``.
        comm: tensor parallelism: build this rank's shard of the model (each layer
            takes its slice of the full checkpoint tensors as they stream by, so a
            rank holds only its shard); None: the whole model.
        enable_expert_parallel: with ``comm``, a mixture-of-experts model's experts
            spread whole over the ranks instead of each split
            (``EngineConfig.enable_expert_parallel``); ignored for dense models (a
            warning says so).
        small_batch_linear: ``EngineConfig.small_batch_linear`` (see
            :func:`~tandem.engine.model.linear.process_weights_after_loading`).

    Returns:
        ``(model, config)``; the model is in eval mode with its RoPE table built.

    Raises:
        UnsupportedModelError: an architecture, or a config field's feature, that
            Tandem does not serve (the error names the field).
        ValueError: unknown ``quantization``, or one the checkpoint is not quantized
            with; ``batch_invariant`` off the CPU; ``activation_quantization`` int8
            for a model without quantized blocks.
        WeightLoadError: the checkpoint does not match the architecture.
        NotImplementedError: ``comm`` for an architecture or a quantization that
            does not shard yet (the message names ``tensor_parallel_size``).
    """
    from tandem.engine.model import weights

    if quantization == "gguf" and files.format != "gguf":
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's blocks, but the model "
                         f"{files.path} is a {files.format} checkpoint")
    if files.format == "gguf":
        cfg, tensors = gguf_checkpoint(files, native=quantization == "gguf")
    else:
        cfg = ModelConfig.from_hf_config(files.path)
        tensors = weights.iter_safetensors(files.path)
    linear_method = linear_method_for(files, quantization)
    cls = MODEL_REGISTRY.model_class(cfg.architecture)
    with torch.device("meta"):
        kwargs = {} if comm is None else {"comm": comm}
        if comm is not None and cfg.moe is not None:
            kwargs["enable_expert_parallel"] = enable_expert_parallel
        elif enable_expert_parallel and cfg.moe is None:
            logger.warning("enable_expert_parallel: %s (%s) has no experts; its layers are "
                           "split as tensor_parallel_size says, the flag changes nothing",
                           files.path, cfg.architecture)
        model = cls(cfg, linear_method, **kwargs)
    # On the CPU the weights end in huge pages (a decode step reads all of them).
    on_cpu = torch.device(device).type == "cpu"
    with HugePagesForNewMemory() if on_cpu else contextlib.nullcontext():
        _materialize(model, device, dtype)
        for module in model.modules():
            # Packed layers hold no float parameter for .to(dtype) to convert: tell
            # them the dtype their outputs (and any dense fallback) take.
            if hasattr(module, "params_dtype"):
                module.params_dtype = dtype
        weights.load_weights(model, tensors)
        if cfg.tie_word_embeddings and hasattr(model.model.embed_tokens, "share_with"):
            model.model.embed_tokens.share_with(model.lm_head)
        process_weights_after_loading(model, batch_invariant, activation_quantization,
                                      small_batch_linear)
    model.init_rope(device)
    model.eval()
    return model, cfg
