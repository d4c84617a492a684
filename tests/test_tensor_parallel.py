"""Tensor parallelism (``engine/parallel``): the partition arithmetic, each parallel
layer against its unsharded version on a real 2-rank Gloo group, and whole engines:
``LLM(tensor_parallel_size=2)`` gives the greedy tokens of ``tensor_parallel_size=1``
(float32) on the default model, under KV-cache pressure (swaps), and on tiny Llama
and Mistral checkpoints (biases, an untied head, one KV head shared by both ranks, a
vocabulary that does not split evenly, a sliding window) against transformers.

The layer tests share one group for the module: rank 0 is this process, rank 1 a
spawned process that runs the same named scenario (:data:`SCENARIOS`) when rank 0
broadcasts its name; both build the same seeded full tensors, load them into
their shards, and rank 0 checks the result.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.engine.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.engine.model.linear import Linear
from tandem.engine.model.weights import WeightLoadError
from tandem.engine.parallel.communicator import (INLINE_OBJECT_BYTES, SHM_ALL_REDUCE_BYTES,
                                                 SingleProcessCommunicator,
                                                 TorchDistributedCommunicator)
from tandem.engine.parallel.layers import (ColumnParallelLinear, ParallelLMHead,
                                           RowParallelLinear, VocabParallelEmbedding)
from tandem.engine.parallel.partition import (HeadPartition, VocabPartition, head_partition,
                                              split_evenly, vocab_partition)
from tandem.engine.runtime.model_runner import ModelRunner
from tandem.engine.sampling.sampling_params import SamplingParams

# float64 for the layer checks: the sharded sums differ from the whole ones only by
# rounding, which float64 keeps below this.
ATOL = 1e-12


# -- partition arithmetic -------------------------------------------------------------------

def test_split_evenly_gives_the_first_ranks_one_more():
    assert [split_evenly(21, 2, r) for r in range(2)] == [(0, 11), (11, 10)]
    assert [split_evenly(1536, 2, r) for r in range(2)] == [(0, 768), (768, 768)]
    assert [split_evenly(3, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 0)]


def test_heads_split_by_kv_group():
    # SmolLM2-135M: 9 query heads in 3 groups of 3; rank 0 takes two groups.
    assert [head_partition(9, 3, 2, r) for r in range(2)] == [HeadPartition(0, 6, 0, 2),
                                                              HeadPartition(6, 3, 2, 1)]
    assert [head_partition(32, 8, 4, r) for r in range(4)] == [
        HeadPartition(8 * r, 8, 2 * r, 2) for r in range(4)]
    assert head_partition(9, 3, 1, 0) == HeadPartition(0, 9, 0, 3)


def test_kv_heads_replicated_when_fewer_than_ranks():
    assert [head_partition(4, 1, 2, r) for r in range(2)] == [HeadPartition(0, 2, 0, 1),
                                                              HeadPartition(2, 2, 0, 1)]
    assert [head_partition(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="tensor_parallel_size: 6 ranks cannot share 3 KV"):
        head_partition(9, 3, 6, 0)


def test_vocab_padded_to_equal_shards():
    assert [vocab_partition(49152, 2, r) for r in range(2)] == [
        VocabPartition(0, 24576, 24576), VocabPartition(24576, 24576, 24576)]
    assert [(p.start, p.size, p.padded_size) for p in
            (vocab_partition(13, 2, r) for r in range(2))] == [(0, 7, 7), (7, 6, 7)]


# -- the layers on a real 2-rank Gloo group -------------------------------------------------

def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mlp(comm):
    """gate-up column-parallel (fused, uneven: 21 features as 11 + 10), SiLU-and-mul
    on each rank's features, down row-parallel with a bias: one all-reduce."""
    h, f = 24, 21
    w_gate, w_up, w_down, b_down, x = (_full(1, f, h), _full(2, f, h), _full(3, h, f),
                                       _full(4, h), _full(5, 5, h))
    cols = split_evenly(f, comm.world_size, comm.rank)
    gate_up = ColumnParallelLinear(h, [f, f], [cols, cols], params_dtype=torch.float64)
    down = RowParallelLinear(f, h, cols, comm, params_dtype=torch.float64, bias=True)
    gate_up.load_weight("weight", w_gate, 0)
    gate_up.load_weight("weight", w_up, 1)
    down.load_weight("weight", w_down, None)
    down.load_weight("bias", b_down, None)
    g, u = gate_up(x).split(cols[1], dim=-1)
    out = down(F.silu(g) * u)
    return out, F.silu(x @ w_gate.T) * (x @ w_up.T) @ w_down.T + b_down


