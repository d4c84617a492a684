"""The ``gguf`` linear method: a GGUF file's quantized blocks kept packed in memory.

``EngineConfig.quantization="gguf"`` (``--quantization gguf``) on a ``.gguf`` model
loads each projection matrix as its file stores it: ``qweight`` uint8 ``[N,
row_bytes]`` (one row of ``K / 32`` ggml blocks per output feature) and
``qweight_type`` (the ggml type id), the layout vLLM's GGUF support also uses. The
matmul reads the blocks directly:

- CPU: :func:`tandem.kernels.cpu.gguf_linear.gguf_linear` (compiled; dequantizes in
  registers for decode-sized batches);
- CUDA: :func:`tandem.kernels.gguf_linear.gguf_linear` (a Triton dequant-GEMM).

Natively read types: Q4_0, Q4_1, Q8_0. A layer whose fused sub-matrices have
different types, or a type without a kernel (the K-quants, F16, ...), or a machine
without the compiled kernels, is dequantized once at load to a dense weight in the
model's dtype (``gguf.quants.dequantize``) and multiplied like an unquantized one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.linear import Linear, LinearMethodBase
from tandem.engine.model.weights import WeightLoadError
from tandem.kernels.cpu.gguf_linear import GGUF_NATIVE_TYPES, gguf_kernels_available, row_bytes

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

    Parameters of a layer: ``qweight`` uint8 ``[N, row_bytes]`` and ``qweight_type``
    int64 ``[]`` once processed; while loading, each fused sub-matrix (shard) is kept
    apart, since the shards of one layer may have different ggml types.
    """

    name = "gguf"

    def create_weights(self, layer, in_features, output_sizes, params_dtype):
        # Placeholders: the packed width depends on the ggml type, known at load.
        layer.register_parameter("qweight", nn.Parameter(torch.empty(0, dtype=torch.uint8),
                                                         requires_grad=False))
        layer.register_parameter("qweight_type", nn.Parameter(
            torch.empty(0, dtype=torch.int64), requires_grad=False))
        layer.params_dtype = params_dtype
        layer.gguf_shards = {}        # shard id -> uint8 rows
        layer.gguf_shard_types = {}   # shard id -> ggml type id
        layer.qtype = None            # set once processed: the type the kernel reads
        layer.dense_weight = None     # set once processed: the fallback's weight

    def load_weight(self, layer, param_name, loaded, shard_id):
        rows = layer.out_features if shard_id is None else layer.output_sizes[shard_id]
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
            raise WeightLoadError(f"a GGUF linear layer stores no {param_name!r} "
                                  "(it expects qweight and qweight_type)")

    def process_weights_after_loading(self, layer):
        if layer.qtype is not None or layer.dense_weight is not None:
            return
        ids = layer.shard_ids
        if set(layer.gguf_shards) != set(ids) or set(layer.gguf_shard_types) != set(ids):
            raise WeightLoadError(f"GGUF layer: shards {sorted(layer.gguf_shards, key=str)} "
                                  f"loaded, expected {list(ids)}")
        device = layer.qweight.device
        types = {layer.gguf_shard_types[i] for i in ids}
        native = (len(types) == 1 and next(iter(types)) in GGUF_NATIVE_TYPES
                  and (device.type == "cuda" or (device.type == "cpu"
                                                 and gguf_kernels_available())))
        if native and layer.batch_invariant and device.type != "cpu":
            raise ValueError("batch_invariant: the batch-invariant GGUF kernel runs on the "
                             f"CPU only, not on {device}")
        if native:
            qtype = next(iter(types))
            width = row_bytes(qtype, layer.in_features)
            for i in ids:
                if layer.gguf_shards[i].shape[1] != width:
                    raise WeightLoadError(
                        f"qweight: rows of {layer.gguf_shards[i].shape[1]} bytes do not hold "
                        f"{layer.in_features} {_ggml_type_name(qtype)} weights ({width} bytes)")
            packed = torch.cat([layer.gguf_shards[i] for i in ids]).to(device)
            layer.qweight = nn.Parameter(packed, requires_grad=False)
            layer.qweight_type = nn.Parameter(torch.tensor(qtype, dtype=torch.int64,
                                                           device=device), requires_grad=False)
            layer.qtype = qtype
        else:
            logger.debug("GGUF layer with types %s: dequantized to a dense weight",
                         sorted(_ggml_type_name(t) for t in types))
            if layer.batch_invariant:
                raise ValueError("batch_invariant: a GGUF layer of types "
                                 f"{sorted(_ggml_type_name(t) for t in types)} has no "
                                 "batch-invariant kernel")
            dense = torch.cat([dequantize_rows(layer.gguf_shards[i], layer.gguf_shard_types[i],
                                               layer.in_features) for i in ids])
            layer.dense_weight = dense.to(device=device, dtype=layer.params_dtype)
            del layer.qweight, layer.qweight_type
        layer.gguf_shards, layer.gguf_shard_types = {}, {}

    def apply(self, layer, x):
        if layer.dense_weight is not None:
            return F.linear(x, layer.dense_weight)
        if x.device.type == "cuda":
            from tandem.kernels.gguf_linear import gguf_linear as triton_gguf_linear

            return triton_gguf_linear(x, layer.qweight, layer.qtype, layer.in_features)
        from tandem.kernels.cpu.gguf_linear import gguf_linear

        if x.dtype not in (torch.float32, torch.bfloat16):
            return gguf_linear(x.float(), layer.qweight, layer.qtype,
                               layer.in_features).to(x.dtype)
        return gguf_linear(x, layer.qweight, layer.qtype, layer.in_features,
                           fused_only=layer.batch_invariant)


def gguf_memory_bytes(model: nn.Module) -> int:
    """Bytes held by the linear layers' weights of ``model`` (packed or dense)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            for t in (getattr(module, "qweight", None), getattr(module, "dense_weight", None),
                      getattr(module, "weight", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total
