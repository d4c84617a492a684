"""Weight loading: GGUF (dequantized with the ``gguf`` package) and safetensors.

Both formats are first turned into Hugging Face parameter names (the names the
model's parameters carry), then loaded through one declared mapping that is
strict: a tensor the model does not know, or a parameter that no tensor fills,
raises :class:`WeightLoadError`. Each tensor is copied in by the module that owns
its parameter, so a linear layer's method (:mod:`tandem.engine.model.linear`) decides
how its format's tensors are laid out.
"""

from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:   # config imports the linear methods, which import this module
    from tandem.engine.config import ModelConfig


class WeightLoadError(ValueError):
    """The checkpoint does not match the model (unknown, missing or misshapen tensors)."""


# GGUF tensor name -> Hugging Face name; {i} is the layer index. The names are
# llama.cpp's (gguf-py's MODEL_TENSOR names, as convert_hf_to_gguf.py writes them).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Per GGUF architecture, the names it adds or whose Hugging Face counterpart
# differs: per-head Q/K norms (Qwen3, Gemma 3), Gemma's sandwich norms (its
# ``ffn_norm`` is the pre-feed-forward norm), Phi-3's fused projections
# (``attn_qkv``; ``ffn_up`` holds gate and up stacked, as ``gate_up_proj``), the
# MoE routers (``ffn_gate_inp``) and Qwen2-MoE's shared expert.
_QK_NORMS = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
_GGUF_TO_HF_ARCH = {
    "qwen3": _QK_NORMS,
    "gemma2": {
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    "phi3": {
        "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
        "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
    },
}
_GGUF_TO_HF_ARCH["gemma3"] = _GGUF_TO_HF_ARCH["gemma2"] | _QK_NORMS
_SHARED_EXPERT = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
_GGUF_TO_HF_ARCH["qwen2moe"] = _SHARED_EXPERT
_GGUF_TO_HF_ARCH["qwen3moe"] = _QK_NORMS | {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight"}
_GGUF_TO_HF["blk.{i}.ffn_gate_inp.weight"] = "model.layers.{i}.block_sparse_moe.gate.weight"
# Stacked expert tensors ``[E, out, in]`` -> one Hugging Face tensor per expert:
# GGUF architecture -> (block, {gguf projection: checkpoint projection}).
_EXPERT_NAMES = {
    "llama": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),     # Mixtral
    "qwen2moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
_EXPERT_NAMES["qwen3moe"] = _EXPERT_NAMES["qwen2moe"]
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
# Tensors that are config, not weights (read by ModelConfig.from_gguf_fields).
GGUF_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight",
                       "rope_freqs.weight")


def _patterns(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v)
            for k, v in table.items()]


