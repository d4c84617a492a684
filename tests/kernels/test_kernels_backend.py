"""TritonAttentionBackend against the torch backend on mixed decode/prefill batches."""

import pytest
import torch

from tandem.kernels.attention_backend import TorchAttentionBackend
from tandem.kernels.registry import get_attention_backend
from tandem.kernels.backend import TritonAttentionBackend
from tandem.kernels.reference import rope_cos_sin_cache

from tests.kernels.conftest import make_attention_batch

# (atol, rtol) between the two backends; both accumulate in float32, the
# float16 torch path rounds its own intermediates, hence a little above the
# kernel-vs-float32 tolerance.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3)}

HQ, HKV, D, BS = 6, 2, 64, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("decode_lens,prefill_chunks", [
    ([1, 20, 300], [(7, 7), (12, 40)]),     # mixed: fresh prompt + cached prefix
    ([33, 5], []),                           # decodes only
    ([], [(1, 1), (19, 19), (30, 64)]),      # prefills only, one a single token
], ids=["mixed", "decode", "prefill"])
def test_attention_matches_torch_backend(paged_kv, device, dtype, decode_lens, prefill_chunks):
    q, k, v, k_cache, v_cache, meta = make_attention_batch(
        paged_kv, device, dtype, decode_lens, prefill_chunks, HQ, HKV, D, BS)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    got = TritonAttentionBackend().attention(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    want = TorchAttentionBackend().attention(q, k, v, k_ref, v_ref, meta, D ** -0.5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_norm_rope_activation_match_torch_backend(device):
    triton_be, torch_be = TritonAttentionBackend(), TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=gen).to(device)
    res = torch.randn(5, 576, generator=gen).to(device)
    w = torch.rand(576, generator=gen).to(device)
    for a, b in zip(triton_be.rms_norm(x, w, 1e-5, res), torch_be.rms_norm(x, w, 1e-5, res)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(triton_be.rms_norm(x, w, 1e-5), torch_be.rms_norm(x, w, 1e-5),
                               atol=1e-6, rtol=1e-5)

    cache = rope_cos_sin_cache(D, 512, 100000.0, device=device)
    pos = torch.randint(0, 512, (5,), generator=gen).to(device)
    q, k = torch.randn(5, HQ, D, generator=gen).to(device), torch.randn(5, HKV, D).to(device)
    q2, k2 = q.clone(), k.clone()
    triton_be.rotary_embedding(pos, q, k, cache)
    torch_be.rotary_embedding(pos, q2, k2, cache)
    torch.testing.assert_close(q, q2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, k2, atol=1e-6, rtol=1e-5)

    gu = torch.randn(5, 2 * 1536, generator=gen).to(device)
    torch.testing.assert_close(triton_be.silu_and_mul(gu), torch_be.silu_and_mul(gu),
                               atol=1e-6, rtol=1e-5)


def test_registry_builds_triton_backend(device):
    backend = get_attention_backend("triton", device)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
