"""The Triton kernels on an fp8 KV cache (``kv_cache_dtype fp8_e4m3``) against the
torch references: the write is bit-exact, attention within the dtype's tolerance."""

import pytest
import torch

from tandem.kernels.attention_backend import AttentionMetadata, TorchAttentionBackend
from tandem.kernels.backend import TritonAttentionBackend
from tandem.kernels.paged_decode_attention import paged_decode_attention
from tandem.kernels.paged_prefill_attention import paged_prefill_attention
from tandem.kernels.reference import (paged_decode_attention_ref, paged_prefill_attention_ref,
                                      quantize_fp8_e4m3_ref)
from tandem.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

from tests.kernels.conftest import make_paged_kv
from tests.kernels.conftest import make_attention_batch

FP8 = torch.float8_e4m3fn
# Kernel vs reference on the same fp8 bytes: both dequantize exactly, so only the
# summation order and the dtype's rounding of P differ (as in the unquantized tests).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def _scales(hkv: int, seed: int) -> torch.Tensor:
    """Per-head power-of-two scales, as calibration produces: 2^-7 .. 2^-4, so that
    values of ``40 * scale * N(0, 1)`` (|x| ~ 0.3 .. 2.5, as K/V of a real model)
    span e4m3's range from its subnormals to ~200."""
    gen = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-7, -3, (hkv,), generator=gen).float())


def _fp8_paged_kv(seq_lens, hkv, d, bs, dtype, device, seed=0):
    """A shuffled, NaN-poisoned fp8 paged cache (see ``make_paged_kv``) and its
    NaN-free twin for the reference, with the scales its values were quantized by."""
    k, v, k_clean, v_clean, tables = make_paged_kv(seq_lens, hkv, d, bs, dtype,
                                                   torch.device("cpu"), seed=seed)
    ks, vs = _scales(hkv, seed), _scales(hkv, seed + 1)
    # Values spread over e4m3's range: x / s lands around +-[2^-9, 448].
    k, k_clean = (x * ks[:, None] * 40 for x in (k, k_clean))
    v, v_clean = (x * vs[:, None] * 40 for x in (v, v_clean))
    out = [quantize_fp8_e4m3_ref(x, s) for x, s in
           ((k, ks), (v, vs), (k_clean, ks), (v_clean, vs))]
    return [x.to(device) for x in (*out, tables, ks, vs)]