def _attention_projections(comm):
    """Q/K/V column-parallel by SmolLM2's head split (9 / 3 heads, D 4) with biases,
    and the output projection row-parallel over the rank's query heads."""
    h, d, hq, hkv = 16, 4, 9, 3
    wq, wk, wv, bq, bk, bv = (_full(10, hq * d, h), _full(11, hkv * d, h), _full(12, hkv * d, h),
                              _full(13, hq * d), _full(14, hkv * d), _full(15, hkv * d))
    wo, x, o = _full(16, h, hq * d), _full(17, 3, h), _full(18, 3, hq * d)
    heads = head_partition(hq, hkv, comm.world_size, comm.rank)
    q_rows = (heads.q_start * d, heads.num_heads * d)
    kv_rows = (heads.kv_start * d, heads.num_kv_heads * d)
    qkv = ColumnParallelLinear(h, [hq * d, hkv * d, hkv * d], [q_rows, kv_rows, kv_rows],
                               params_dtype=torch.float64, bias=True)
    for i, (w, b) in enumerate(((wq, bq), (wk, bk), (wv, bv))):
        qkv.load_weight("weight", w, i)
        qkv.load_weight("bias", b, i)
    o_proj = RowParallelLinear(hq * d, h, q_rows, comm, params_dtype=torch.float64)
    o_proj.load_weight("weight", wo, None)
    q, k, v = qkv(x).split([q_rows[1], kv_rows[1], kv_rows[1]], dim=-1)
    want = [(x @ w.T + b).narrow(1, *rows) for w, b, rows in
            ((wq, bq, q_rows), (wk, bk, kv_rows), (wv, bv, kv_rows))]
    local_err = max(float((a - b).abs().max()) for a, b in zip((q, k, v), want))
    errors = comm.all_gather(torch.tensor([local_err], dtype=torch.float64))
    out = o_proj(o.narrow(1, *q_rows).contiguous())
    return errors, out, o @ wo.T, heads


def _embedding(comm):
    """13-token vocabulary on 2 ranks (7 + 6 rows, one padding row): every token,
    both shards' edges included."""
    table = _full(20, 13, 8)
    emb = VocabParallelEmbedding(13, 8, comm, params_dtype=torch.float64)
    emb.load_weight("weight", table, None)
    ids = torch.tensor([0, 6, 7, 12, 3, 9, 12, 0])
    return emb(ids), F.embedding(ids, table), emb.weight.shape


def _lm_head(comm):
    """Each rank's vocabulary rows; rank 0 gathers the whole ``[N, V]``."""
    w, hidden = _full(21, 13, 8), _full(22, 4, 8)
    head = ParallelLMHead(8, 13, comm, params_dtype=torch.float64)
    head.load_weight("weight", w, None)
    logits = head(hidden)
    on_others = comm.all_gather(torch.tensor([float(logits is None)]))
    return logits, hidden @ w.T, on_others


def _fused_checkpoint(comm):
    """A checkpoint that stores Q/K/V fused (Phi-3's qkv_proj, shard id None) loads the
    same rank slices as one that stores them apart."""
    w = _full(30, 12, 6)
    parts = [(comm.rank * 4, 4), (comm.rank, 1), (comm.rank, 1)]
    fused = ColumnParallelLinear(6, [8, 2, 2], parts, params_dtype=torch.float64)
    fused.load_weight("weight", torch.cat([w[:8], w[8:10], w[10:]]), None)
    apart = ColumnParallelLinear(6, [8, 2, 2], parts, params_dtype=torch.float64)
    for i, piece in enumerate(w.split([8, 2, 2])):
        apart.load_weight("weight", piece, i)
    return torch.equal(fused.weight, apart.weight), fused.weight.shape