_GGUF_PATTERNS = _patterns(_GGUF_TO_HF)
_GGUF_ARCH_PATTERNS = {arch: _patterns(t) + _GGUF_PATTERNS for arch, t in _GGUF_TO_HF_ARCH.items()}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str:
    """Map one GGUF tensor name to its Hugging Face name, for a file of GGUF
    architecture ``arch`` (``general.architecture``).

    Raises:
        WeightLoadError: a name outside the architecture's mapping.
    """
    for pattern, hf in _GGUF_ARCH_PATTERNS.get(arch, _GGUF_PATTERNS):
        m = pattern.match(name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    raise WeightLoadError(f"unknown GGUF tensor {name!r}")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k (weights and biases).

    llama.cpp's converter reorders each head's rows from the half-split rotary
    layout (Hugging Face / NeoX) to the interleaved one (GPT-J) for ``llama``
    files only; our rotary embedding is half-split, so the rows go back. ``w``:
    ``[n_head * D, H]`` or ``[n_head * D]``.
    """
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str):
    """Open a GGUF file. Returns ``(fields, reader)``: fields as plain python values."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {}
    for key, f in reader.fields.items():
        try:
            fields[key] = f.contents()
        except Exception as exc:  # a field type the reader cannot decode: keep the key visible
            raise WeightLoadError(f"cannot decode GGUF field {key!r}: {exc}") from exc
    return fields, reader


# Leaf modules whose weights a quantized linear method may keep in the file's blocks.
LINEAR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj")
# GGUF architectures whose projections (and experts) ``native`` keeps in their blocks.
NATIVE_GGUF_ARCHITECTURES = ("llama", "qwen2moe", "qwen3moe")


def iter_gguf_tensors(reader, config: ModelConfig,
                      native: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of a GGUF file.

    Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized to float32
    with ``gguf.quants.dequantize``, exactly as the Hugging Face GGUF loader does.
    Names follow the file's ``general.architecture`` (:func:`gguf_name_to_hf`); the
    converter's layouts are undone: Q/K rows (and biases) un-permuted for ``llama``
    files, Gemma's ``1 + w`` norm weights shifted back to ``w``. The tensors that are
    config (:data:`GGUF_CONFIG_TENSORS`) are skipped.

    Args:
        native: keep the projection matrices (:data:`LINEAR_PROJECTIONS`), the token
            embedding and the output projection as the file stores them, for the ``gguf`` linear method: ``<proj>.qweight`` uint8
            ``[N, row_bytes]`` (the rows of ggml blocks, whatever the type) and
            ``<proj>.qweight_type`` int64 ``[]`` (the ggml type id). Stacked expert
            tensors ``ffn_{gate,up,down}_exps`` (``[E, N, row_bytes]``) give each
            expert's rows the same way (``...experts.{e}.<proj>.qweight``). Other
            tensors (biases, norms, routers) are dequantized as above.

    Raises:
        WeightLoadError: a tensor name outside the architecture's mapping.
        UnsupportedModelError: ``native`` on a file whose architecture is not in
            :data:`NATIVE_GGUF_ARCHITECTURES` (field ``quantization``).
    """
    from gguf.quants import dequantize

    from tandem.engine.model.gguf_config import (NORM_PLUS_ONE_ARCHITECTURES,
                                                 PERMUTED_QK_ARCHITECTURES)

    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "llama"
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    if native and arch not in NATIVE_GGUF_ARCHITECTURES:
        from tandem.engine.model.registry import UnsupportedModelError

        raise UnsupportedModelError("quantization", f"keeping GGUF blocks ('gguf') is "
                                    f"implemented for {', '.join(NATIVE_GGUF_ARCHITECTURES)} "
                                    f"files, not {arch!r}")
    for t in reader.tensors:
        if t.name in GGUF_CONFIG_TENSORS:
            continue
        experts = _EXPERTS.match(t.name)
        if experts and arch in _EXPERT_NAMES:
            block, projs = _EXPERT_NAMES[arch]
            if native:      # [E, N, row_bytes]: expert e's rows of blocks
                num_experts = int(t.shape.tolist()[-1])
                raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(num_experts,
                                                                         int(t.shape[1]), -1)
                for e in range(num_experts):
                    name = f"model.layers.{experts[1]}.{block}.experts.{e}.{projs[experts[2]]}"
                    yield name + ".qweight", torch.from_numpy(np.array(raw[e], copy=True))
                    yield name + ".qweight_type", torch.tensor(int(t.tensor_type),
                                                               dtype=torch.int64)
                continue
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
            for e in range(w.shape[0]):
                yield (f"model.layers.{experts[1]}.{block}.experts.{e}."
                       f"{projs[experts[2]]}.weight", torch.from_numpy(np.array(w[e])))
            continue
        hf_name = gguf_name_to_hf(t.name, arch)
        module = hf_name.rpartition(".")[0]
        if native and hf_name.endswith(".weight") and (
                module.rpartition(".")[2] in LINEAR_PROJECTIONS
                or module in ("model.embed_tokens", "lm_head")):
            rows = int(t.shape.tolist()[-1]) if len(t.shape) > 1 else 1
            raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)
            if permuted and hf_name.endswith("q_proj.weight"):
                raw = _unpermute_rows(raw, config.num_heads)
            elif permuted and hf_name.endswith("k_proj.weight"):
                raw = _unpermute_rows(raw, config.num_kv_heads)
            yield module + ".qweight", torch.from_numpy(np.array(raw, order="C", copy=True))
            yield module + ".qweight_type", torch.tensor(int(t.tensor_type), dtype=torch.int64)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first; numpy data is already row-major [out, in].
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = w.reshape(shape)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rows(w, config.num_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rows(w, config.num_kv_heads)
        elif arch in NORM_PLUS_ONE_ARCHITECTURES and hf_name.endswith("norm.weight"):
            # stored as 1 + w (the converter adds 1 in float32); the model's (1 + w)
            # norms add the 1 back at load, giving the stored value again
            w = w - np.float32(1.0)
        yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file of a checkpoint dir.

    Raises:
        WeightLoadError: the directory has no safetensors file.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """``target.copy_(loaded)`` in ``target``'s dtype, when the shapes are equal.

    Raises:
        WeightLoadError: the shapes differ.
    """
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)} != "
                              f"model shape {tuple(target.shape)}")
    target.copy_(loaded.to(target.dtype))


def load_weights(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (Hugging Face names) into ``model``, strictly.

    The model declares where each checkpoint tensor goes through
    ``model.weight_mapping(name) -> (param_name, shard_id)``: ``shard_id`` is None
    (the tensor fills the whole parameter) or the index of the sub-matrix it
    holds in a fused layer (``q_proj`` is shard 0 of ``qkv_proj``). The module
    owning the parameter copies the tensor in: through its
    ``load_weight(leaf_name, tensor, shard_id)`` where it has one (a
    :class:`~tandem.engine.model.linear.Linear`, whose method knows its format), else
    as one whole-tensor copy. A fused parameter is complete once each of its
    module's ``shard_ids`` is loaded. ``model.tied_parameters`` (``{name: source
    name}``) are not loaded: they become the very parameter they are tied to.
    Names in ``model.ignored_checkpoint_names`` are skipped.

    Raises:
        WeightLoadError: unknown tensor, wrong shape, a tensor loaded twice, or
            parameters left unfilled.
    """
    tied: dict[str, str] = getattr(model, "tied_parameters", {})
    params = {name: p for name, p in model.named_parameters() if name not in tied}
    filled: dict[str, set[int | None]] = {name: set() for name in params}
    ignored = getattr(model, "ignored_checkpoint_names", ())
    for name, tensor in tensors:
        if name in ignored or name.endswith("rotary_emb.inv_freq"):
            continue
        mapped = model.weight_mapping(name)
        if mapped is None or mapped[0] not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no place in the model")
        pname, shard_id = mapped
        if shard_id in filled[pname]:
            raise WeightLoadError(f"checkpoint tensor {name!r} loaded twice into {pname}")
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name)
        try:
            if hasattr(module, "load_weight"):
                module.load_weight(leaf, tensor, shard_id)
            else:
                copy_checked(params[pname].data, tensor)
        except WeightLoadError as exc:
            raise WeightLoadError(f"{name}: {exc} ({pname})") from None
        filled[pname].add(shard_id)
    for pname, source in tied.items():
        # Building on `meta` and materialising with to_empty() unties parameters.
        module_name, _, leaf = pname.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, params[source])
    missing = [n for n, shards in filled.items()
               if shards != {None} and shards != set(_shard_ids(model, n))]
    if missing:
        raise WeightLoadError(f"parameters not (fully) filled by the checkpoint: {missing[:8]}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _shard_ids(model: torch.nn.Module, param_name: str) -> tuple[int | None, ...]:
    module = model.get_submodule(param_name.rpartition(".")[0])
    return getattr(module, "shard_ids", (None,))
