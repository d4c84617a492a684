"""Tensor-parallel layers: Megatron-LM's column/row split of a linear layer, and the
vocabulary-parallel embedding and LM head (vLLM's names and roles).

Reference: Shoeybi et al. 2019, "Megatron-LM", sec. 3. A transformer layer needs
two all-reduces in its forward pass: the attention's Q/K/V projection is split
by output rows (**column-parallel**: each rank computes its heads' Q, K, V from
the whole input, no communication), attention runs on each rank's own heads, and
the output projection is split by input columns (**row-parallel**: each rank
multiplies its heads' slice and the partial sums are all-reduced). The MLP is the
same pair: gate/up column-parallel, down row-parallel.

::

    x [T, H] (every rank) --qkv_proj, rank r's rows--> q_r, k_r, v_r
                          --attention(heads of r)-->   o_r [T, Hq_r D]
                          --o_proj, rank r's columns--> partial_r [T, H]
                          --all-reduce (sum over r)--> [T, H] (every rank)

Each layer here is a :class:`~tandem.engine.model.linear.Linear` (or an
embedding) whose parameters are its rank's shard, and which takes that shard
from the full checkpoint tensor at load: ``load_weight`` asks the layer's linear
method for the rank's slice, since where a tensor is cut depends on its format
(:meth:`~tandem.engine.model.linear.LinearMethodBase.narrow_output` /
``narrow_input``: rows of a dense weight, columns of a GPTQ ``qweight``, whole GGUF
blocks along a row), then the method copies it. A method without them raises
:class:`NotImplementedError`.

Shapes: ``T`` tokens, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.linear import Linear, LinearMethodBase, narrow_checked
from tandem.engine.model.weights import WeightLoadError, copy_checked
from tandem.engine.parallel.communicator import Communicator
from tandem.engine.parallel.partition import vocab_partition


def _check_shardable(quant_method: LinearMethodBase | None) -> None:
    if quant_method is not None and not quant_method.supports_tensor_parallel:
        raise NotImplementedError(
            f"tensor_parallel_size > 1: {quant_method.name!r} linear layers are not "
            "sharded")


class ColumnParallelLinear(Linear):
    """``y_r = x W_r^T (+ b_r)``: the weight ``W`` ``[N, K]`` split by output rows; the
    output stays split (``[T, N_r]`` on rank ``r``), for a row-parallel layer or
    per-rank attention heads to consume. No communication.

    A fused layer (``[q, kv, kv]``, gate-up) is split per sub-matrix: rank ``r`` holds
    ``partitions[i]`` of each sub-matrix ``i``, stacked as its local fused weight.

    Args:
        in_features: input width ``K`` (whole: the input is replicated).
        output_sizes: the full rows of each fused sub-matrix (the checkpoint's).
        partitions: per sub-matrix, ``(first row, rows)`` this rank holds.
        quant_method: the linear method (dense when None); it narrows each
            checkpoint tensor to the rank's rows.
        params_dtype, bias: as :class:`Linear` (the bias split like the rows).

    Raises:
        NotImplementedError: a ``quant_method`` whose format does not shard.
        ValueError: ``partitions`` not one per sub-matrix, or outside it.
    """

    def __init__(self, in_features: int, output_sizes: int | Sequence[int],
                 partitions: Sequence[tuple[int, int]],
                 quant_method: LinearMethodBase | None = None,
                 params_dtype: torch.dtype | None = None, bias: bool = False):
        full = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if len(partitions) != len(full) or any(
                s < 0 or n < 0 or s + n > f for (s, n), f in zip(partitions, full)):
            raise ValueError(f"partitions: {list(partitions)} do not fit output sizes {full}")
        _check_shardable(quant_method)
        super().__init__(in_features, [n for _, n in partitions], quant_method, params_dtype, bias)
        self.full_output_sizes = full
        self.partitions = [tuple(p) for p in partitions]

    def _local(self, param_name: str, loaded: torch.Tensor, i: int) -> torch.Tensor:
        start, size = self.partitions[i]
        full = self.full_output_sizes[i]
        if param_name == "bias":
            return narrow_checked(loaded, 0, full, start, size)
        return self.quant_method.narrow_output(self, param_name, loaded, full, start, size)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy this rank's rows of a full checkpoint tensor (sub-matrix ``shard_id``,
        or with None the whole, possibly fused, tensor).

        Raises:
            WeightLoadError: a tensor whose height is not the full one.
        """
        if shard_id is None and len(self.partitions) > 1:
            # Fused in the checkpoint too (Phi-3's qkv_proj): split it first.
            if param_name != "bias" and self.quant_method.name != "none":
                raise WeightLoadError(f"a fused {self.quant_method.name!r} checkpoint tensor "
                                      "is not split per rank (only dense ones are)")
            if loaded.shape[0] != sum(self.full_output_sizes):
                raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)}: expected "
                                      f"{sum(self.full_output_sizes)} rows")
            for i, piece in enumerate(loaded.split(self.full_output_sizes, dim=0)):
                super().load_weight(param_name, self._local(param_name, piece, i), i)
            return
        super().load_weight(param_name, self._local(param_name, loaded, shard_id or 0), shard_id)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", partitions={self.partitions}"