def _collectives(comm):
    """all-reduce (through shared memory, and a tensor too large for it through Gloo),
    all-gather, gather, and broadcasts of a small and a large object."""
    r = comm.rank
    summed = comm.all_reduce(torch.tensor([1.0 + r, 10.0 * r]))
    large_sum = comm.all_reduce(torch.full((SHM_ALL_REDUCE_BYTES // 4 + 1,), 0.5 + r))
    gathered = comm.all_gather(torch.tensor([[r, r + 0.5]]), dim=0)
    at_root = comm.gather(torch.tensor([[r]]), dst=0, dim=-1)
    small = comm.broadcast_object({"step": 3} if r == 0 else None)
    large = comm.broadcast_object(list(range(INLINE_OBJECT_BYTES)) if r == 0 else None)
    return (summed, bool((large_sum == 2.0).all()), gathered, at_root, small,
            large == list(range(INLINE_OBJECT_BYTES)))


def _all_to_all(comm):
    """Rows between the two ranks with uneven and zero counts: rank 0 keeps 1 row and
    sends 2, rank 1 sends 0 and keeps 3; then nothing at all."""
    r = comm.rank
    rows = torch.arange(3 * 2, dtype=torch.float32).view(3, 2) + 100 * r
    send, recv = ([1, 2], [1, 0]) if r == 0 else ([0, 3], [2, 3])
    out = comm.all_to_all(rows, send, recv)
    empty = comm.all_to_all(torch.empty(0, 2), [0, 0], [0, 0])
    return out, tuple(empty.shape)


def _moe_dispatch(comm):
    """:func:`dispatched_experts` on 2 ranks (experts 0-3 and 4-7 of 8) against one
    process's :func:`fused_experts` over all 8, for token counts that leave rank 1
    no token (1), split unevenly (7) and evenly (32), in float32 and bfloat16; and
    the experts each rank ran."""
    from tandem.engine.model.moe import dispatched_experts, fused_experts, route

    # Both ranks multiply with one thread, as rank 1 does (a GEMM's float32 rounding
    # may depend on how its threads split it).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    e, h, i, k = 8, 16, 24, 2
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(e, 2 * i, h, generator=g) / 4).to(dtype)
        w2 = (torch.randn(e, h, i, generator=g) / 4).to(dtype)
        router = torch.randn(e, h, generator=g).to(dtype)
        for t in (1, 7, 32):
            x = torch.randn(t, h, generator=g).to(dtype)
            weights, ids = route(x @ router.t(), k, True, dtype == torch.float32)
            ran = set()

            def gate_up(expert, rows):
                ran.add(expert)
                return F.linear(rows, w13[expert])

            act = lambda y: F.silu(y[:, :i]) * y[:, i:]          # noqa: E731
            out = dispatched_experts(x, gate_up, lambda ex, y: F.linear(y, w2[ex]), weights,
                                     ids, e, act, comm, [0, 4, 8])
            want = fused_experts(x, lambda ex, y: F.linear(y, w13[ex]),
                                 lambda ex, y: F.linear(y, w2[ex]), weights, ids, e, act)
            results.append((dtype, t, torch.equal(out, want), sorted(ran),
                            sorted(set(ids.flatten().tolist()) & set(range(4 * comm.rank,
                                                                           4 * comm.rank + 4)))))
    torch.set_num_threads(threads)
    ran_1 = comm.gather(torch.tensor([[len(r[3]) for r in results]]), dst=0, dim=0)
    return results, ran_1


SCENARIOS = {f.__name__: f for f in (_mlp, _attention_projections, _embedding, _lm_head,
                                     _fused_checkpoint, _collectives, _all_to_all,
                                     _moe_dispatch)}


def _rank1(port: int) -> None:
    torch.set_num_threads(1)
    store = dist.PrefixStore("layers", dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120)))
    comm = TorchDistributedCommunicator(store, 1, 2, timeout_s=120)
    while (name := comm.broadcast_object(None)) is not None:
        SCENARIOS[name](comm)
    comm.close()


