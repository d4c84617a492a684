"""Paged prefill attention (causal, packed varlen, cached prefixes) against the reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.kernels.paged_prefill_attention import (paged_prefill_attention,
                                                    paged_prefill_attention_ref)

# (atol, rtol) against the reference in float32 on the same rounded inputs; see
# test_kernels_decode_attention.py for why these values.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# (q_len, seq_len): no prefix; one new token after a 39-token prefix; a 70-token
# chunk after 30 cached tokens (7 blocks of 16); a whole prompt of an exact
# multiple of the block size; a chunk whose prefix ends mid-block.
CHUNKS = [(5, 5), (1, 40), (70, 100), (32, 32), (17, 50)]


def check_against_reference(paged_kv, device, chunks, num_kv_heads, group, head_dim, dtype, block_size=16,
         block_m=None, block_n=None, seed=0):
    seq_lens = [s for _, s in chunks]
    k, v, k_clean, v_clean, tables = paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                              dtype, device, seed=seed)
    qsl = [0]
    for q_len, _ in chunks:
        qsl.append(qsl[-1] + q_len)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(
        q, k, v, tables, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), max(c[0] for c in chunks),
        scale, block_m=block_m, block_n=block_n)
    expected = paged_prefill_attention_ref(q.float(), k_clean.float(), v_clean.float(), tables,
                                           qsl, seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


# Every group size and dtype at head_dim 64; head_dim 128 in float16 for one group
# only (the interpreter makes the wide fp16 cases slow, and the tile code does not
# depend on the group once the head dimension is set).
@pytest.mark.parametrize("head_dim,group,dtype", [
    (hd, g, dt) for hd in (64, 128) for g in (1, 3, 8) for dt in (torch.float32, torch.float16)
    if not (hd == 128 and dt == torch.float16 and g != 1)],
    ids=lambda v: {torch.float32: "fp32", torch.float16: "fp16"}.get(v, str(v)))
def test_prefill_matches_reference(paged_kv, device, head_dim, group, dtype):
    check_against_reference(paged_kv, device, CHUNKS, 1, group, head_dim, dtype)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_small_tiles(paged_kv, device, group):
    """Many query tiles per chunk (group 8 leaves 2 tokens per 16-row tile) and many
    key tiles, both straddling cache blocks and the diagonal."""
    check_against_reference(paged_kv, device, CHUNKS[:3], 2, group, 64, torch.float32, block_m=16, block_n=16)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_prefill_block_sizes(paged_kv, device, block_size):
    check_against_reference(paged_kv, device, [(9, 9), (20, 45)], 1, 3, 64, torch.float16, block_size=block_size,
         block_m=32, block_n=16)


def test_prefill_head_dim_not_power_of_two(paged_kv, device):
    check_against_reference(paged_kv, device, [(9, 9), (20, 45)], 1, 3, 80, torch.float32)


def test_prefill_bf16_upcast_path(paged_kv, device):
    """bf16 on the interpreter goes through float32 tiles (CPU); natively on CUDA."""
    check_against_reference(paged_kv, device, CHUNKS, 1, 3, 64, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_bf16_dot_cuda(paged_kv, device, head_dim):
    check_against_reference(paged_kv, device, [(513, 513), (1, 700), (300, 1000)], 4, 8, head_dim, torch.bfloat16)


def test_chunked_prefill_equals_whole_prompt(paged_kv, device):
    """Two chunks of one prompt (the second over the first's cached K/V) give the
    same rows as prefilling the prompt at once."""
    k, v, _, _, tables = paged_kv([45], 1, 64, 16, torch.float32, device)
    q = torch.randn(45, 3, 64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    whole = paged_prefill_attention(q, k, v, tables, torch.tensor([0, 45], **i32),
                                    torch.tensor([45], **i32), 45, 0.125)
    first = paged_prefill_attention(q[:20], k, v, tables, torch.tensor([0, 20], **i32),
                                    torch.tensor([20], **i32), 20, 0.125)
    second = paged_prefill_attention(q[20:], k, v, tables, torch.tensor([0, 25], **i32),
                                     torch.tensor([45], **i32), 25, 0.125)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


def test_prefill_noncontiguous_query_and_out(paged_kv, device):
    k, v, k_clean, v_clean, tables = paged_kv([12, 30], 2, 64, 16, torch.float32, device)
    qkv = torch.randn(20, (6 + 2 + 2) * 64, device=device)
    q = qkv[:, :6 * 64].view(20, 6, 64)
    out_big = torch.zeros(23, 6, 64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    paged_prefill_attention(q, k, v, tables, torch.tensor([0, 12, 20], **i32),
                            torch.tensor([12, 30], **i32), 12, 0.125, out=out_big[3:])
    expected = paged_prefill_attention_ref(q, k_clean, v_clean, tables, [0, 12, 20], [12, 30],
                                           0.125)
    torch.testing.assert_close(out_big[3:], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out_big[:3], torch.zeros(3, 6, 64, device=device))


@st.composite
def _chunks(draw):
    n = draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        q_len = draw(st.integers(1, 40))
        out.append((q_len, q_len + draw(st.integers(0, 60))))
    return out


# paged_kv and device are pure (a function, a constant): sharing them across examples is safe.
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=_chunks(), group=st.sampled_from([1, 2, 3, 5]),
       block_size=st.sampled_from([4, 16]), seed=st.integers(0, 1000))
def test_prefill_property(paged_kv, device, chunks, group, block_size, seed):
    check_against_reference(paged_kv, device, chunks, 1, group, 32, torch.float32, block_size=block_size,
         block_m=16, block_n=16, seed=seed)


def test_prefill_rejects_bad_input(paged_kv, device):
    k, v, _, _, tables = paged_kv([3], 1, 64, 16, torch.float32, device)
    q = torch.randn(3, 3, 64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    qsl, lens = torch.tensor([0, 3], **i32), torch.tensor([3], **i32)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k, v, tables, qsl.long(), lens, 3, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k, v, tables, qsl[:1], lens, 3, 0.1)
    with pytest.raises(ValueError, match="block_m"):
        paged_prefill_attention(q, k, v, tables, qsl, lens, 3, 0.1, block_m=24)
    with pytest.raises(ValueError, match="key_cache"):
        paged_prefill_attention(q, k[..., :32], v, tables, qsl, lens, 3, 0.1)