class RowParallelLinear(Linear):
    """``y = sum_r x_r W_r^T (+ b)``: the weight ``W`` ``[N, K]`` split by input columns;
    the input arrives split (``x_r`` ``[T, K_r]``, a column-parallel layer's output)
    and the partial products are summed by one all-reduce. The bias (whole on
    every rank) is added once, after the sum.

    Args:
        in_features: the full input width ``K``.
        output_size: ``N`` (whole).
        partition: ``(first column, columns)`` of ``W`` this rank holds.
        comm: the group's :class:`Communicator`.
        quant_method: the linear method (dense when None); it narrows each
            checkpoint tensor to the rank's columns (whole quantization groups or
            blocks: a partition that cuts one raises :class:`WeightLoadError` at load).
        params_dtype, bias: as :class:`Linear`.
        reduce: False: return this rank's partial product, unsummed (a caller that
            sums several layers' partials with one all-reduce: tensor-parallel MoE
            experts); no bias then.

    Shapes: ``x_r`` ``[T, K_r]`` -> ``[T, N]``, the same on every rank (with
    ``reduce``).

    Raises:
        NotImplementedError: a ``quant_method`` whose format does not shard.
    """

    def __init__(self, in_features: int, output_size: int, partition: tuple[int, int],
                 comm: Communicator, quant_method: LinearMethodBase | None = None,
                 params_dtype: torch.dtype | None = None, bias: bool = False,
                 reduce: bool = True):
        start, size = partition
        if start < 0 or size < 0 or start + size > in_features:
            raise ValueError(f"partition: {partition} outside {in_features} input columns")
        if bias and not reduce:
            raise ValueError("bias: a row-parallel layer that does not reduce adds none")
        _check_shardable(quant_method)
        super().__init__(size, output_size, quant_method, params_dtype, bias)
        self.full_in_features = in_features
        self.partition = (start, size)
        self.comm = comm
        self.reduce = reduce

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy this rank's columns of the full weight (the bias whole).

        Raises:
            WeightLoadError: a weight whose width is not the full one.
        """
        if param_name != "bias":
            loaded = self.quant_method.narrow_input(self, param_name, loaded,
                                                    self.full_in_features, *self.partition)
        super().load_weight(param_name, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if not self.reduce:
            return y
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", partition={self.partition}"
                + (", all-reduce" if self.reduce else ", partial"))


def _padded_rows(loaded: torch.Tensor, vocab_size: int, start: int, size: int,
                 padded: int) -> torch.Tensor:
    rows = narrow_checked(loaded, 0, vocab_size, start, size)
    if size == padded:
        return rows
    out = torch.zeros(padded, *loaded.shape[1:], dtype=loaded.dtype)
    out[:size] = rows
    return out


class VocabParallelEmbedding(nn.Module):
    """The token embedding split by vocabulary rows: rank ``r`` holds rows
    ``[start_r, start_r + size_r)`` (:func:`~tandem.engine.parallel.partition.vocab_partition`,
    padded to equal heights); each rank looks up the tokens in its range, writes
    zeros for the others, and one all-reduce sums the ranks' rows (exact: every
    element is one rank's value plus zeros).

    Args:
        num_embeddings: the vocabulary ``V`` (whole).
        embedding_dim: ``H``.
        comm: the group's :class:`Communicator`.
        gguf: keep the rank's rows in the GGUF file's blocks (``quantization``
            ``gguf``: a :class:`~tandem.engine.quantization.gguf_linear.GGUFEmbedding`
            of ``padded_size`` rows, padding rows of zero bytes, which decode to
            zeros); else a dense ``weight``.

    Shapes: ``input_ids`` ``[T]`` int64 -> ``[T, H]`` on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator,
                 params_dtype: torch.dtype | None = None, gguf: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        self.shard = vocab_partition(num_embeddings, comm.world_size, comm.rank)
        self.gguf = gguf
        if gguf:
            from tandem.engine.quantization.gguf_linear import init_gguf_table

            init_gguf_table(self, params_dtype or torch.get_default_dtype())
            return
        weight = torch.zeros(self.shard.padded_size, embedding_dim, dtype=params_dtype)
        if not weight.is_meta:
            nn.init.normal_(weight[:self.shard.size])
        self.weight = nn.Parameter(weight, requires_grad=False)

    def load_weight(self, leaf: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy this rank's rows of the full ``[V, H]`` table (padding rows zeroed);
        with ``gguf``, of the ``qweight`` rows (``qweight_type`` as is).

        Raises:
            WeightLoadError: a leaf this table does not store, or a table of another
                height.
        """
        s = self.shard
        if self.gguf:
            from tandem.engine.quantization.gguf_linear import load_gguf_table

            if leaf == "qweight":
                loaded = _padded_rows(loaded, self.num_embeddings, s.start, s.size,
                                      s.padded_size)
            load_gguf_table(self, leaf, loaded, s.padded_size)
            return
        if leaf != "weight":
            raise WeightLoadError(f"an embedding stores no {leaf!r}")
        copy_checked(self.weight.data, _padded_rows(loaded, self.num_embeddings, s.start,
                                                    s.size, s.padded_size))

    def share_with(self, layer: Linear) -> None:
        """With ``gguf``: give the tied LM head (a :class:`ParallelLMHead` of the same
        rows) this rank's loaded blocks, before either is processed."""
        if self.gguf:
            from tandem.engine.quantization.gguf_linear import share_gguf_table

            share_gguf_table(self, layer)

    def process_weights_after_loading(self) -> None:
        """With ``gguf``: pack the loaded rows (idempotent); nothing to do otherwise."""
        if self.gguf:
            from tandem.engine.quantization.gguf_linear import pack_gguf_table

            pack_gguf_table(self, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        local = local.masked_fill(outside, 0)
        if self.gguf:
            from tandem.engine.quantization.gguf_linear import gguf_table_lookup

            h = gguf_table_lookup(self, local, self.embedding_dim)
        else:
            h = F.embedding(local, self.weight)
        return self.comm.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))    # [T, H]

    def extra_repr(self) -> str:
        s = self.shard
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{s.start}, "
                f"{s.start + s.size}) of {s.padded_size}")


