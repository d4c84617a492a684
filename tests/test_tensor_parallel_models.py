"""Tensor parallelism across architectures and weight formats: ``LLM(tensor_parallel_size=2)``
on tiny checkpoints transformers wrote gives its greedy tokens in float32 (and so one
rank's, which ``tests/models/test_architectures.py`` checks against the same reference)
for Qwen2 (Q/K/V biases, sliding layers), Qwen3 (per-head Q/K norms, one KV head held
by both ranks), Gemma 2 and 3 (embedding scale, ``(1 + w)`` and sandwich norms, GeGLU,
soft-capping, sliding and global layers), Phi-3 (fused ``qkv_proj`` and
``gate_up_proj`` cut per rank, ``longrope``) and mixture-of-experts Mixtral,
Qwen2-MoE and Qwen3-MoE (experts spread over the ranks); each with chunked prefill and, on a
second pass, prefix-cache hits.

Quantized weights shard by whole packed words, groups and blocks: each format's
rank slice against the whole layer (exact, one process), then whole engines (the
default model's GGUF blocks, tiny GPTQ and AWQ checkpoints) against one rank: the
same greedy tokens, each rank's bytes exactly one rank's cut, logprobs within the
float32 summation order of the row-parallel sums; quantized MoE experts (GPTQ, AWQ,
GGUF) spread over the ranks likewise. Last, other features on 2 ranks against one
rank: n-gram speculative decoding (the default model, whose copying the drafts need);
on a tiny random Llama with the default model's attention shape, draft-model
speculative decoding and fp8 and int4 KV caches (each rank's own heads' scales and
open-block K store) under swaps, forks and prefix hits.
"""

from __future__ import annotations

import json

import random

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams
from tests.models.test_architectures import CASES

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _prompts(vocab: int = 512) -> list[list[int]]:
    """5, 40 and 70 tokens: within one 16-token block, and across 3 and 5 blocks."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 40, 70)]


def save_tiny_kv_checkpoint(path) -> str:
    """A tiny random Llama (tests/models/conftest.py) with the default model's attention
    shape, for the KV cache tests: head_dim 64, 9 query heads on 3 KV heads (2 ranks
    hold KV heads 0-1 and 2), hidden 576 and FFN 1536 as the default model's, but 2
    layers and a vocabulary of 512. Its tokenizer gives one token per character (code
    points 3..511, others ``<unk>``), so that the fp8 calibration text reads as the
    ~780 varied tokens it is, not as one repeated ``<unk>``; and each layer's KV heads
    have their K and V projections scaled apart (x1/4, x1, x4, in another order per
    layer and for V), so that every (layer, K/V, head) calibrates a scale of its own.
    Returns the directory."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.models.conftest import VOCAB, save_tiny_checkpoint

    model = save_tiny_checkpoint(path, "LlamaConfig", hidden_size=576, intermediate_size=1536,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                 max_position_embeddings=1024)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj)):
                for h, w in enumerate(proj.weight.view(3, 64, -1)):
                    w *= 4.0 ** ((h + i + j) % 3 - 1)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chr(i): i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory) -> str:
    """:func:`save_tiny_kv_checkpoint`, written once for the module."""
    return save_tiny_kv_checkpoint(tmp_path_factory.mktemp("tiny-kv"))