@pytest.fixture(scope="module")
def group():
    """``run(scenario) -> rank 0's result``, both ranks running it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    proc = multiprocessing.get_context("spawn").Process(target=_rank1, args=(store.port,),
                                                        daemon=True)
    proc.start()
    comm = TorchDistributedCommunicator(dist.PrefixStore("layers", store), 0, 2, timeout_s=120)

    def run(scenario):
        comm.broadcast_object(scenario.__name__)
        return scenario(comm)

    yield run
    comm.broadcast_object(None)
    proc.join(30)
    comm.close()
    assert proc.exitcode == 0


def test_column_then_row_parallel_mlp_equals_the_whole(group):
    out, want = group(_mlp)
    assert torch.allclose(out, want, rtol=0, atol=ATOL)


def test_attention_projections_keep_each_ranks_heads(group):
    errors, out, want, heads = group(_attention_projections)
    assert heads == HeadPartition(0, 6, 0, 2)          # rank 0's share of 9 / 3 heads
    assert errors.tolist() == [0.0, 0.0]               # Q, K, V rows, both ranks: exact
    assert torch.allclose(out, want, rtol=0, atol=ATOL)


def test_vocab_parallel_embedding_is_exact(group):
    out, want, shape = group(_embedding)
    assert tuple(shape) == (7, 8)
    assert torch.equal(out, want)                      # one rank's row plus zeros


def test_parallel_lm_head_gathers_whole_logits_on_rank_0(group):
    logits, want, none_elsewhere = group(_lm_head)
    assert logits.shape == (4, 13)
    assert torch.allclose(logits, want, rtol=0, atol=ATOL)
    assert none_elsewhere.tolist() == [0.0, 1.0]       # rank 1 got None


def test_fused_checkpoint_tensor_loads_like_its_parts(group):
    same, shape = group(_fused_checkpoint)
    assert same and tuple(shape) == (6, 6)


def test_collectives(group):
    summed, large_sum_ok, gathered, at_root, small, large_ok = group(_collectives)
    assert summed.tolist() == [3.0, 10.0] and large_sum_ok
    assert gathered.tolist() == [[0.0, 0.5], [1.0, 1.5]]
    assert at_root.tolist() == [[0, 1]]
    assert small == {"step": 3} and large_ok


def test_all_to_all_moves_each_ranks_rows(group):
    out, empty = group(_all_to_all)
    assert out.tolist() == [[0.0, 1.0]]                # its own row 0; rank 1 sent none
    assert empty == (0, 2)


def test_all_to_all_expert_dispatch_is_bit_identical_to_one_rank(group):
    """Tokens sent to their experts' ranks and back: each expert's GEMM sees the rows
    one process gives it, and each token's sum runs in the same order, so the
    output equals one rank's bit for bit (bfloat16 too); a rank runs only its own
    experts, and each of them that any token chose."""
    results, ran_1 = group(_moe_dispatch)
    assert [(dtype, t, same) for dtype, t, same, _, _ in results] == [
        (dtype, t, True) for dtype in (torch.float32, torch.bfloat16) for t in (1, 7, 32)]
    for _, _, _, ran, chosen in results:
        assert ran == chosen                           # rank 0: experts 0-3 that were chosen
    assert ran_1.shape == (2, 6) and ran_1[1].sum() > 0   # rank 1 ran its experts too


def test_a_shard_refuses_a_checkpoint_tensor_of_another_size():
    comm = SingleProcessCommunicator()
    with pytest.raises(WeightLoadError, match="expected 8 along dim 1"):
        RowParallelLinear(8, 4, (0, 8), comm).load_weight("weight", torch.zeros(4, 6), None)
    with pytest.raises(WeightLoadError, match="expected 13 along dim 0"):
        VocabParallelEmbedding(13, 4, comm).load_weight("weight", torch.zeros(12, 4), None)


# -- refusals, and one rank unchanged --------------------------------------------------------

def test_config_refusals_name_tensor_parallel_size():
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size: must be an integer >= 1"):
            EngineConfig(tensor_parallel_size=bad)


def test_moe_config_refusals_name_their_field():
    with pytest.raises(ValueError, match="moe_dispatch: all_to_all .* needs "
                                         "enable_expert_parallel"):
        EngineConfig(tensor_parallel_size=2, moe_dispatch="all_to_all")
    with pytest.raises(ValueError, match="moe_dispatch: expected all_reduce or all_to_all"):
        EngineConfig(moe_dispatch="scatter")
    assert EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True,
                        moe_dispatch="all_to_all").moe_dispatch == "all_to_all"


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_split_experts_keep_their_share_of_every_expert(split):
    """Tensor-parallel experts: a stacked projection keeps features 8..19 of each
    sub-matrix (gate and up rows, or down's input columns) of every expert, whether
    the checkpoint holds the experts stacked whole or one sub-matrix at a time."""
    from tandem.engine.model.moe import StackedExpertWeight

    e, h, i = 4, 6, 24
    sizes, k = ([i, i], h) if split == "rows" else ([h], i)
    full = torch.randn(e, sum(sizes), k)
    whole = StackedExpertWeight(e, k, sizes, partition=(8, 12), split=split)
    whole.load_weight("weight", full, None)
    apart = StackedExpertWeight(e, k, sizes, partition=(8, 12), split=split)
    for x in range(e):
        for j, sub in enumerate(full[x].split(sizes, dim=0)):
            apart.load_weight("weight", sub, x * len(sizes) + j)
    if split == "rows":
        want = torch.cat([full[:, 8:20], full[:, i + 8:i + 20]], dim=1)     # [E, 24, H]
    else:
        want = full[:, :, 8:20]                                              # [E, H, 12]
    assert torch.equal(whole.weight, want) and torch.equal(apart.weight, want)


def test_a_class_that_does_not_shard_is_refused_by_name(f32_weights):
    """Every registered architecture shards now; a class that says it does not
    (``supports_tensor_parallel`` False) is refused before any layer is built."""
    import dataclasses

    from tandem.engine.model.llama import LlamaForCausalLM

    class UnshardedLlama(LlamaForCausalLM):
        supports_tensor_parallel = False

    cfg = dataclasses.replace(f32_weights.engine.model_config, num_layers=1)
    with torch.device("meta"), pytest.raises(NotImplementedError,
                                             match="tensor_parallel_size 1: not implemented "
                                                   "for UnshardedLlama"):
        UnshardedLlama(cfg, comm=SingleProcessCommunicator())


def test_one_rank_builds_the_plain_layers(f32_weights):
    engine = f32_weights.engine
    assert engine.config.tensor_parallel_size == 1 and engine.parallel is None
    assert type(engine.runner) is ModelRunner
    model = engine.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert {type(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj,
                              model.lm_head)} == {Linear}
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert not model._forward_pre_hooks and not model.lm_head._forward_pre_hooks
    assert (attn.num_heads, attn.num_kv_heads) == (9, 3)


# -- whole engines -------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colors:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2():
    """The default model, float32, on 2 ranks (12 blocks of 16 tokens per rank)."""
    llm = LLM(dtype="float32", tensor_parallel_size=2, num_blocks=12, preemption_mode="swap",
              num_host_blocks=32)
    yield llm
    llm.shutdown()
    assert llm.engine.parallel.worker_exit_codes == [0]


@pytest.fixture(scope="module")
def tp1(f32_weights):
    return LLM(dtype="float32", num_blocks=12, preemption_mode="swap", num_host_blocks=32,
               weights_from=f32_weights)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_rank_cpu_sets_cut_the_affinity_into_disjoint_parts():
    from tandem.engine.parallel.group import rank_cpu_sets

    cores = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cores[:1])          # fewer cores than ranks: shared
        assert rank_cpu_sets(2, "cpu") is None
        assert rank_cpu_sets(1, "cpu") == [(cores[0],)]
    finally:
        os.sched_setaffinity(0, cores)
    assert rank_cpu_sets(2, "cuda") is None
    if len(cores) >= 2:
        per = len(cores) // 2
        assert rank_cpu_sets(2, "cpu") == [tuple(cores[:per]), tuple(cores[per:2 * per])]


def test_tp2_rank_1_runs_on_its_own_cores(tp2):
    from tandem.engine.parallel.group import rank_cpu_sets

    (proc,) = tp2.engine.parallel._procs
    sets = rank_cpu_sets(2, "cpu")
    if sets is None:
        pytest.skip("fewer cores than ranks: the ranks share them")
    assert os.sched_getaffinity(proc.pid) == set(sets[1])


def test_tp2_greedy_tokens_equal_tp1_on_the_default_model(tp2, tp1):
    # rank 0 holds 2 of the 3 KV heads: its blocks are [L, 2, NB, BS, 2, D]
    assert tuple(tp2.engine.kv_cache.tensor.shape) == (30, 2, 12, 16, 2, 64)
    assert tp2.engine.runner.sampler is not None and tp2.engine.parallel.world_size == 2
    want = _ids(tp1.generate(PROMPTS, GREEDY))
    assert want[0][:8] == [7042, 30, 198, 198, 504, 2988, 314, 42]
    assert _ids(tp2.generate(PROMPTS, GREEDY)) == want
    kv = tp2.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_tp2_under_kv_pressure_swaps_on_every_rank(tp2, tp1):
    """Seven prompts need 21 blocks of the 12: requests are swapped out and back in
    (block operations broadcast to rank 1's cache) and still give TP=1's tokens."""
    prompts = PROMPTS + ["Water boils at", "import numpy as np", "My favourite food is"]
    want = _ids(tp1.generate(prompts, GREEDY))
    swaps = tp2.engine.scheduler.num_swap_preemptions
    assert _ids(tp2.generate(prompts, GREEDY)) == want
    assert tp2.engine.scheduler.num_swap_preemptions > swaps
    assert tp2.engine.scheduler.num_swap_preemptions - swaps == \
        tp1.engine.scheduler.num_swap_preemptions


def test_tp2_samples_forks_and_prompt_logprobs_like_tp1(tp2, tp1):
    """Seeded sampling of two forks sharing the prompt's blocks, and prompt logprobs
    (their logits computed in their own LM-head calls): TP=1's tokens, and its
    logprobs within float32 rounding of the sharded sums."""
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, prompt_logprobs=2)
    want, got = tp1.generate(PROMPTS[:2], params), tp2.generate(PROMPTS[:2], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    for o, w in zip(got, want):
        assert o.prompt_logprobs[0] is None
        for a, b in zip(o.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4


TINY = {
    # biases on all four attention projections, one KV head held by both ranks, and
    # 509 vocabulary rows (255 + 254 and a padding row); the head untied
    "llama": ("LlamaConfig", {"attention_bias": True, "num_key_value_heads": 1,
                              "vocab_size": 509}, (2, 1)),
    # a 24-token sliding window (shorter than the 40- and 70-token prompts); the two
    # KV heads split, one per rank
    "mistral-window": ("MistralConfig", {"sliding_window": 24, "vocab_size": 509}, (2, 1)),
}


@pytest.mark.parametrize("case", sorted(TINY))
def test_tiny_checkpoints_tp2_equal_transformers(case, tmp_path):
    """Tiny checkpoints transformers wrote (:data:`TINY`), against its greedy tokens,
    with chunked prefill (32-token steps) and the prefix cache on the second pass."""
    from tests.models.conftest import hf_greedy, save_tiny_checkpoint

    config_class, overrides, heads = TINY[case]
    hf = save_tiny_checkpoint(tmp_path, config_class, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 509) for _ in range(n)] for n in (5, 40, 70)]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_blocks=64,
              max_num_batched_tokens=32)
    try:
        attn = llm.engine.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == heads
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for cached in (False, True):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert _ids(outs) == want
            assert [o.num_cached_tokens for o in outs] == ([0, 32, 64] if cached else [0, 0, 0])
        # A step that raises on rank 0 (here: a request holding no blocks) may leave
        # the other rank inside its collectives: every later step is refused.
        from tandem.engine.scheduling.request import Request
        from tandem.engine.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput

        stray = Request("stray", [5, 6, 7], params)
        with pytest.raises(IndexError):
            llm.engine.runner.execute(SchedulerOutput([ScheduledRequest(stray, 0, 3)]))
        with pytest.raises(RuntimeError, match="out of step, build a new engine"):
            llm.generate([{"prompt_token_ids": prompts[0]}], params)
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.shutdown()
    assert llm.engine.parallel.worker_exit_codes == [0]
