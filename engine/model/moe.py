"""Mixture-of-experts feed-forward layers: top-k routing and the fused expert layer.

A sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE; Shazeer et al. 2017, "Outrageously
Large Neural Networks", section 2; Mixtral: Jiang et al. 2024, section 2.1) replaces
the dense gated MLP with ``E`` experts, each a SwiGLU MLP of width ``I``, and a
router ``[E, H]``: every token runs through the ``k`` experts with the highest router
probabilities, and their outputs are summed, weighted by those probabilities.

Routing follows transformers exactly (so greedy ids match it in float32): router
logits in the model dtype, a float32 softmax over the ``E`` experts, top-k of the
probabilities, then (``norm_topk_prob``; always for Mixtral) the ``k`` weights
divided by their sum. Mixtral multiplies the experts' outputs by the float32 weights;
Qwen2/3-MoE round the weights to the model dtype first (:class:`MoEConfig`).

**The fused expert layer** (:func:`fused_experts`; vLLM's ``fused_moe`` is the
design): the ``T k`` (token, expert) pairs are sorted by expert, the tokens gathered
into one ``[T k, H]`` tensor whose rows are contiguous per expert, and each expert
that received tokens runs its gate/up ``[2I, H]`` and down ``[H, I]`` matmuls once
on its whole group; its weighted outputs are added back to their tokens with an
``index_add`` (one per active expert, so that bfloat16 rounds as transformers does).
On the CPU the per-expert matmuls of dense experts are oneDNN's with each expert's
weights packed once at load (:mod:`tandem.kernels.cpu.linear`), as the dense layers;
quantized experts run their method's kernel (below).
Its cost: one host sync (the per-expert counts, ``E`` integers), at most ``min(E,
T k)`` pairs of GEMMs, and one ``[T k, H]`` copy of the activations (the gathered
input) plus per expert a ``[n, 2I]`` intermediate; no weight is copied per step. The
per-expert loop of transformers (:func:`moe_loop_reference`: a mask per expert and
an ``index_add`` per expert) computes the same sums in the same order and is the
reference in the tests and the benchmark.

**Expert weight formats.** Dense expert weights are stacked as transformers 5 holds
them: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows then up rows) and ``down_proj``
``[E, H, I]``; checkpoints that store one tensor per expert
(``experts.{e}.gate_proj.weight``, Mixtral's ``w1``/``w3``/``w2``) load into their
slice by shard id (:class:`StackedExpertWeight`). With a quantized linear method
(``gguf``, ``gptq``, ``awq``) each expert is instead a pair of
:class:`~tandem.engine.model.linear.Linear` layers of that method
(:class:`QuantizedExpert`: ``experts.{e}.gate_up_proj`` ``[2I, H]``, shards gate and
up, and ``experts.{e}.down_proj`` ``[H, I]``), so an expert's weights stay in the
format the dense layers keep theirs in and its matmuls are the same kernels:

- ``gguf``: a GGUF file's ``ffn_{gate,up,down}_exps`` ``[E, out, in]`` (listed
  ``[in, out, E]``, fastest first) are cut into the ``E`` experts' rows of ggml
  blocks (:func:`~tandem.engine.model.weights.iter_gguf_tensors`), held as stored
  (the rows' bytes are the file's expert tensor bytes; a type without a kernel is
  dequantized per expert at load, as for a dense layer);
- ``gptq`` / ``awq``: the checkpoint's per-expert ``qweight`` / ``qzeros`` /
  ``scales`` (/ ``g_idx``) become INT4_ZP blocks (4.75 bits per weight,
  :mod:`~tandem.engine.quantization.int4_packed`).

A quantized expert computes exactly what a dense expert holding its dequantized
weight does, up to the float32 summation order of the kernels. The router (and
Qwen2-MoE's ``shared_expert_gate``) stay dense in every format, as in the
checkpoints. Batch-invariant mode is refused (the grouped matmuls' summation order
depends on how many tokens an expert receives).

Shapes: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``k`` experts per token,
``I`` expert FFN width.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.model.hf_config import MoEConfig
from tandem.engine.model.layers import DecoderForCausalLM, GatedMLP
from tandem.engine.model.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from tandem.engine.model.weights import WeightLoadError, copy_checked
from tandem.kernels.attention_backend import AttentionBackend
from tandem.kernels.cpu.linear import (AMX_LINEAR_MAX_ROWS, amx_linear_unchecked,
                                       amx_linear_usable, pack_invariant_weight, pack_weight,
                                       packed_linear, packing_available)

if TYPE_CHECKING:
    from tandem.engine.parallel.communicator import Communicator

ExpertLinear = Callable[[int, torch.Tensor], torch.Tensor]
"""``(expert, x [n, in]) -> x W_e^T [n, out]`` for one stacked projection."""


class StackedExpertWeight(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``[E, N, K]`` with ``N =
    sum(output_sizes)`` (``[I, I]`` for gate/up: gate rows first).

    A checkpoint fills it whole (transformers 5's ``experts.gate_up_proj``, shard id
    None) or one expert's sub-matrix at a time: shard ``e * len(output_sizes) + j``
    is sub-matrix ``j`` of expert ``e``.

    With ``experts`` (expert parallelism: this rank's contiguous range of the
    ``num_experts``) ``weight`` holds only those, ``[len(experts), N, K]``; the
    other experts' tensors are taken and dropped. With ``partition`` (tensor-parallel
    experts: ``(start, size)`` of the expert FFN width) each sub-matrix keeps only
    rows ``start .. start + size - 1`` (``split="rows"``: gate and up,
    column-parallel, ``[E, len(output_sizes) * size, K]``) or those input columns
    (``split="columns"``: down, row-parallel, ``[E, N, size]``).
    """

    def __init__(self, num_experts: int, in_features: int, output_sizes: Sequence[int],
                 experts: range | None = None, partition: tuple[int, int] | None = None,
                 split: str = "rows"):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.num_experts = num_experts
        self.experts = experts if experts is not None else range(num_experts)
        self.partition, self.split = partition, split
        rows, cols = sum(output_sizes), in_features
        if partition is not None and split == "rows":
            rows = partition[1] * len(output_sizes)
        elif partition is not None:
            cols = partition[1]
        weight = torch.empty(len(self.experts), rows, cols)
        if not weight.is_meta:
            nn.init.normal_(weight, std=in_features ** -0.5)
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def shard_ids(self) -> tuple[int, ...]:
        """Every (expert, sub-matrix) shard; all are needed unless loaded whole (a
        rank holding some experts takes every shard and keeps its own)."""
        return tuple(range(self.num_experts * len(self.output_sizes)))

    def _local(self, sub: torch.Tensor) -> torch.Tensor:
        """This rank's part of one sub-matrix ``[..., out_j, K]``."""
        if self.partition is None:
            return sub
        start, size = self.partition
        return sub.narrow(-2 if self.split == "rows" else -1, start, size)

    def load_weight(self, leaf: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Called by :func:`~tandem.engine.model.weights.load_weights`.

        Raises:
            WeightLoadError: a leaf other than ``weight`` (a quantized tensor), or a
                shape that does not fit.
        """
        if leaf != "weight":
            raise WeightLoadError(f"expert weights are dense; no {leaf!r}")
        lo, hi = self.experts.start, self.experts.stop
        if shard_id is None:
            if loaded.dim() != 3 or loaded.shape[1] != sum(self.output_sizes):
                raise WeightLoadError(f"stacked expert tensor {tuple(loaded.shape)}: expected "
                                      f"[{self.num_experts}, {sum(self.output_sizes)}, ...]")
            subs = loaded[lo:hi].split(self.output_sizes, dim=1)
            copy_checked(self.weight.data, torch.cat([self._local(t) for t in subs], dim=1))
            return
        expert, j = divmod(shard_id, len(self.output_sizes))
        if expert not in self.experts:
            return                              # another rank's expert (expert parallelism)
        rows = (self.partition[1] if self.partition is not None and self.split == "rows"
                else self.output_sizes[j])
        first = j * rows if self.partition is not None and self.split == "rows" \
            else sum(self.output_sizes[:j])
        copy_checked(self.weight.data[expert - lo].narrow(0, first, rows), self._local(loaded))


class QuantizedExpert(nn.Module):
    """One routed expert's two projections as linear layers of a quantized method:
    ``gate_up_proj`` ``[2I, H]`` (shard 0 gate, shard 1 up) and ``down_proj``
    ``[H, I]``, whose parameters are the method's (GGUF ``qweight`` /
    ``qweight_type``, GPTQ / AWQ ``qweight`` / ``qzeros`` / ``scales`` ...).

    Args:
        hidden_size: ``H``; intermediate_size: ``I``.
        linear_method: the quantized :class:`~tandem.engine.model.linear.LinearMethodBase`.
        comm, partition: tensor-parallel experts: this rank's ``(start, size)`` of
            ``I`` (whole quantization units), gate-up column-parallel and down
            row-parallel without its all-reduce; None: the whole expert.

    Raises:
        WeightLoadError: widths the method cannot pack (GPTQ / AWQ: not multiples
            of 8).
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 linear_method: LinearMethodBase, comm: Communicator | None = None,
                 partition: tuple[int, int] | None = None):
        super().__init__()
        if partition is None:
            self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size],
                                       linear_method)
            self.down_proj = Linear(intermediate_size, hidden_size, linear_method)
            return
        from tandem.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

        # Tensor-parallel experts: this rank's features of the expert; the down
        # projection's partial sum is reduced once for all experts (FusedMoE).
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                 [partition, partition], linear_method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, partition, comm,
                                           linear_method, reduce=False)