# case -> (transformers config class, overrides of tests/models/conftest.py's BASE
# (4 query heads, 2 KV heads, head_dim 16, hidden 64, FFN 128, 2 layers, vocab 512),
# (query heads, KV heads) on rank 0)
ARCHITECTURES = {
    # biases on Q, K, V split with their rows; layer 1 slides (window 20)
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 20,
                                     "max_window_layers": 1}, (2, 1)),
    # per-head Q/K norms; one KV head, held by both ranks (each with 2 query heads);
    # biases on all four projections
    "qwen3-one-kv-head": ("Qwen3Config", {"num_key_value_heads": 1, "attention_bias": True},
                          (2, 1)),
    # sliding layer 0 (window 24) and global layer 1, attention and final soft-caps,
    # a query scalar unlike head_dim, (1 + w) sandwich norms, GeGLU, sqrt(H) embeddings;
    # the head tied to the embedding (one vocabulary shard for both)
    "gemma2": ("Gemma2Config", {"sliding_window": 24, "query_pre_attn_scalar": 32,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                                "tie_word_embeddings": True}, (2, 1)),
    # Gemma 2's layout plus (1 + w) per-head Q/K norms, a local RoPE base on the
    # sliding layer and linear scaling on the global one
    "gemma3": (*CASES["gemma3"][:2], (2, 1)),
    # fused qkv_proj [Q; K; V] and gate_up_proj [gate; up] in the checkpoint; longrope
    # with an original context of 32 (the 40- and 70-token prompts read the long factors,
    # which every rank decides from the broadcast prompt lengths)
    "phi3-longrope": (*CASES["phi3-longrope"][:2], (2, 1)),
    # mixture of experts: every expert split over the ranks (its FFN width; ":ep"
    # below spreads the 8 experts, 4 each); Mixtral renormalises top-2 in float32
    "mixtral": (*CASES["mixtral"][:2], (2, 1)),
    # Qwen2-MoE: no renormalisation, a shared expert (tensor-parallel) with its
    # sigmoid gate, Q/K/V biases
    "qwen2-moe": (*CASES["qwen2-moe"][:2], (2, 1)),
    # Qwen3-MoE: renormalised top-2, per-head Q/K norms, layer 0 dense (mlp_only_layers:
    # a tensor-parallel GatedMLP beside layer 1's spread experts)
    "qwen3-moe": (*CASES["qwen3-moe"][:2], (2, 1)),
}


@pytest.mark.parametrize("case", sorted(ARCHITECTURES) + [
    "mixtral:ep", "qwen3-moe:ep", "mixtral:ep:all_to_all", "qwen2-moe:ep:all_to_all"])
def test_architectures_tp2_equal_transformers(case, tmp_path):
    """Chunked prefill (32-token steps) on the first pass, the prompts' full blocks
    from the prefix cache on the second; transformers' greedy tokens both times.
    MoE: by default every expert splits its FFN width over the ranks; ``:ep``
    spreads whole experts (``enable_expert_parallel``), and ``:all_to_all`` then
    meets the tokens through the all-to-all dispatch (``moe_dispatch``), two
    all-to-alls and one all-gather per sparse layer and forward pass, and no
    all-reduce of the routed experts."""
    from tests.models.conftest import hf_greedy, save_tiny_checkpoint

    case, *modes = case.split(":")
    dispatch = "all_to_all" if "all_to_all" in modes else ""
    config_class, overrides, heads = ARCHITECTURES[case]
    hf = save_tiny_checkpoint(tmp_path, config_class, **overrides)
    want = [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_blocks=64,
              max_num_batched_tokens=32, enable_expert_parallel="ep" in modes,
              moe_dispatch=dispatch or "all_reduce")
    try:
        comm = llm.engine.parallel.comm
        before = dict(comm.calls)
        attn = llm.engine.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == heads
        mlp = llm.engine.model.model.layers[-1].mlp
        if hasattr(mlp, "local_experts"):
            held = (len(mlp._packed[0]) if mlp._packed is not None
                    else mlp.experts.gate_up_proj.weight.shape[0])
            if "ep" in modes:                       # rank 0 holds experts 0-3 of 8
                assert (mlp.local_experts, held, mlp.partition) == (range(0, 4), 4, None)
            else:                                   # every expert's features 0..I/2-1
                i = llm.engine.model_config.moe.moe_intermediate_size
                assert (mlp.local_experts, held, mlp.partition) == (range(0, 8), 8,
                                                                    (0, i // 2))
        for cached in (False, True):
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY)
            assert _ids(outs) == want
            assert [o.num_cached_tokens for o in outs] == ([0, 32, 64] if cached else [0, 0, 0])
        calls = {kind: n - before.get(kind, 0) for kind, n in comm.calls.items()}
        if dispatch:
            # Per forward pass: the vocabulary-parallel embedding's all-reduce, one
            # per attention block and one per shared expert; none for the routed
            # experts.
            layers = llm.engine.model.model.layers
            sparse = sum(hasattr(layer.mlp, "local_experts") for layer in layers)
            shared = sum(getattr(layer.mlp, "shared_expert", None) is not None
                         for layer in layers)
            forwards = calls["all_to_all"] // (2 * sparse)
            assert forwards > 0 and calls["all_to_all"] == 2 * sparse * forwards
            assert calls["all_reduce"] == (1 + len(layers) + shared) * forwards
        else:
            assert calls.get("all_to_all", 0) == 0
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.shutdown()
    assert llm.engine.parallel.worker_exit_codes == [0]


# -- quantized layers: each rank keeps whole packed words, groups and blocks -------------------
#
# A single-process communicator (world size 1) lets a layer take any partition: the
# rank's slice of the full checkpoint tensors, loaded and processed, must hold exactly
# the full layer's weights of its rows or columns.

def _gptq_tensors(n: int, k: int, group_size: int) -> tuple[dict, torch.Tensor]:
    """RTN-quantized GPTQ tensors of a random ``[n, k]`` weight, and its dequantization."""
    from tandem.quantize.rtn import quantize_rtn

    q = quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)),
                     bits=4, group_size=group_size)
    return q.pack(), q.dequantize()


