"""reshape_and_cache, RMSNorm, rotary embedding and SiLU-and-mul against their references.

These kernels do no tl.dot, so bfloat16 runs under the interpreter too, with one
caveat: the interpreter (triton 3.9) converts float32 to bfloat16 by truncation,
not round-to-nearest-even as the GPU does, so on CPU a bf16 result can be one
ulp smaller in magnitude. The bf16 tolerances below allow that one ulp.
"""

import pytest
import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_ref
from tandem.kernels.reference import rope_cos_sin_cache
from tandem.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from tandem.kernels.rms_norm import rms_norm, rms_norm_ref
from tandem.kernels.rotary import rotary_embedding, rotary_embedding_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# (atol, rtol) against the reference in the same dtype. Both compute in float32
# and round once to the dtype; float32 differs only in summation order and
# fused multiply-adds, float16 by at most one ulp (2^-10 relative) where the
# float32 results straddle a rounding boundary, bfloat16 by one ulp (2^-7) of
# rounding plus, on CPU, one of truncation.
TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _bf16_truncates(device, dtype) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 128), (2, 80)])
def test_reshape_and_cache_is_exact(device, num_kv_heads, head_dim, dtype):
    num_blocks, block_size, t = 7, 16, 45
    gen = torch.Generator().manual_seed(0)
    # Shuffled, non-consecutive slots across blocks; some blocks stay untouched.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(device)
    kv = torch.randn(t, 2 * num_kv_heads + 3, head_dim, generator=gen).to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 3:]    # strided views
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reshape_and_cache_int32_slots_and_empty(device):
    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(3 * 16, dtype=torch.float32, device=device).view(3, 1, 16)
    reshape_and_cache(key, -key, k_cache, v_cache, torch.tensor([7, 0, 4], dtype=torch.int32,
                                                                device=device))
    assert torch.equal(k_cache[1, 3, 0], key[0, 0]) and torch.equal(v_cache[0, 0, 0], -key[1, 0])
    assert torch.equal(k_cache[1, 0, 0], key[2, 0])
    before = k_cache.clone()
    reshape_and_cache(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64,
                                                                      device=device))
    assert torch.equal(k_cache, before)


def test_reshape_and_cache_rejects_dtype_mismatch(device):
    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    key = torch.zeros(1, 1, 16, device=device)
    with pytest.raises(ValueError, match="key_cache"):
        reshape_and_cache(key, key, k_cache.half(), k_cache.half(),
                          torch.zeros(1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_matches_reference(device, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device)     # float32 weight
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_ref(x, weight, 1e-5, residual)
    atol, rtol = TOL[dtype]
    assert torch.equal(x, x_before)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], atol=atol, rtol=rtol)
        if _bf16_truncates(device, dtype):
            torch.testing.assert_close(got[1], want[1], atol=0.0, rtol=2 ** -7)
        else:
            assert torch.equal(got[1], want[1])      # x + residual rounds identically
    else:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_rms_norm_strided_rows(device):
    big = torch.randn(5, 300, device=device)
    x = big[:, 10:266]
    torch.testing.assert_close(rms_norm(x, torch.ones(256, device=device), 1e-6),
                               rms_norm_ref(x, torch.ones(256, device=device), 1e-6),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(3, 1, 64), (9, 3, 64),
                                                            (8, 1, 128), (2, 2, 96)])
def test_rotary_matches_reference(device, num_heads, num_kv_heads, head_dim, dtype):
    t = 11
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    cache = rope_cos_sin_cache(head_dim, 4096, 100000.0, device=device)
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    # q and k as views of one fused QKV projection output (outer strides > Hq*D).
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        t, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    q_ref, k_ref = q.clone(), k.clone()
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    assert out_q is q and out_k is k
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, k_ref, atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


def test_rotary_position_zero_is_identity(device):
    cache = rope_cos_sin_cache(64, 16, 10000.0, device=device)
    q = torch.randn(2, 3, 64, device=device)
    k = torch.randn(2, 1, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(2, dtype=torch.int32, device=device), q, k, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_rejects_odd_head_dim(device):
    q = torch.zeros(1, 1, 63, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        rotary_embedding(torch.zeros(1, dtype=torch.int64, device=device), q, q,
                         torch.zeros(8, 63, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 2 * 1536), (1, 2 * 100), (2, 3, 2 * 7)])
def test_silu_and_mul_matches_reference(device, shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype).to(device)
    got = silu_and_mul(x)
    # The reference rounds silu(gate) to the dtype before the product; the kernel
    # rounds once, so compare both to the float32 value rounded to the dtype.
    want = silu_and_mul_ref(x.float()).to(dtype)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(got, silu_and_mul_ref(x), atol=2 * atol, rtol=2 * rtol)


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 5, device=device))