class _AbsentLinear(nn.Module):
    """Stands in for one projection of another rank's expert (expert parallelism):
    the parameter names of ``template`` (so that the checkpoint's tensors of that
    expert have their place) as empty tensors, and a :meth:`load_weight` that drops
    what it is given. Never called."""

    def __init__(self, template: Linear):
        super().__init__()
        for name, p in template.named_parameters(recurse=False):
            self.register_parameter(name, nn.Parameter(torch.empty(0, dtype=p.dtype),
                                                       requires_grad=False))
        self.shard_ids = template.shard_ids

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Drop ``loaded``: another rank holds this expert."""


def _absent_expert(expert: QuantizedExpert) -> nn.Module:
    """``expert``'s place on a rank that does not hold it (:class:`_AbsentLinear`
    projections)."""
    absent = nn.Module()
    absent.gate_up_proj = _AbsentLinear(expert.gate_up_proj)
    absent.down_proj = _AbsentLinear(expert.down_proj)
    return absent


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          weights_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as transformers' ``*TopKRouter``: float32 softmax over the
    experts, top-k, optionally renormalised to sum to 1.

    Args:
        router_logits: ``[T, E]`` in the model dtype.
        weights_float32: keep the weights in float32 (Mixtral); else rounded to
            the logits' dtype (Qwen2/3-MoE).

    Returns:
        ``(topk_weights [T, k], topk_ids [T, k] int64)``; ids in descending
        probability order (``torch.topk``'s tie order).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)     # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                       # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_float32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def fused_experts(x: torch.Tensor, gate_up: ExpertLinear, down: ExpertLinear,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                  act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                  experts: range | None = None) -> torch.Tensor:
    """The MoE feed-forward of ``x``, grouped by expert (see the module docstring).

    Args:
        x: ``[T, H]`` hidden states.
        gate_up, down: each expert's ``[2I, H]`` and ``[H, I]`` matmuls
            (:data:`ExpertLinear`).
        topk_weights: ``[T, k]`` routing weights (float32 or ``x``'s dtype).
        topk_ids: ``[T, k]`` int64 expert ids in ``0..E-1``.
        act_and_mul: ``[n, 2I]`` -> ``[n, I]`` (SiLU-and-mul).
        experts: only these experts run (expert parallelism: this rank's; the
            others' pairs add nothing here). None: all.

    Returns:
        ``[T, H]`` in ``x``'s dtype: ``sum_j w_tj * expert_{id_tj}(x_t)``, each
        product in the weights' and outputs' promoted dtype, rounded to ``x``'s
        dtype, and accumulated per token in ascending expert order; bit-identical to
        :func:`moe_loop_reference` (transformers' order throughout). One token (a
        single stream's decode step) skips the sort, gather and scatter
        (:func:`_one_token_experts`, the same values).
    """
    t, k = topk_ids.shape
    if t == 1:
        return _one_token_experts(x, gate_up, down, topk_weights, topk_ids, act_and_mul, experts)
    # Pairs sorted by (expert, slot, token): transformers' row order within an expert
    # group, which a GEMM's result can depend on (its row blocking).
    flat_ids = topk_ids.t().reshape(-1)                                   # [k T]
    order = torch.argsort(flat_ids, stable=True)
    token_ids = order % t                                                 # [T k], sorted
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()    # host sync: E ints
    grouped = x.index_select(0, token_ids)                                # [T k, H]
    weights = topk_weights.t().reshape(-1)[order].unsqueeze(1)            # [T k, 1]
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n and (experts is None or expert in experts):
            rows = slice(start, start + n)
            y = down(expert, act_and_mul(gate_up(expert, grouped[rows])))  # [n, H]
            # One index_add per expert: in bfloat16 a single index_add over all
            # pairs sums a token's contributions in float32 before rounding, while
            # transformers rounds after each expert.
            out.index_add_(0, token_ids[rows], (y * weights[rows]).to(x.dtype))
        start += n
    return out


def _one_token_experts(x: torch.Tensor, gate_up: ExpertLinear, down: ExpertLinear,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                       experts: range | None) -> torch.Tensor:
    """:func:`fused_experts` of one token (a single stream's decode step) without the
    sort, gather and scatter: its ``k`` experts in ascending order, each weighted
    output rounded to ``x``'s dtype and added in that order (``0 + a`` is ``a``), so
    the same values as the grouped path."""
    ids = topk_ids[0].tolist()                                            # host sync: k ints
    out = None
    for slot in sorted(range(len(ids)), key=ids.__getitem__):
        expert = ids[slot]
        if experts is not None and expert not in experts:
            continue
        y = down(expert, act_and_mul(gate_up(expert, x)))                 # [1, H]
        y = (y * topk_weights[:, slot:slot + 1]).to(x.dtype)
        out = y if out is None else out + y
    return torch.zeros_like(x) if out is None else out


def moe_loop_reference(x: torch.Tensor, gate_up: ExpertLinear, down: ExpertLinear,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                       act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                       experts: range | None = None) -> torch.Tensor:
    """:func:`fused_experts` as transformers' eager ``*Experts.forward`` computes it
    (same arguments and result): for each expert that received tokens, a mask lookup
    of its tokens, its two matmuls, and one ``index_add`` of its weighted outputs."""
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids, num_experts).permute(2, 1, 0)             # [E, k, T]
    for expert in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
        if experts is not None and expert not in experts:
            continue
        slot, token = torch.where(mask[expert])
        y = down(expert, act_and_mul(gate_up(expert, x[token])))
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype))
    return out


def dispatched_experts(x: torch.Tensor, gate_up: ExpertLinear, down: ExpertLinear,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                       act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                       comm: Communicator, expert_starts: Sequence[int]) -> torch.Tensor:
    """:func:`fused_experts` with the experts spread over the ranks of ``comm`` and the
    tokens **dispatched** to their experts' ranks and **combined** back by two
    all-to-alls (GShard, Lepikhin et al. 2020, section 2.2; DeepSpeed-MoE's
    expert-parallel dispatch), then all-gathered.

    Every rank holds the same ``x`` and routing (tensor-parallel attention leaves
    them so). Rank ``r`` owns the tokens ``split_evenly(T, P, r)``: it sends each of
    its (token, expert) pairs' rows to the rank holding that expert, in
    :func:`fused_experts`' (expert, slot, token) order; the expert's rank puts the
    rows it receives back in that order, so each expert's GEMMs see exactly the rows
    one process would give them, and returns the weighted outputs, which the token's
    rank adds per token in ascending expert order, as :func:`fused_experts` does.
    The result is therefore bit-identical to :func:`fused_experts` on one rank (the
    all-reduce combine is not: it sums the ranks' partial sums). Since every rank
    knows every token's routing, no counts are exchanged.

    Communication per MoE layer and rank (``P`` ranks, ``k`` experts per token,
    ``T`` tokens, ``H`` hidden): two all-to-alls of about ``k T / P`` rows of ``H``
    each (of which ``(P - 1) / P`` leave the rank), and an all-gather of ``ceil(T /
    P)`` rows; the all-reduce combine moves ``2 (P - 1) / P`` of ``T`` rows. The
    all-to-all form pays where ``k`` is small beside ``P`` (many expert ranks) or
    where tokens are not replicated in the first place.

    Args:
        x, gate_up, down, topk_weights, topk_ids, num_experts, act_and_mul: as
            :func:`fused_experts` (``gate_up`` / ``down`` called only for this
            rank's experts).
        comm: the group (``world_size`` ``P``, this ``rank``).
        expert_starts: ``[P + 1]`` expert ranges: rank ``d`` holds experts
            ``expert_starts[d]`` to ``expert_starts[d + 1] - 1``.

    Returns:
        ``[T, H]`` in ``x``'s dtype, the same on every rank.
    """
    from tandem.engine.parallel.partition import split_evenly

    t, k = topk_ids.shape
    world, me = comm.world_size, comm.rank
    token_starts = [split_evenly(t, world, r)[0] for r in range(world)] + [t]
    flat_ids = topk_ids.t().reshape(-1)                                   # [k T]
    order = torch.argsort(flat_ids, stable=True)                          # (expert, slot, token)
    token_ids = order % t
    expert_ids = flat_ids[order]
    weights = topk_weights.t().reshape(-1)[order].unsqueeze(1)            # [T k, 1]
    token_rank = torch.bucketize(token_ids, torch.tensor(token_starts[1:-1], device=x.device),
                                 right=True)
    expert_rank = torch.bucketize(expert_ids, torch.tensor(list(expert_starts[1:-1]),
                                                           device=x.device), right=True)
    # Host-side counts (one sync): the pairs between each two ranks.
    pair_counts = torch.bincount(token_rank * world + expert_rank,
                                 minlength=world * world).view(world, world).tolist()
    send_counts = pair_counts[me]                                         # mine -> rank d
    recv_counts = [pair_counts[src][me] for src in range(world)]          # rank s -> mine
    # Dispatch: my tokens' pairs, grouped by destination (experts ascend with ranks).
    mine = torch.nonzero(token_rank == me).flatten()
    received = comm.all_to_all(x.index_select(0, token_ids[mine]), send_counts, recv_counts)
    # My experts' pairs in the global order; the received rows are those stably
    # sorted by their token's rank.
    theirs = torch.nonzero(expert_rank == me).flatten()
    arrival = torch.argsort(token_rank[theirs], stable=True)
    rows = torch.empty_like(received)
    rows[arrival] = received
    results = torch.empty_like(rows)
    counts = torch.bincount(expert_ids[theirs] - expert_starts[me],
                            minlength=expert_starts[me + 1] - expert_starts[me]).tolist()
    start = 0
    for i, n in enumerate(counts):
        if n:
            span = slice(start, start + n)
            y = down(expert_starts[me] + i, act_and_mul(gate_up(expert_starts[me] + i, rows[span])))
            results[span] = (y * weights[theirs[span]]).to(x.dtype)
        start += n
    # Combine: back to the tokens' ranks, which receive them in the global order.
    back = comm.all_to_all(results[arrival], recv_counts, send_counts)
    lo, hi = token_starts[me], token_starts[me + 1]
    out = x.new_zeros(hi - lo, x.shape[1])
    mine_experts = expert_ids[mine]
    bounds = torch.searchsorted(mine_experts,
                                torch.arange(num_experts + 1, device=x.device)).tolist()
    for expert in range(num_experts):
        a, b = bounds[expert], bounds[expert + 1]
        if b > a:                   # one index_add per expert, as fused_experts rounds
            out.index_add_(0, token_ids[mine[a:b]] - lo, back[a:b])
    # Every rank needs every token's output: pad the slices to one size and gather.
    size = token_starts[1] - token_starts[0]
    padded = x.new_zeros(size, x.shape[1])
    padded[:hi - lo] = out
    parts = comm.all_gather(padded, dim=0)                                # [P size, H]
    return torch.cat([parts[r * size:r * size + token_starts[r + 1] - token_starts[r]]
                      for r in range(world)])


class FusedMoE(nn.Module):
    """A sparse MoE block: router ``gate`` ``[E, H]``, the routed experts and, for
    Qwen2-MoE, a shared expert (a :class:`GatedMLP` of width
    ``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``.

    The routed experts are dense and stacked (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``: :class:`StackedExpertWeight`) for the dense
    method, else one :class:`QuantizedExpert` per expert (``experts.{e}.gate_up_proj``,
    ``experts.{e}.down_proj``) of the quantized method (:attr:`quantized_experts`).

    **Tensor-parallel experts** (``comm``, ``expert_parallel`` false; vLLM's default):
    every rank holds every expert's share of the FFN width (whole units of the
    format, as a dense MLP splits: gate-up column-parallel, down row-parallel), runs
    every routed pair on its share, and one all-reduce sums the ranks' partial
    outputs; every rank works on every token, whatever the routing.

    **Expert parallelism** (``comm``, ``expert_parallel``; the group's ranks hold the
    same activations, as tensor parallelism leaves them): rank ``r`` holds a contiguous share of the
    experts (:attr:`local_experts`, :func:`~tandem.engine.parallel.partition.split_evenly`),
    every rank routes every token with the whole router (the same float32 numerics),
    runs only its experts' pairs, and one all-reduce sums the ranks' partial outputs:
    the combine an all-to-all dispatch would end with, without moving tokens, since
    each rank already has them all. A shared expert is tensor-parallel (its own
    all-reduce). Quantized experts are spread the same way: the rank's experts are
    whole :class:`QuantizedExpert` layers (every expert's weights in its format, as
    one rank holds them), the others' places in :attr:`experts` empty modules that
    drop their checkpoint tensors as they stream by.

    Args:
        cfg: the model config (``cfg.moe`` set; ``hidden_act`` SiLU).
        linear_method: the routed and shared experts' linear method (None: dense);
            the router and ``shared_expert_gate`` are dense in every format.
        comm: the tensor-parallel group's communicator (None: every expert whole
            here).
        expert_parallel: with ``comm``, spread whole experts over the ranks
            (``EngineConfig.enable_expert_parallel``) instead of splitting each.

    ``impl`` picks the dispatch: ``"fused"`` (:func:`fused_experts`, the default) or
    ``"loop"`` (:func:`moe_loop_reference`, for comparisons). ``dispatch`` picks how
    the ranks' experts meet under expert parallelism: ``"all_reduce"`` (above, the
    default) or ``"all_to_all"`` (:func:`dispatched_experts`: each rank's share of
    the tokens sent to their experts' ranks and back, then all-gathered; set from
    :attr:`~tandem.engine.config.EngineConfig.moe_dispatch` by
    :func:`set_moe_dispatch`).
    """

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase,
                 comm: Communicator | None = None, expert_parallel: bool = False):
        super().__init__()
        moe: MoEConfig = cfg.moe
        h, i = cfg.hidden_size, moe.moe_intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.norm_topk_prob, self.weights_float32 = moe.norm_topk_prob, moe.topk_weights_float32
        self.gate = Linear(h, moe.num_experts, UnquantizedLinearMethod())
        self.quantized_experts = linear_method is not None and linear_method.name != "none"
        self.comm = comm
        self.local_experts = range(moe.num_experts)
        """The experts this rank holds and runs (all of them without ``comm``)."""
        self.expert_starts = [0, moe.num_experts]
        """``[P + 1]``: rank ``d`` holds experts ``expert_starts[d]`` to
        ``expert_starts[d + 1] - 1``."""
        self.expert_parallel = comm is not None and expert_parallel
        self.partition: tuple[int, int] | None = None
        """Tensor-parallel experts: this rank's ``(start, size)`` of the FFN width."""
        if self.expert_parallel:
            from tandem.engine.parallel.partition import split_evenly

            self.expert_starts = [split_evenly(moe.num_experts, comm.world_size, r)[0]
                                  for r in range(comm.world_size)] + [moe.num_experts]
            start, size = split_evenly(moe.num_experts, comm.world_size, comm.rank)
            self.local_experts = range(start, start + size)
        elif comm is not None:
            from tandem.engine.parallel.partition import split_in_units

            self.partition = split_in_units(i, (linear_method or UnquantizedLinearMethod())
                                            .shard_units, comm.world_size, comm.rank)
        if self.quantized_experts:
            experts = [QuantizedExpert(h, i, linear_method, comm, self.partition)
                       for _ in range(moe.num_experts)]
            self.experts = nn.ModuleList(
                x if e in self.local_experts else _absent_expert(x)
                for e, x in enumerate(experts))
        else:
            self.experts = nn.Module()
            self.experts.gate_up_proj = StackedExpertWeight(moe.num_experts, h, [i, i],
                                                            self.local_experts, self.partition)
            self.experts.down_proj = StackedExpertWeight(moe.num_experts, i, [h],
                                                         self.local_experts, self.partition,
                                                         split="columns")
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg, linear_method, moe.shared_expert_intermediate_size,
                                          comm=comm)
            self.shared_expert_gate = Linear(h, 1, UnquantizedLinearMethod())
        self.impl = "fused"
        self.dispatch = "all_reduce"
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # (gate-up panels, down panels, gate-up N, down N) per local expert
        self._panels: tuple[list[torch.Tensor], list[torch.Tensor], int, int] | None = None

    def process_weights_after_loading(self) -> None:
        """Pack each expert's two matrices once (CPU); the stacked weights are then
        dropped (only the packed copies are read):

        - bfloat16 on an AMX host (both widths multiples of 32, and
          :data:`~tandem.kernels.cpu.linear.AMX_LINEAR_MAX_ROWS` not 0): into the
          16-column panels of :func:`~tandem.kernels.cpu.linear.amx_linear`, which
          every expert's rows take whatever their count. An expert's token count
          changes every step, and oneDNN compiles a primitive for every count new to
          the process (40 steps of 64-2048 tokens, top-2 of 8 experts, hidden 512,
          width 1024: 1614 ms through oneDNN the first time, 158 ms once its
          primitives existed, 122-129 ms here);
        - otherwise float32 or bfloat16, where
          :func:`~tandem.kernels.cpu.linear.packing_available`: for oneDNN's matmul.

        Quantized experts are :class:`~tandem.engine.model.linear.Linear` layers,
        processed by their own method. Idempotent."""
        if self._packed is not None or self._panels is not None or self.quantized_experts:
            return
        w13 = self.experts.gate_up_proj.weight
        w2 = self.experts.down_proj.weight
        if w13.device.type != "cpu":
            return
        if (w13.dtype == torch.bfloat16 and AMX_LINEAR_MAX_ROWS > 0
                and amx_linear_usable(w13.shape[2]) and amx_linear_usable(w2.shape[2])):
            self._panels = ([pack_invariant_weight(w) for w in w13],
                            [pack_invariant_weight(w) for w in w2], w13.shape[1], w2.shape[1])
        elif packing_available(w13.dtype):
            self._packed = ([pack_weight(w) for w in w13], [pack_weight(w) for w in w2])
        else:
            return
        del self.experts.gate_up_proj.weight, self.experts.down_proj.weight

    def _expert_linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        if self.quantized_experts:
            experts = self.experts
            return ((lambda e, x: experts[e].gate_up_proj(x)),
                    (lambda e, x: experts[e].down_proj(x)))
        lo = self.local_experts.start             # stacked weights hold the local ones
        if self._panels is not None:
            p13, p2, n13, n2 = self._panels
            return ((lambda e, x: amx_linear_unchecked(x, p13[e - lo], n13)),
                    (lambda e, x: amx_linear_unchecked(x, p2[e - lo], n2)))
        if self._packed is not None:
            w13, w2 = self._packed
            return ((lambda e, x: packed_linear(x, w13[e - lo])),
                    (lambda e, x: packed_linear(x, w2[e - lo])))
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        return (lambda e, x: F.linear(x, w13[e - lo])), (lambda e, x: F.linear(x, w2[e - lo]))

    def forward(self, h: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``h`` ``[T, H]`` -> ``[T, H]``."""
        topk_weights, topk_ids = route(self.gate(h), self.top_k, self.norm_topk_prob,
                                       self.weights_float32)             # [T, k] each
        out = None
        if (self.impl == "fused" and self._packed is None and self._panels is None
                and not self.quantized_experts and self.comm is None):
            # Dense stacked weights not packed for oneDNN (a GPU): the backend's
            # fused kernel if it has one (Triton's kernels/fused_moe.py).
            out = backend.fused_moe(h, self.experts.gate_up_proj.weight,
                                    self.experts.down_proj.weight, topk_weights, topk_ids)
        if out is None and self.expert_parallel and self.dispatch == "all_to_all":
            gate_up, down = self._expert_linears()
            out = dispatched_experts(h, gate_up, down, topk_weights, topk_ids, self.num_experts,
                                     backend.silu_and_mul, self.comm, self.expert_starts)
        if out is None:
            gate_up, down = self._expert_linears()
            run = fused_experts if self.impl == "fused" else moe_loop_reference
            experts = self.local_experts if self.expert_parallel else None
            out = run(h, gate_up, down, topk_weights, topk_ids, self.num_experts,
                      backend.silu_and_mul, experts)
            if self.comm is not None:
                out = self.comm.all_reduce(out)         # the other ranks' experts or shares
        if self.shared_expert is not None:
            shared = self.shared_expert(h, backend)                       # [T, H]
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * shared
        return out


MOE_DISPATCHES = ("all_reduce", "all_to_all")
"""How the ranks' experts meet under expert parallelism (:class:`FusedMoE`)."""


def set_moe_dispatch(model: nn.Module, dispatch: str) -> None:
    """Set every :class:`FusedMoE` block of ``model`` to ``dispatch`` (a no-op for a
    dense model; every rank of a group must set the same).

    Raises:
        ValueError: ``dispatch`` not in :data:`MOE_DISPATCHES`.
    """
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"moe_dispatch: expected one of {', '.join(MOE_DISPATCHES)}, "
                         f"got {dispatch!r}")
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.dispatch = dispatch


# experts.{e}.{projection}.{leaf} inside an MoE block
_EXPERT_NAME = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<leaf>\w+)$")


class MoEForCausalLM(DecoderForCausalLM):
    """The shared decoder with :class:`FusedMoE` blocks in the layers
    ``cfg.moe.sparse_layers`` marks (the others keep the dense :class:`GatedMLP`).

    Subclasses name their checkpoints' expert projections in
    :attr:`expert_projections` and may rename the block (:attr:`checkpoint_block`).
    With a quantized linear method the experts are per-expert linear layers of that
    method (:class:`FusedMoE`), and :meth:`weight_mapping` maps each checkpoint
    expert tensor to its expert's layer.
    """

    expert_projections: dict[str, tuple[str, int]] = {
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", 0)}
    """Checkpoint per-expert projection -> (stacked projection, sub-matrix)."""
    checkpoint_block: str = "mlp"
    """The checkpoint's name of the MoE block (Mixtral: ``block_sparse_moe``)."""

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase | None = None,
                 enable_expert_parallel: bool = False, **kwargs):
        # Read by make_mlp while the base class builds the layers.
        self.enable_expert_parallel = enable_expert_parallel
        super().__init__(cfg, linear_method, **kwargs)
        # Experts as per-expert linear layers of a quantized method (see FusedMoE).
        self.quantized_experts = linear_method is not None and linear_method.name != "none"

    supports_tensor_parallel = True
    """Attention splits by heads as the dense models'; each expert splits over the
    ranks, or with ``enable_expert_parallel`` the experts spread over them
    (:class:`FusedMoE`)."""

    def make_mlp(self, cfg: ModelConfig, linear_method: LinearMethodBase,
                 layer_idx: int, comm: Communicator | None = None) -> nn.Module | None:
        """:class:`FusedMoE` for a sparse layer (its experts in ``linear_method``'s
        format; with ``comm`` this rank's share of them)."""
        if not cfg.moe.sparse_layers[layer_idx]:
            return None
        return FusedMoE(cfg, linear_method, comm, self.enable_expert_parallel)

    def weight_mapping(self, name: str) -> tuple[str, int | None]:
        """Besides :meth:`DecoderForCausalLM.weight_mapping`:
        ``...mlp.experts.3.up_proj.weight`` -> ``(...mlp.experts.gate_up_proj.weight,
        3 * 2 + 1)`` (dense experts, stacked); transformers 5's stacked
        ``...mlp.experts.gate_up_proj`` (no leaf) loads whole. Quantized experts:
        ``...mlp.experts.3.up_proj.qweight`` -> ``(...mlp.experts.3.gate_up_proj.qweight,
        1)``, ``...experts.3.down_proj.qweight`` -> ``(...experts.3.down_proj.qweight,
        None)``."""
        block = f".{self.checkpoint_block}."
        if block in name:
            name = name.replace(block, ".mlp.", 1)
        m = _EXPERT_NAME.match(name)
        if m and m["proj"] in self.expert_projections:
            stacked, j = self.expert_projections[m["proj"]]
            if self.quantized_experts:
                return (f"{m['block']}.experts.{m['expert']}.{stacked}.{m['leaf']}",
                        j if stacked == "gate_up_proj" else None)
            per_expert = 2 if stacked == "gate_up_proj" else 1
            return (f"{m['block']}.experts.{stacked}.{m['leaf']}",
                    int(m["expert"]) * per_expert + j)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return name + ".weight", None
        return super().weight_mapping(name)

    def check_backend(self, backend: AttentionBackend) -> None:
        """Besides :meth:`DecoderForCausalLM.check_backend`: refuse batch-invariant
        mode.

        Raises:
            ValueError: ``batch_invariant`` (the grouped expert matmuls' summation
                order depends on the batch).
        """
        super().check_backend(backend)
        if getattr(backend, "batch_invariant", False):
            raise ValueError("batch_invariant: mixture-of-experts layers have no "
                             "batch-invariant kernel")