def _gptq_layer(cls_args, tensors, group_size, shard_ids=(None,)):
    from tandem.engine.quantization.gptq_linear import GPTQLinearMethod

    cls, args = cls_args
    layer = cls(*args, quant_method=GPTQLinearMethod(group_size=group_size),
                params_dtype=torch.float32)
    for sid, parts in zip(shard_ids, tensors):
        for leaf, t in parts.items():
            layer.load_weight(leaf, t, sid)
    layer.process_weights_after_loading()
    return layer


def test_gptq_row_parallel_keeps_whole_groups():
    """``down_proj``-like ``[64, 128]`` in groups of 32: columns 32..95 (two groups)
    on this rank hold exactly the full weight's columns, still as INT4_ZP blocks."""
    from tandem.engine.model.weights import WeightLoadError
    from tandem.engine.parallel.communicator import SingleProcessCommunicator
    from tandem.engine.parallel.layers import RowParallelLinear

    comm = SingleProcessCommunicator()
    packed, dense = _gptq_tensors(64, 128, 32)
    layer = _gptq_layer((RowParallelLinear, (128, 64, (32, 64), comm)), [packed], 32)
    assert layer.int4_blocks is not None and tuple(layer.int4_blocks.shape) == (64, 2 * 19)
    w = layer.quant_method.dequantized_weight(layer)
    assert torch.equal(w, dense[:, 32:96])
    with pytest.raises(WeightLoadError, match=r"input columns \[16, 48\) of 128 do not fall"):
        _gptq_layer((RowParallelLinear, (128, 64, (16, 32), comm)), [packed], 32)


def test_gptq_column_parallel_keeps_whole_packed_columns():
    """A fused ``[q, k, v]`` = ``[32, 16, 16]`` layer: rows 16..31 of Q and 8..15 of K
    and V (words of 8 outputs)."""
    from tandem.engine.parallel.layers import ColumnParallelLinear

    parts = [_gptq_tensors(n, 64, 32) for n in (32, 16, 16)]
    layer = _gptq_layer((ColumnParallelLinear, (64, [32, 16, 16], [(16, 16), (8, 8), (8, 8)])),
                        [p for p, _ in parts], 32, shard_ids=(0, 1, 2))
    w = layer.quant_method.dequantized_weight(layer)
    assert torch.equal(w, torch.cat([parts[0][1][16:32], parts[1][1][8:16],
                                     parts[2][1][8:16]]))


def _act_order_gptq(n: int, k: int, group_size: int, seed: int = 5, scale: float = 0.05,
                    order_seed: int = 5):
    """A GPTQ weight ``[n, k]`` quantized in act-order: each input column's group is
    its rank in a random order of the columns (``g_idx`` permuted; the order from
    ``order_seed``: layers that share an input share it); codes, zeros and scales
    (about ``scale``) random."""
    from tandem.engine.quantization.packing import QuantizedWeight

    order = torch.randperm(k, generator=torch.Generator().manual_seed(order_seed))
    g_idx = (torch.argsort(order) // group_size).to(torch.int32)
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    return QuantizedWeight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                           torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.uint8),
                           (torch.rand(groups, n, generator=gen) * scale + scale / 2).half(),
                           g_idx, 4, group_size, desc_act=True)


