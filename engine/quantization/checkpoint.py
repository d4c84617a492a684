"""Which linear method a checkpoint needs: quantized checkpoints say so in their
config, and the engine follows them (as vLLM does)."""

from __future__ import annotations

import json
import os
from typing import Callable

from tandem.engine.model.linear import LinearMethodBase
from tandem.engine.model.model_files import ModelFiles
from tandem.engine.quantization.registry import get_linear_method


def _gptq(config: dict) -> LinearMethodBase:
    from tandem.engine.quantization.gptq_linear import GPTQLinearMethod
    return GPTQLinearMethod.from_config(config)


def _awq(config: dict) -> LinearMethodBase:
    from tandem.engine.quantization.awq_linear import AWQLinearMethod
    return AWQLinearMethod.from_config(config)


# quantization_config.quant_method -> the linear method built from that config.
CHECKPOINT_METHODS: dict[str, Callable[[dict], LinearMethodBase]] = {
    "gptq": _gptq,
    "awq": _awq,
}


def checkpoint_quantization_config(files: ModelFiles) -> dict | None:
    """A checkpoint directory's quantization config: ``config.json``'s
    ``quantization_config``, else an AutoGPTQ ``quantize_config.json`` (whose
    ``quant_method`` defaults to ``gptq``); None for a dense checkpoint or a GGUF file.

    Raises:
        ValueError: ``quantization_config`` is not a JSON object.
    """
    if files.format != "hf":
        return None
    with open(os.path.join(files.path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    if qc is None:
        legacy = os.path.join(files.path, "quantize_config.json")
        if not os.path.isfile(legacy):
            return None
        with open(legacy) as f:
            qc = {"quant_method": "gptq", **json.load(f)}
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: expected an object in {files.path}/config.json, "
                         f"got {type(qc).__name__}")
    return qc


def linear_method_for(files: ModelFiles, quantization: str) -> LinearMethodBase:
    """The linear method to load ``files`` with, given ``EngineConfig.quantization``.

    A checkpoint with a ``quantization_config`` is loaded with its own method when
    ``quantization`` is ``none`` (the default) or names that method; otherwise
    :func:`~tandem.engine.quantization.registry.get_linear_method` decides.

    Raises:
        ValueError: (naming ``quantization``) a method other than the checkpoint's
            was asked for; the checkpoint's ``quant_method`` is not served; a
            checkpoint-only method (``gptq``) was asked for a model that is not
            quantized with it; an unknown name; a bad ``quantization_config`` field.
    """
    qc = checkpoint_quantization_config(files)
    if qc is None:
        if quantization in CHECKPOINT_METHODS:
            raise ValueError(f"quantization: {quantization!r} loads checkpoints quantized with "
                             f"it (config.json quantization_config.quant_method "
                             f"{quantization!r}); {files.path} has no quantization_config")
        return get_linear_method(quantization)
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization: {files.path} is quantized with quant_method "
                         f"{method!r}, which is not served (served: "
                         f"{', '.join(CHECKPOINT_METHODS)})")
    if quantization not in ("none", method):
        raise ValueError(f"quantization: {quantization!r} was asked for, but {files.path} is "
                         f"quantized with {method!r} (config.json quantization_config); leave "
                         f"quantization at 'none' or set it to {method!r}")
    return CHECKPOINT_METHODS[method](qc)
