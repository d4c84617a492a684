"""Paged decode attention (single pass and split-K) against the torch reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.kernels.paged_decode_attention import (choose_num_splits, paged_decode_attention,
                                                   paged_decode_attention_ref)

# (atol, rtol) against the reference evaluated in float32 on the same rounded
# inputs. float32: products and sums in float32, only the summation order
# differs. float16/bfloat16: the output is rounded to the dtype (half an ulp:
# 2^-11 / 2^-8 relative) and the probabilities are rounded to it before P @ V.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# 1 token, a partial block, many blocks (19 with BS=16), an exact multiple of BS.
SEQ_LENS = [1, 17, 300, 64]


def check_against_reference(paged_kv, device, seq_lens, num_kv_heads, group, head_dim, dtype, block_size=16,
         num_splits=None, block_n=None, seed=0):
    k, v, k_clean, v_clean, tables = paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                              dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    q = q.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k, v, tables, lens, scale, max(seq_lens),
                                 num_splits=num_splits, block_n=block_n)
    expected = paged_decode_attention_ref(q.float(), k_clean.float(), v_clean.float(), tables,
                                          lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["single", "splitk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(paged_kv, device, head_dim, group, dtype, num_splits):
    check_against_reference(paged_kv, device, SEQ_LENS, 2, group, head_dim, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_bf16_upcast_path(paged_kv, device, num_splits):
    """bf16 on the interpreter goes through float32 tiles (CPU); natively on CUDA."""
    check_against_reference(paged_kv, device, SEQ_LENS, 2, 3, 64, torch.bfloat16, num_splits=num_splits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU")
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_bf16_dot_cuda(paged_kv, device, head_dim, num_splits):
    check_against_reference(paged_kv, device, [1, 33, 1000, 4096], 4, 8, head_dim, torch.bfloat16,
         num_splits=num_splits)


def test_decode_more_splits_than_context(paged_kv, device):
    """Short sequences leave most splits empty; the merge must weigh them 0."""
    check_against_reference(paged_kv, device, [1, 2, 300], 1, 3, 64, torch.float32, num_splits=16, block_n=16)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_block_sizes(paged_kv, device, block_size):
    """block_n need not divide or equal the cache block size (nor the reverse)."""
    check_against_reference(paged_kv, device, [5, 70], 1, 3, 64, torch.float16, block_size=block_size, block_n=16)


def test_decode_noncontiguous_query_and_out(paged_kv, device):
    k, v, k_clean, v_clean, tables = paged_kv([9, 40], 2, 64, 16, torch.float32, device)
    qkv = torch.randn(2, (6 + 2 + 2) * 64, device=device)
    q = qkv[:, :6 * 64].view(2, 6, 64)
    out_big = torch.zeros(3, 6, 64, device=device)
    lens = torch.tensor([9, 40], dtype=torch.int32, device=device)
    paged_decode_attention(q, k, v, tables, lens, 0.125, out=out_big[1:])
    expected = paged_decode_attention_ref(q, k_clean, v_clean, tables, lens, 0.125)
    torch.testing.assert_close(out_big[1:], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out_big[0], torch.zeros(6, 64, device=device))


# paged_kv and device are pure (a function, a constant): sharing them across examples is safe.
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
       group=st.sampled_from([1, 2, 3, 5]), block_size=st.sampled_from([4, 16]),
       num_splits=st.integers(1, 5), seed=st.integers(0, 1000))
def test_decode_property(paged_kv, device, seq_lens, group, block_size, num_splits, seed):
    check_against_reference(paged_kv, device, seq_lens, 1, group, 32, torch.float32, block_size=block_size,
         num_splits=num_splits, block_n=16, seed=seed)


def test_choose_num_splits():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 2, 32768, cpu) > 1
    assert choose_num_splits(1, 2, 100, cpu) == 1          # too short to split
    assert choose_num_splits(256, 8, 32768, cpu) == 1      # grid already full
    assert choose_num_splits(1, 1, 10 ** 7, cpu) <= 64


def test_decode_rejects_bad_input(paged_kv, device):
    k, v, _, _, tables = paged_kv([3], 2, 64, 16, torch.float32, device)
    q = torch.randn(1, 6, 64, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k, v, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :5], k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="value_cache"):
        paged_decode_attention(q, k, v.half(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU guard")
def test_cpu_without_interpreter_is_refused(paged_kv, device, monkeypatch):
    k, v, _, _, tables = paged_kv([3], 1, 64, 16, torch.float32, device)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_decode_attention(torch.randn(1, 1, 64), k, v, tables,
                               torch.tensor([3], dtype=torch.int32), 0.1)