def test_gptq_act_order_row_parallel_keeps_its_columns_and_every_group():
    """``down_proj``-like ``[64, 128]`` in act-order groups of 32: the rank's columns
    32..95 read groups anywhere, so it keeps their ``g_idx`` ids and every group's
    scales and zeros, and holds exactly the full weight's columns; the whole layer
    (one rank) stays INT4_ZP blocks."""
    from tandem.engine.parallel.communicator import SingleProcessCommunicator
    from tandem.engine.parallel.layers import RowParallelLinear
    from tandem.engine.quantization.gptq_linear import GPTQLinearMethod

    q = _act_order_gptq(64, 128, 32)
    packed, dense = q.pack(), q.dequantize()
    assert len(set(q.g_idx[32:96].tolist())) == 4              # the slice reads every group
    for partition, want in (((32, 64), dense[:, 32:96]), ((0, 128), dense)):
        layer = RowParallelLinear(128, 64, partition, SingleProcessCommunicator(),
                                  quant_method=GPTQLinearMethod(group_size=32, desc_act=True),
                                  params_dtype=torch.float32)
        for leaf, t in packed.items():
            layer.load_weight(leaf, t, None)
        layer.process_weights_after_loading()
        assert torch.equal(layer.quant_method.dequantized_weight(layer), want)
        x = torch.randn(3, partition[1], generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    assert layer.int4_blocks is not None and layer.int4_perm is not None


def test_awq_row_and_column_parallel_keep_whole_groups_and_words():
    from tandem.engine.parallel.communicator import SingleProcessCommunicator
    from tandem.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from tandem.engine.quantization.awq_linear import AWQLinearMethod, pack_int4
    from tandem.quantize.rtn import quantize_rtn

    q = quantize_rtn(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)),
                     bits=4, group_size=32)
    tensors = {"qweight": pack_int4(q.codes.t()), "qzeros": pack_int4(q.zeros),
               "scales": q.scales}
    dense = q.dequantize()
    for layer, want in (
            (RowParallelLinear(128, 64, (64, 64), SingleProcessCommunicator(),
                               quant_method=AWQLinearMethod(32), params_dtype=torch.float32),
             dense[:, 64:]),
            (ColumnParallelLinear(128, 64, [(24, 16)], quant_method=AWQLinearMethod(32),
                                  params_dtype=torch.float32), dense[24:40])):
        for leaf, t in tensors.items():
            layer.load_weight(leaf, t.contiguous(), None)
        layer.process_weights_after_loading()
        assert layer.int4_blocks is not None
        assert torch.equal(layer.quant_method.dequantized_weight(layer), want)


