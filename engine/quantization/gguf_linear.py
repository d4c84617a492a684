"""The ``gguf`` linear method: a GGUF file's quantized blocks kept packed in memory.

``EngineConfig.quantization="gguf"`` (``--quantization gguf``) on a ``.gguf`` model
loads each projection matrix as its file stores it: ``qweight`` uint8 ``[N,
row_bytes]`` (one row of ggml blocks per output feature) and
``qweight_type`` (the ggml type id), the layout vLLM's GGUF support also uses. The
matmul reads the blocks directly:

- CPU: :func:`tandem.kernels.cpu.gguf_linear.gguf_linear` (compiled; dequantizes in
  registers for decode-sized batches);
- CUDA: :func:`tandem.kernels.gguf_linear.gguf_linear` (a Triton dequant-GEMM).

The shards of a fused layer (q/k/v, gate/up) may be of different native types, as
in llama.cpp's ``_M`` mixes (``attn_v`` in more bits than ``attn_q``): their bytes
are then kept in one flat ``qweight`` and each shard is multiplied by its own
kernel, the outputs side by side (vLLM's GGUF layers do the same).

The token embedding is kept in its blocks as well (:class:`GGUFEmbedding`: a lookup
dequantizes only the rows it gathers), and a tied output projection multiplies by
those same blocks (no second copy).

Natively read types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q6_K (so a
llama.cpp ``Q4_K_M`` or ``Q6_K`` file, whose rows that are not whole 256-weight
super-blocks are Q5_0 / Q8_0, is read natively throughout). A layer with a
type without a kernel (Q2_K, Q3_K, Q5_K,
the IQ types, F16, ...), or a machine without the compiled kernels, is dequantized
once at load to a dense weight in the model's dtype (``gguf.quants.dequantize``)
and multiplied like an unquantized one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.linear import Linear, LinearMethodBase
from tandem.engine.model.weights import WeightLoadError
from tandem.kernels.cpu.gguf_linear import (GGUF_NATIVE_TYPES, gguf_dequantize,
                                            gguf_kernels_available, gguf_linear, row_bytes)

logger = logging.getLogger(__name__)


def _ggml_type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def dequantize_rows(qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """float32 ``[N, in_features]`` of GGUF rows of any ggml type (``gguf.quants``).

    Raises:
        WeightLoadError: the bytes do not hold ``N x in_features`` weights of ``qtype``.
    """
    from gguf.quants import dequantize

    data = qweight.cpu().numpy()
    try:
        w = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(qweight.shape[0],
                                                                       in_features)
    except (ValueError, NotImplementedError) as exc:
        raise WeightLoadError(f"cannot dequantize {_ggml_type_name(qtype)} rows of "
                              f"{qweight.shape[1]} bytes to {in_features} weights: {exc}") from exc
    return torch.from_numpy(w.copy())


class GGUFLinearMethod(LinearMethodBase):
    """GGUF blocks in memory, multiplied without a dense copy (see module doc).

    Parameters of a layer once processed: ``qweight`` uint8 ``[N, row_bytes]`` and
    ``qweight_type`` int64 ``[]`` when every shard has one type; for shards of
    different types, ``qweight`` uint8 ``[total bytes]`` (the shards' rows one after
    the other), ``qweight_type`` int64 ``[shards]``, and ``layer.shard_weights`` the
    ``(rows view, type)`` of each. While loading, each fused sub-matrix (shard) is
    kept apart.
    """

    name = "gguf"
    shard_units = (256, 32)     # whole K-quant super-blocks, else whole 32-weight blocks

    def create_weights(self, layer, in_features, output_sizes, params_dtype):
        _init_gguf_params(layer, params_dtype)
        layer.gguf_input_slice = None   # tensor parallelism: (full K, start, size)

    def load_weight(self, layer, param_name, loaded, shard_id):
        rows = layer.out_features if shard_id is None else layer.output_sizes[shard_id]
        _load_shard(layer, param_name, loaded, shard_id, rows)
        if layer.gguf_input_slice is not None:
            _narrow_input_blocks(layer, shard_id)

    def narrow_output(self, layer, param_name, loaded, full, start, size):
        """Whole rows of blocks (a row is one output feature); the type id as is."""
        if param_name == "qweight":
            from tandem.engine.model.linear import narrow_checked

            return narrow_checked(loaded, 0, full, start, size)
        return loaded

    def narrow_input(self, layer, param_name, loaded, full, start, size):
        """The rank's whole blocks along each row. A row's bytes are cut once its ggml
        type is known too (``qweight`` comes before ``qweight_type`` in the file's
        stream), so here the slice is only recorded.

        Raises:
            WeightLoadError: (at load) ``start`` or ``size`` not on a block boundary
                of the tensor's type (32 weights, 256 for the K-quants).
        """
        layer.gguf_input_slice = (full, start, size)
        return loaded

    def process_weights_after_loading(self, layer):
        if (layer.qtype is not None or layer.dense_weight is not None
                or layer.shard_weights is not None):
            return
        _pack_shards(layer, layer.shard_ids, layer.in_features)

    def supports_int8_activations(self, layer):
        return layer.dense_weight is None and layer.qweight.device.type == "cpu"

    def apply(self, layer, x):
        if layer.dense_weight is not None:
            return F.linear(x, layer.dense_weight)
        if layer.shard_weights is not None:
            return torch.cat([_matmul(x, q, t, layer.in_features, layer.batch_invariant,
                                      layer.int8_activations)
                              for q, t in layer.shard_weights], dim=-1)
        return _matmul(x, layer.qweight, layer.qtype, layer.in_features, layer.batch_invariant,
                       layer.int8_activations)


def _matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
            batch_invariant: bool, int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` for one native-typed ``qweight`` on x's device (CPU: int8 activation
    blocks for decode-sized products with ``int8_activations``)."""
    if x.device.type == "cuda":
        from tandem.kernels.gguf_linear import gguf_linear as triton_gguf_linear

        return triton_gguf_linear(x, qweight, qtype, in_features)
    activations = "int8" if int8_activations else "float"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return gguf_linear(x.float(), qweight, qtype, in_features,
                           activations=activations).to(x.dtype)
    return gguf_linear(x, qweight, qtype, in_features, fused_only=batch_invariant,
                       activations=activations)