class ParallelLMHead(ColumnParallelLinear):
    """The output projection split by vocabulary rows, as the embedding is (so that a
    tied head shares its embedding's shard): each rank computes the logits of its
    rows, and rank 0 gathers them into the whole ``[N, V]``.

    Args:
        hidden_size: ``H``.
        vocab_size: ``V`` (whole).
        comm: the group's :class:`Communicator`.
        quant_method: dense when None; the GGUF method keeps the rank's rows in the
            file's blocks (padding rows of zero bytes).

    Shapes: ``hidden`` ``[N, H]`` -> ``[N, V]`` on rank 0, None on the other ranks
    (only rank 0 samples). Every rank must call it for the same ``N`` rows.
    """

    def __init__(self, hidden_size: int, vocab_size: int, comm: Communicator,
                 params_dtype: torch.dtype | None = None,
                 quant_method: LinearMethodBase | None = None):
        self.shard = vocab_partition(vocab_size, comm.world_size, comm.rank)
        padded = self.shard.padded_size
        # Built over the padded height: the padding rows load as zeros (load_weight).
        super().__init__(hidden_size, comm.world_size * padded, [(comm.rank * padded, padded)],
                         quant_method, params_dtype)
        self.vocab_size, self.comm = vocab_size, comm

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy this rank's rows of the full ``[V, H]`` weight (padding rows zeroed;
        a GGUF ``qweight``'s rows, its ``qweight_type`` as is).

        Raises:
            WeightLoadError: a weight of another height.
        """
        if param_name in ("weight", "qweight"):
            s = self.shard
            loaded = _padded_rows(loaded, self.vocab_size, s.start, s.size, s.padded_size)
        Linear.load_weight(self, param_name, loaded, shard_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.comm.gather(self.quant_method.apply(self, hidden), dst=0)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, :self.vocab_size].contiguous()
