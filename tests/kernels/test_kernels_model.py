"""A small random Llama decoder run through the triton and torch backends step by step,
and whole engines on a tiny random checkpoint with either backend."""

import pytest
import torch

from tandem.engine.config import ModelConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.kernels.attention_backend import AttentionMetadata, TorchAttentionBackend
from tandem.kernels.backend import TritonAttentionBackend

BS = 16


def _meta(seqs, device):
    """seqs: (block_ids, start, end) per sequence, decodes (end - start == 1) first."""
    slots, qsl, lens, positions = [], [0], [], []
    for ids, start, end in seqs:
        slots += [ids[p // BS] * BS + p % BS for p in range(start, end)]
        positions += list(range(start, end))
        qsl.append(qsl[-1] + end - start)
        lens.append(end)
    table = torch.zeros(len(seqs), max(len(s[0]) for s in seqs), dtype=torch.int32)
    for i, (ids, _, _) in enumerate(seqs):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        num_decodes=sum(1 for _, s, e in seqs if e - s == 1), max_seq_len=max(lens))
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def test_decoder_steps_match_torch_backend(device):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=192, intermediate_size=320, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=32, vocab_size=100, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_model_len=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(device)
    model.init_rope(device)
    caches = {name: torch.zeros(2, 2, 12, BS, 2, 32, device=device)
              for name in ("triton", "torch")}
    backends = {"triton": TritonAttentionBackend(), "torch": TorchAttentionBackend()}
    a, b, c = [3, 7], [10, 1, 5], [0, 11]          # shuffled block ids per sequence
    steps = [
        [(a, 0, 20), (b, 0, 37)],                   # two prompts
        [(a, 20, 21), (b, 37, 38), (c, 0, 9)],      # two decodes + a new prompt
        [(a, 21, 22), (b, 38, 39), (c, 9, 23)],     # decodes + a second chunk (prefix 9)
    ]
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for seqs in steps:
            meta, positions = _meta(seqs, device)
            ids = torch.randint(0, 100, (meta.num_tokens,), generator=gen).to(device)
            out = {name: model(ids, positions, caches[name], meta, backends[name])
                   for name in backends}
            torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(caches["triton"], caches["torch"], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's widths (hidden 576, FFN 1536,
    head_dim 64, 9 query heads on 3 KV heads) in 2 layers, its KV heads' fp8 scales
    apart (tests/test_tensor_parallel_models.py's ``save_tiny_kv_checkpoint``)."""
    from tests.test_tensor_parallel_models import save_tiny_kv_checkpoint

    return save_tiny_kv_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def _engines(path: str, **kw):
    """The torch backend's engine and the Triton backend's, each loading ``path`` (and
    calibrating its own fp8 scales)."""
    from tandem.engine.llm import LLM

    ref = LLM(path, dtype="float32", num_blocks=16, attention_backend="torch", **kw)
    tri = LLM(path, dtype="float32", num_blocks=16, attention_backend="triton", **kw)
    assert tri.engine.backend.name == "triton"
    return ref, tri


def test_engine_greedy_unchanged_with_triton_backend(tiny_llama):
    """A tiny random Llama with the default model's attention shape: the engine's
    greedy tokens with the Triton backend (interpreted on CPU) equal those of the
    torch backend, batched prefill + decode."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    ref, tri = _engines(tiny_llama)
    prompts = [[1, 409, 198, 195, 95], [504, 357, 282, 469, 314, 74, 30, 216, 33]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)   # prefill + a decode step
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params)]
    assert got == want


def test_engine_greedy_unchanged_with_triton_backend_on_fp8_kv(tiny_llama):
    """``kv_cache_dtype fp8_e4m3`` on a tiny random Llama with the default model's
    attention shape: the Triton kernels write and read the fp8 cache (interpreted on
    CPU) and give the torch backend's greedy tokens, with the same calibrated scales
    and the same cache bytes."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    ref, tri = _engines(tiny_llama, kv_cache_dtype="fp8_e4m3")
    caches = [llm.engine.kv_cache for llm in (ref, tri)]
    assert all(c.tensor.dtype == torch.float8_e4m3fn for c in caches)
    assert torch.equal(caches[0].scales, caches[1].scales)
    prompts = [[1, 409, 198, 195, 95], [504, 357, 282, 469, 314, 74, 30, 216, 33]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params)]
    assert got == want


def test_engine_greedy_unchanged_with_triton_backend_on_int4_kv(tiny_llama):
    """``kv_cache_dtype int4`` on a tiny random Llama with the default model's
    attention shape: the Triton kernels read the int4 rows and the open-block K store
    (interpreted on CPU), and give the torch backend's greedy tokens, over a 15-token
    prompt whose decode step fills its block (the block's K rewritten per channel and
    read back per channel in that step's attention) and a short prompt whose open
    block is read from the store."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    ref, tri = _engines(tiny_llama, kv_cache_dtype="int4")
    assert tri.engine.kv_cache.tensor.dtype == torch.uint8
    prompts = [[1, 409, 198, 195, 95],
               [504, 357, 282, 469, 314, 74, 30, 216, 33, 28, 256, 314, 253, 345, 282]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params)]
    assert got == want