def _narrow_input_blocks(layer: nn.Module, shard_id: int | None) -> None:
    """Cut a loaded shard's rows to the rank's input columns
    (``layer.gguf_input_slice``) once its bytes and its type are both in."""
    if shard_id not in layer.gguf_shards or shard_id not in layer.gguf_shard_types:
        return
    full, start, size = layer.gguf_input_slice
    rows, qtype = layer.gguf_shards[shard_id], layer.gguf_shard_types[shard_id]
    if size == full:
        return
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if full % block or start % block or size % block:
        raise WeightLoadError(f"tensor_parallel_size: input columns [{start}, {start + size}) "
                              f"of {full} do not fall on whole {block}-weight "
                              f"{_ggml_type_name(qtype)} blocks")
    if rows.shape[1] != full // block * nbytes:
        return      # already cut (this shard's second tensor came after the cut)
    layer.gguf_shards[shard_id] = rows[:, start // block * nbytes:
                                       (start + size) // block * nbytes].contiguous()


def _pack_shards(layer: nn.Module, ids, in_features: int) -> None:
    """Turn the loaded shards of ``layer`` into one ``qweight`` (native types) or one
    ``dense_weight`` (the fallback); see :class:`GGUFLinearMethod`."""
    if set(layer.gguf_shards) != set(ids) or set(layer.gguf_shard_types) != set(ids):
        raise WeightLoadError(f"GGUF layer: shards {sorted(layer.gguf_shards, key=str)} "
                              f"loaded, expected {list(ids)}")
    device = layer.qweight.device
    types = {layer.gguf_shard_types[i] for i in ids}
    native = (all(t in GGUF_NATIVE_TYPES for t in types)
              and (device.type == "cuda" or (device.type == "cpu"
                                             and gguf_kernels_available())))
    if native and getattr(layer, "batch_invariant", False) and device.type != "cpu":
        raise ValueError("batch_invariant: the batch-invariant GGUF kernel runs on the "
                         f"CPU only, not on {device}")
    if native:
        for i in ids:
            qtype = layer.gguf_shard_types[i]
            try:
                width = row_bytes(qtype, in_features)
            except ValueError as exc:
                raise WeightLoadError(f"qweight: {exc}") from None
            if layer.gguf_shards[i].shape[1] != width:
                raise WeightLoadError(
                    f"qweight: rows of {layer.gguf_shards[i].shape[1]} bytes do not hold "
                    f"{in_features} {_ggml_type_name(qtype)} weights ({width} bytes)")
        shards = [layer.gguf_shards[i] for i in ids]
        if len(types) == 1:
            # One shard is used as is: a tied output projection shares the embedding's.
            qtype = next(iter(types))
            packed = (shards[0] if len(shards) == 1 else torch.cat(shards)).to(device)
            qweight_type = torch.tensor(qtype, dtype=torch.int64, device=device)
            layer.qtype = qtype
        else:
            packed = torch.cat([s.reshape(-1) for s in shards]).to(device)
            qweight_type = torch.tensor([layer.gguf_shard_types[i] for i in ids],
                                        dtype=torch.int64, device=device)
            layer.shard_weights, start = [], 0
            for i, s in zip(ids, shards):
                view = packed[start:start + s.numel()].view(s.shape)
                layer.shard_weights.append((view, layer.gguf_shard_types[i]))
                start += s.numel()
        layer.qweight = nn.Parameter(packed, requires_grad=False)
        layer.qweight_type = nn.Parameter(qweight_type, requires_grad=False)
    else:
        logger.debug("GGUF layer with types %s: dequantized to a dense weight",
                     sorted(_ggml_type_name(t) for t in types))
        if getattr(layer, "batch_invariant", False):
            raise ValueError("batch_invariant: a GGUF layer of types "
                             f"{sorted(_ggml_type_name(t) for t in types)} has no "
                             "batch-invariant kernel")
        dense = torch.cat([dequantize_rows(layer.gguf_shards[i], layer.gguf_shard_types[i],
                                           in_features) for i in ids])
        layer.dense_weight = dense.to(device=device, dtype=layer.params_dtype)
        del layer.qweight, layer.qweight_type
    layer.gguf_shards, layer.gguf_shard_types = {}, {}


def _load_shard(layer: nn.Module, param_name: str, loaded: torch.Tensor,
                shard_id: int | None, rows: int) -> None:
    """Keep one loaded GGUF tensor of ``layer`` (``qweight`` rows or ``qweight_type``)."""
    if param_name == "qweight":
        if loaded.dtype != torch.uint8 or loaded.dim() != 2 or loaded.shape[0] != rows:
            raise WeightLoadError(f"qweight: expected uint8 [{rows}, bytes], got "
                                  f"{tuple(loaded.shape)} {loaded.dtype}")
        layer.gguf_shards[shard_id] = loaded.contiguous()
    elif param_name == "qweight_type":
        if loaded.numel() != 1:
            raise WeightLoadError(f"qweight_type: expected one ggml type id, got "
                                  f"{tuple(loaded.shape)}")
        layer.gguf_shard_types[shard_id] = int(loaded.reshape(()).item())
    else:
        raise WeightLoadError(f"a GGUF layer stores no {param_name!r} "
                              "(it expects qweight and qweight_type)")


def _init_gguf_params(layer: nn.Module, params_dtype: torch.dtype) -> None:
    # Placeholders: the packed width depends on the ggml type, known at load.
    layer.register_parameter("qweight", nn.Parameter(torch.empty(0, dtype=torch.uint8),
                                                     requires_grad=False))
    layer.register_parameter("qweight_type", nn.Parameter(torch.empty(0, dtype=torch.int64),
                                                          requires_grad=False))
    layer.params_dtype = params_dtype
    layer.gguf_shards = {}        # shard id -> uint8 rows
    layer.gguf_shard_types = {}   # shard id -> ggml type id
    layer.qtype = None            # set once processed: the type the kernel reads
    layer.shard_weights = None    # set once processed, for shards of mixed types
    layer.dense_weight = None     # set once processed: the fallback's weight


class GGUFEmbedding(nn.Module):
    """Token embedding whose table stays in GGUF blocks (``qweight`` uint8
    ``[V, row_bytes]``): a lookup gathers the rows of the ids and dequantizes only those.

    Args:
        num_embeddings: ``V``; embedding_dim: ``H`` (a multiple of 32 for a native type).
        params_dtype: dtype of the looked-up vectors.

    Shapes: ``input_ids`` ``[T]`` int64 -> ``[T, H]`` in ``params_dtype``. A type
    without a kernel is dequantized once at load to a dense table (as linear layers).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        _init_gguf_params(self, params_dtype or torch.get_default_dtype())

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """See :meth:`LinearMethodBase.load_weight` (raises :class:`WeightLoadError`)."""
        load_gguf_table(self, param_name, loaded, self.num_embeddings)

    def process_weights_after_loading(self) -> None:
        """Pack the loaded table (idempotent)."""
        pack_gguf_table(self, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gguf_table_lookup(self, input_ids, self.embedding_dim)

    def share_with(self, layer: Linear) -> None:
        """Give the tied output projection ``layer`` (a GGUF :class:`Linear` of shape
        ``[V, H]``) this table's loaded blocks, before either is processed: both then
        read the same tensor."""
        share_gguf_table(self, layer)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


# The table functions below serve GGUFEmbedding and the vocabulary-parallel embedding
# (tandem.engine.parallel.layers), each a module that _init_gguf_params set up.

def load_gguf_table(module: nn.Module, param_name: str, loaded: torch.Tensor,
                    rows: int) -> None:
    """Keep a loaded ``qweight`` (``rows`` rows) or ``qweight_type`` of an embedding
    table (raises :class:`WeightLoadError` on a mismatch)."""
    _load_shard(module, param_name, loaded, None, rows)


def init_gguf_table(module: nn.Module, params_dtype: torch.dtype) -> None:
    """Register on ``module`` the GGUF table's ``qweight`` / ``qweight_type``."""
    _init_gguf_params(module, params_dtype)


def pack_gguf_table(module: nn.Module, embedding_dim: int) -> None:
    """Pack ``module``'s loaded table (idempotent)."""
    if module.qtype is None and module.dense_weight is None and module.shard_weights is None:
        _pack_shards(module, (None,), embedding_dim)


def gguf_table_lookup(module: nn.Module, input_ids: torch.Tensor,
                      embedding_dim: int) -> torch.Tensor:
    """``[T]`` ids -> ``[T, embedding_dim]`` rows of ``module``'s packed table,
    dequantizing only those rows."""
    if module.dense_weight is not None:
        return F.embedding(input_ids, module.dense_weight)
    rows = module.qweight.index_select(0, input_ids)            # [T, row_bytes]
    if rows.device.type == "cpu":
        out = gguf_dequantize(rows, module.qtype, embedding_dim)
    else:
        from tandem.kernels.reference import dequantize_gguf_reference

        out = dequantize_gguf_reference(rows, module.qtype, embedding_dim)
    return out.to(module.params_dtype)


def share_gguf_table(module: nn.Module, layer: Linear) -> None:
    """Give the tied output projection ``layer`` ``module``'s loaded blocks, before
    either is processed: both then read the same tensor."""
    layer.gguf_shards = dict(module.gguf_shards)
    layer.gguf_shard_types = dict(module.gguf_shard_types)