@pytest.mark.parametrize("qtype_name, start, size", [("Q4_1", 64, 128), ("Q4_K", 256, 256)])
def test_gguf_row_parallel_keeps_whole_blocks(qtype_name, start, size):
    """A row of 512 weights in Q4_1 (32-weight blocks) or Q4_K (256-weight super-blocks):
    the rank's bytes are its blocks, and decode to exactly the full row's columns;
    a slice inside a block is refused naming the block."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from tandem.engine.model.weights import WeightLoadError
    from tandem.engine.parallel.communicator import SingleProcessCommunicator
    from tandem.engine.parallel.layers import RowParallelLinear
    from tandem.engine.quantization.gguf_linear import GGUFLinearMethod, dequantize_rows

    qtype = GGMLQuantizationType[qtype_name]
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    if qtype_name == "Q4_K":           # gguf's Python package has no Q4_K quantizer
        from tandem.quantize.kquants import quantize_q4_k

        rows = torch.from_numpy(quantize_q4_k(w))
    else:
        rows = torch.from_numpy(quantize(w, qtype))
    full = dequantize_rows(rows, int(qtype), 512)

    def load(part):
        layer = RowParallelLinear(512, 16, part, SingleProcessCommunicator(),
                                  quant_method=GGUFLinearMethod(), params_dtype=torch.float32)
        layer.load_weight("qweight", rows, None)
        layer.load_weight("qweight_type", torch.tensor(int(qtype)), None)
        return layer

    layer = load((start, size))
    got = dequantize_rows(layer.gguf_shards[None], int(qtype), size)
    assert torch.equal(got, full[:, start:start + size])
    with pytest.raises(WeightLoadError, match=f"whole {256 if qtype_name == 'Q4_K' else 32}-"
                                              f"weight {qtype_name} blocks"):
        load((start + 16, size - 16))


# -- whole engines: quantized weights with 2 ranks ---------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colors:"]


def _logprob_gap(a, b) -> float:
    return max(abs(x.logprob - y.logprob)
               for oa, ob in zip(a, b) for x, y in zip(oa.outputs[0].logprobs,
                                                       ob.outputs[0].logprobs))


def test_default_model_gguf_blocks_tp2_equal_tp1():
    """The default model's GGUF (Q4_1 matrices, a Q8_0 embedding tied to the head)
    kept in its blocks (``quantization="gguf"``) on 2 ranks: every rank holds whole
    blocks of its rows / columns (rank 0's bytes are exactly one rank's, cut), and the
    greedy tokens are one rank's; the logprobs differ by the float32 order of the
    row-parallel sums only."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    tp1 = LLM(dtype="float32", quantization="gguf", num_blocks=64)
    want = tp1.generate(PROMPTS, params)
    tp2 = LLM(dtype="float32", quantization="gguf", tensor_parallel_size=2, num_blocks=64)
    try:
        got = tp2.generate(PROMPTS, params)
        assert _ids(got) == _ids(want)
        assert _ids(want)[0][:8] == [7042, 30, 198, 198, 504, 2988, 314, 42]
        assert _logprob_gap(got, want) < 1e-4
        one, two = tp1.engine.model, tp2.engine.model
        a1, a2 = one.model.layers[0].self_attn, two.model.layers[0].self_attn
        # o_proj: rank 0's 6 query heads = input columns 0..383, 12 Q4_1 blocks of 20 bytes
        assert a2.o_proj.qtype == a1.o_proj.qtype
        assert torch.equal(a2.o_proj.qweight, a1.o_proj.qweight[:, :384 // 32 * 20])
        # qkv_proj: rank 0's Q rows 0..383 and K, V rows 0..127 (KV heads 0-1)
        q1, k1, v1 = a1.qkv_proj.qweight.split([576, 192, 192])
        assert torch.equal(a2.qkv_proj.qweight, torch.cat([q1[:384], k1[:128], v1[:128]]))
        # the embedding and the tied head: vocabulary rows 0..24575 in Q8_0, one tensor
        emb, head = two.model.embed_tokens, two.lm_head
        assert head.qweight.data_ptr() == emb.qweight.data_ptr()
        assert torch.equal(emb.qweight, one.model.embed_tokens.qweight[:24576])
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


def _tp2_equals_tp1(path, **kw) -> tuple[LLM, LLM]:
    """One rank and two on checkpoint ``path`` (float32, ``kw`` for both): the same
    greedy tokens for :func:`_prompts`, prompt logprobs within float32 summation
    order (1e-4). Returns both engines; the caller shuts the two-rank one down."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    tp1 = LLM(path, dtype="float32", num_blocks=64, **kw)
    want = tp1.generate(prompts, params)
    tp2 = LLM(path, dtype="float32", tensor_parallel_size=2, num_blocks=64,
              max_num_batched_tokens=32, **kw)
    try:
        got = tp2.generate(prompts, params)
        assert _ids(got) == _ids(want)
        for o, w in zip(got, want):
            assert max(abs(a.logprob - b.logprob) for a, b in
                       zip(o.prompt_logprobs[1:], w.prompt_logprobs[1:])) < 1e-4
    except BaseException:
        tp2.shutdown()
        raise
    return tp1, tp2


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_checkpoint_tp2_equals_tp1(method, tmp_path):
    """A tiny Llama whose attention and MLP linears are 4-bit in groups of 32 (GPTQ v1
    or AWQ gemm layout): on 2 ranks every projection keeps INT4_ZP blocks of whole
    groups (rank 0's down_proj: input columns 0..63, exactly one rank's blocks cut),
    and the greedy tokens are one rank's, prompt logprobs within float32 summation
    order."""
    from tests.models.test_quantized_experts import _int4_checkpoints

    int4_dir, _, _ = _int4_checkpoints(tmp_path, "llama", method)
    tp1, tp2 = _tp2_equals_tp1(int4_dir)
    try:
        down1 = tp1.engine.model.model.layers[0].mlp.down_proj
        down2 = tp2.engine.model.model.layers[0].mlp.down_proj
        assert down2.quant_method.name == method and down2.partition == (0, 64)
        assert torch.equal(down2.int4_blocks, down1.int4_blocks[:, :64 // 32 * 19])
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


def _act_order_checkpoint(path) -> str:
    """A tiny Llama (transformers' ``save_pretrained``) whose decoder linears are
    4-bit GPTQ in act-order groups of 32 (:func:`_act_order_gptq`, scales near the
    dense weights' magnitude): the checkpoint directory."""
    from safetensors.torch import load_file, save_file

    from tests.models.conftest import save_tiny_checkpoint

    config_class, overrides, _ = CASES["llama"]
    save_tiny_checkpoint(path / "hf", config_class, **overrides)
    state = load_file(str(path / "hf" / "model.safetensors"))
    out = {}
    for seed, (name, w) in enumerate(state.items()):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith("_proj"):
            out[name] = w
            continue
        # q/k/v and gate/up share their input, so their act-order (one g_idx)
        shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace(
            "up_proj", "gate_proj")
        q = _act_order_gptq(*w.shape, 32, seed=seed, scale=float(w.std()) / 4,
                            order_seed=sum(map(ord, shared)))
        out |= {f"{module}.{k}": v.contiguous() for k, v in q.pack().items()}
    config = json.loads((path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                     "desc_act": True}
    (path / "gptq").mkdir()
    save_file(out, str(path / "gptq" / "model.safetensors"), metadata={"format": "pt"})
    (path / "gptq" / "config.json").write_text(json.dumps(config))
    for f in (path / "hf").glob("*token*"):
        (path / "gptq" / f.name).write_bytes(f.read_bytes())
    return str(path / "gptq")


def test_gptq_act_order_checkpoint_tp2_equals_tp1(tmp_path):
    """A tiny Llama whose linears are GPTQ in act-order: on 2 ranks each row-parallel
    layer keeps its input columns' codes and ``g_idx`` (ids unchanged) and every
    group's scales, and the greedy tokens are one rank's, prompt logprobs within
    float32 summation order."""
    tp1, tp2 = _tp2_equals_tp1(_act_order_checkpoint(tmp_path))
    try:
        down1 = tp1.engine.model.model.layers[0].mlp.down_proj
        down2 = tp2.engine.model.model.layers[0].mlp.down_proj
        k = down2.partition[1]
        assert down2.partition[0] == 0 and k < down1.in_features
        assert torch.equal(down2.g_idx, down1.g_idx[:k])       # ids kept, not renumbered
        assert torch.equal(down2.quant_method.dequantized_weight(down2),
                           down1.quant_method.dequantized_weight(down1)[:, :k])
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


# -- other features with 2 ranks -----------------------------------------------------------------

def test_ngram_speculative_decoding_tp2_equals_tp1(f32_weights):
    """Prompt-lookup drafts verified on 2 ranks (several rows per request through the
    sharded LM head): the greedy tokens of one rank without speculation, with drafts
    accepted on the copy prompt."""
    passage = ("The river runs past the old mill, under the stone bridge and into the lake, "
               "where the fishermen wait for the morning mist to lift before they row out.")
    prompts = [f"Repeat this sentence word for word.\n\nSentence: {passage}\n\nRepeated: ",
               "List three facts about the moon."]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = _ids(LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
                .generate(prompts, params))
    tp2 = LLM(dtype="float32", tensor_parallel_size=2, num_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    try:
        assert _ids(tp2.generate(prompts, params)) == want
        st = tp2.engine.scheduler.spec_stats
        assert st.num_drafts > 0 and st.num_accepted_tokens >= 16
        kv = tp2.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


def test_draft_model_speculative_decoding_tp2_equals_tp1(tiny_kv):
    """A draft model (the target's own file: self-drafting) on a sharded target, a tiny
    random Llama with 3 KV heads (:func:`save_tiny_kv_checkpoint`): the draft runs
    whole on rank 0 in its own cache (a copy of the weights, not the shard), the
    verification through the sharded runner; greedy and seeded tokens are one rank's
    with the same draft, and the greedy ones one rank's without drafts."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    plain = LLM(tiny_kv, dtype="float32", num_blocks=64)
    tp1 = LLM(tiny_kv, dtype="float32", num_blocks=64, weights_from=plain,
              speculative_config=spec)
    want, want_seeded = _ids(tp1.generate(prompts, greedy)), _ids(tp1.generate(prompts, seeded))
    assert want == _ids(plain.generate(prompts, greedy))             # one rank's, no drafts
    tp2 = LLM(tiny_kv, dtype="float32", tensor_parallel_size=2, num_blocks=64,
              speculative_config=spec)
    try:
        proposer = tp2.engine.proposer
        assert proposer.self_draft and proposer.model is not tp2.engine.model
        assert proposer.model.model.layers[0].self_attn.num_kv_heads == 3     # whole
        assert _ids(tp2.generate(prompts, greedy)) == want
        st = tp2.engine.scheduler.spec_stats
        # self-drafting in greedy: every draft is the target's own argmax
        assert st.num_drafts > 0 and st.num_accepted_tokens >= 0.9 * st.num_draft_tokens
        assert _ids(tp2.generate(prompts, seeded)) == want_seeded
        kv = tp2.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


# -- quantized KV caches with 2 ranks: each rank's own heads ---------------------------------------
#
# A quantized cache turns the last-bit differences of the row-parallel sums into a whole
# quantization step wherever a value sits at a rounding boundary, and that difference
# then spreads through the later layers (on the default model, fp8, "Water boils at":
# rank 0's codes equal one rank's up to layer 14, then 593 of 23,039 differ). So the
# tokens may part from one rank's, but only at a near tie of one rank's own distribution
# (there: top-2 logprobs -1.146 and -1.157 at token 4), as int4's do with one rank when
# only the batch changes. That is what the tests check, for every prompt: the same
# tokens up to where they part, and there one rank's best two within NEAR_TIE; and most
# prompts the same throughout. They run the tiny random Llama of
# :func:`save_tiny_kv_checkpoint` (the default model's 3 KV heads, 0-1 on rank 0, each
# (layer, K/V, head) with an fp8 scale of its own; one token per character).

NEAR_TIE = 0.25
"""Largest gap (nats) between one rank's best two logprobs where two ranks' greedy
tokens may part with a quantized KV cache; a wrong shard parts far from any tie."""

KV_PROMPTS = PROMPTS + ["Water boils at", "import numpy as np", "My favourite food is"]


def _kv_engines(path: str, kv_cache_dtype: str):
    """One rank and two on checkpoint ``path`` in float32 with a quantized KV cache of
    12 blocks (the 7 prompts, a token per character, need about 25: swap preemptions)
    and swap space."""
    kw = dict(dtype="float32", num_blocks=12, preemption_mode="swap", num_host_blocks=32,
              kv_cache_dtype=kv_cache_dtype)
    return LLM(path, **kw), LLM(path, tensor_parallel_size=2, **kw)


def _kv_runs(tp1, tp2, forks: list[int], min_same: int):
    """Greedy under KV pressure (swaps): every prompt gives one rank's 32 tokens up to
    where they part, only ever at a near tie, and ``min_same`` prompts all 32 (int4's
    coarse steps meet more ties than fp8's); then seeded forks
    of prompts ``forks`` (copy-on-write of the prompt's open last block, full blocks
    from the prefix cache) give one rank's first samples."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, ignore_eos=True)
    swaps = tp2.engine.scheduler.num_swap_preemptions
    want, got = tp1.generate(KV_PROMPTS, greedy), _ids(tp2.generate(KV_PROMPTS, greedy))
    assert tp2.engine.scheduler.num_swap_preemptions > swaps
    same = 0
    for i, (out, tokens) in enumerate(zip(want, got)):
        one = out.outputs[0]
        if tokens == one.token_ids:
            same += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(tokens, one.token_ids)) if a != b)
        (_, best), (_, second) = one.logprobs[k].top[:2]
        assert best - second < NEAR_TIE, (
            f"prompt {i} parts from one rank's tokens at token {k}, where one rank's best "
            f"two logprobs are {best:.3f} and {second:.3f}: not a near tie")
    assert same >= min_same, f"only {same} of {len(KV_PROMPTS)} prompts equal"
    prompts = [KV_PROMPTS[i] for i in forks]
    assert [[c.token_ids[:4] for c in o.outputs] for o in tp2.generate(prompts, seeded)] == \
        [[c.token_ids[:4] for c in o.outputs] for o in tp1.generate(prompts, seeded)]
    kv = tp2.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_fp8_kv_cache_tp2_equals_tp1(tiny_kv):
    """fp8 (e4m3) KV cache on 2 ranks: each rank calibrates with the others (the
    sharded forward's all-reduces) and keeps its own heads' scales, rank 0's exactly
    one rank's scales of KV heads 0-1; the tokens are one rank's (see above)."""
    tp1, tp2 = _kv_engines(tiny_kv, "fp8_e4m3")
    try:
        assert tp2.engine.kv_cache.tensor.dtype == torch.float8_e4m3fn
        assert tuple(tp2.engine.kv_cache.scales.shape) == (2, 2, 2)
        assert torch.equal(tp2.engine.kv_cache.scales, tp1.engine.kv_cache.scales[:, :, :2])
        _kv_runs(tp1, tp2, forks=[0, 6], min_same=len(KV_PROMPTS) // 2 + 1)
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


def test_int4_kv_cache_tp2_equals_tp1(tiny_kv):
    """int4 KV cache on 2 ranks: each rank packs its own heads' rows and keeps its
    own open-block K store, whose entries follow rank 0's (the block pool's calls
    replayed; rank 1 recomputes each step's write plan and raises unless it is rank
    0's) through swaps, copy-on-write and prefix hits; the tokens are one rank's
    (see above)."""
    tp1, tp2 = _kv_engines(tiny_kv, "int4")
    try:
        assert tp2.engine.kv_cache.open_keys.shape[3] == 2          # rank 0's 2 KV heads
        _kv_runs(tp1, tp2, forks=[4, 5], min_same=1)
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]


# -- quantized experts spread over the ranks (expert parallelism) ---------------------------------

@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp-experts"])
@pytest.mark.parametrize("case", ["mixtral-gptq", "mixtral-awq", "mixtral-gguf-q4_0"])
def test_quantized_experts_tp2_equal_tp1(case, expert_parallel, tmp_path):
    """A tiny Mixtral whose experts stay quantized (GPTQ / AWQ INT4_ZP blocks in groups
    of 32, a GGUF file's Q4_0 blocks). Expert parallel: rank 0 holds experts 0-3 of
    8, each exactly one rank's layer of that expert (the others' places empty).
    Tensor-parallel experts: rank 0 holds features 0-63 of every expert's 128, in
    whole groups / blocks. Either way the greedy tokens are one rank's, prompt
    logprobs within float32 summation order."""
    from tandem.kernels.cpu.gguf_linear import gguf_kernels_available
    from tests.models.test_quantized_experts import (GGUF_CASES, _int4_checkpoints,
                                                      quantize_gguf)

    if not gguf_kernels_available():
        pytest.skip("compiled CPU kernels unavailable")
    if case.endswith("gguf-q4_0"):
        from tests.models.conftest import save_tiny_checkpoint
        from tests.models.gguf_files import write_gguf

        (config_class, overrides, _), qtype = GGUF_CASES["mixtral-q4_0"]
        save_tiny_checkpoint(tmp_path / "hf", config_class, **overrides)
        path = str(quantize_gguf(write_gguf(tmp_path / "hf", tmp_path / "f32.gguf"),
                                 tmp_path / "q4_0.gguf", qtype))
        kw, leaf = {"quantization": "gguf"}, "qweight"
    else:
        path, _, _ = _int4_checkpoints(tmp_path, "mixtral", case.split("-")[1])
        kw, leaf = {}, "int4_blocks"
    tp1, tp2 = _tp2_equals_tp1(path, enable_expert_parallel=expert_parallel, **kw)
    try:
        moe1, moe2 = (llm.engine.model.model.layers[-1].mlp for llm in (tp1, tp2))
        if not expert_parallel:
            assert moe2.quantized_experts and moe2.partition == (0, 64)
            assert moe2.local_experts == range(0, 8)
            assert all(moe2.experts[e].down_proj.partition == (0, 64) for e in range(8))
            return
        assert moe2.quantized_experts and moe2.local_experts == range(0, 4)
        for e in range(4):
            for proj in ("gate_up_proj", "down_proj"):
                assert torch.equal(getattr(getattr(moe2.experts[e], proj), leaf),
                                   getattr(getattr(moe1.experts[e], proj), leaf))
        assert all(p.numel() == 0 for e in range(4, 8) for p in moe2.experts[e].parameters())
    finally:
        tp2.shutdown()
    assert tp2.engine.parallel.worker_exit_codes == [0]