def test_round_to_e4m3_matches_torch_on_every_boundary(device):
    """reshape_and_cache's in-kernel rounding equals torch's float32 -> e4m3 cast:
    at each grid point, the midpoints either side (ties to even), just off them,
    values just below each power of two (they round up into the next binade),
    the subnormals, and saturation at +-448."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(FP8).float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    eps = torch.finfo(torch.float32).eps
    x = torch.cat([grid, mids, mids * (1 + eps), mids * (1 - eps), grid * (1 - 4 * eps),
                   torch.tensor([1e-7, -3e-4, 0.0, -0.0, 447.9, 449.0, -1e4, 3e5])])
    # Every value, padded with zeros to whole rows: [T, Hkv=2, D=64], one program a row.
    key = torch.cat([x, x.new_zeros(-x.numel() % 128)]).view(-1, 2, 64).to(device)
    t = key.shape[0]
    cache = torch.zeros(t, 1, 2, 64, dtype=FP8, device=device)
    ones = torch.ones(2, device=device)
    reshape_and_cache(key, key, cache, cache.clone(), torch.arange(t, device=device),
                      ones, ones)
    want = quantize_fp8_e4m3_ref(key, ones).view(torch.uint8)
    assert torch.equal(cache.view(t, 2, 64).view(torch.uint8), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 40, 5)])
def test_reshape_and_cache_fp8_is_bit_exact(device, dtype, num_kv_heads, head_dim, block_size):
    num_blocks, t = 9, 37
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(device)
    kv = torch.randn(t, 2 * num_kv_heads + 1, head_dim, generator=gen) * 30
    kv = kv.to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1:]     # strided views
    # Powers of two as calibrated, and one arbitrary scale: the division is IEEE too.
    ks = _scales(num_kv_heads, 0).to(device)
    vs = (_scales(num_kv_heads, 1) * 0.37).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(FP8).to(device)
    v_cache = torch.randn(shape, generator=gen).to(FP8).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots, ks, vs)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots, ks, vs)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single", "splitk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(2, 3, 64, 16), (3, 2, 40, 5)])
def test_decode_attention_reads_fp8(device, dtype, num_kv_heads, group, head_dim, block_size,
                                    num_splits):
    seq_lens = [1, 17, 300, 64]
    k, v, k_clean, v_clean, tables, ks, vs = _fp8_paged_kv(seq_lens, num_kv_heads, head_dim,
                                                           block_size, dtype, device)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    q = q.to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k, v, tables, lens, scale, max(seq_lens),
                                 num_splits=num_splits, k_scale=ks, v_scale=vs)
    # The reference on the same bytes, dequantized into float32 (exact for every dtype).
    want = paged_decode_attention_ref(q.float(), k_clean, v_clean, tables, lens, scale,
                                      k_scale=ks, v_scale=vs)
    assert out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(2, 3, 64, 16), (3, 2, 40, 5)])
def test_prefill_attention_reads_fp8(device, dtype, num_kv_heads, group, head_dim, block_size):
    # (q_len, seq_len): a fresh prompt, a chunk after a cached prefix, a single token.
    chunks = [(23, 23), (17, 90), (1, 1)]
    seq_lens = [s for _, s in chunks]
    k, v, k_clean, v_clean, tables, ks, vs = _fp8_paged_kv(seq_lens, num_kv_heads, head_dim,
                                                           block_size, dtype, device, seed=4)
    qsl = [0]
    for q_len, _ in chunks:
        qsl.append(qsl[-1] + q_len)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    q = q.to(device)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(
        q, k, v, tables, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), max(c[0] for c in chunks),
        scale, block_m=16, block_n=16, k_scale=ks, v_scale=vs)
    want = paged_prefill_attention_ref(q.float(), k_clean, v_clean, tables, qsl, seq_lens,
                                       scale, k_scale=ks, v_scale=vs)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_backend_on_fp8_cache_matches_torch_backend(paged_kv, device, dtype):
    """A mixed step (decodes, a fresh prompt, a chunk after a cached prefix) through
    both backends on fp8 caches: the same cache bytes after the write, close outputs."""
    q, k, v, k_cache, v_cache, meta = make_attention_batch(
        paged_kv, device, dtype, [1, 20, 300], [(7, 7), (12, 40)], 6, 2, 64, 16)
    ks, vs = _scales(2, 5).to(device), _scales(2, 6).to(device)
    k_cache, v_cache = (quantize_fp8_e4m3_ref(c, s) for c, s in ((k_cache, ks), (v_cache, vs)))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    got = TritonAttentionBackend().attention(q, k, v, k_cache, v_cache, meta, 0.125, ks, vs)
    want = TorchAttentionBackend().attention(q, k, v, k_ref, v_ref, meta, 0.125, ks, vs)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_fp8_arguments_are_checked(device):
    q = torch.randn(1, 2, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, dtype=FP8, device=device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    s = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="k_scale: required"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="v_scale: expected shape"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.25, k_scale=s, v_scale=s[:1])
    with pytest.raises(ValueError, match="k_scale: dtype"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.25, k_scale=s.half(),
                               v_scale=s)
    with pytest.raises(ValueError, match="value_cache"):
        paged_decode_attention(q, cache, cache.float(), tables, lens, 0.25, k_scale=s,
                               v_scale=s)
    dense = cache.float()
    with pytest.raises(ValueError, match="only for a float8_e4m3fn"):
        paged_prefill_attention(q, dense, dense, tables, torch.tensor([0, 1], dtype=torch.int32,
                                device=device), lens, 1, 0.25, k_scale=s, v_scale=s)
    with pytest.raises(ValueError, match="k_scale: required"):
        reshape_and_cache(q, q, cache, cache, torch.zeros(1, dtype=torch.int64, device=device))
    int4 = torch.zeros(2, 4, 2, 24, dtype=torch.uint8, device=device)
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64, device=device), tables, lens,
                             [0, 1], [1], 1, 1)          # no int4_plan
    with pytest.raises(ValueError, match="int4_plan"):
        TritonAttentionBackend().attention(q, q, q, int4, int4, meta, 0.25)
