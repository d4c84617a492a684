"""The CPU decode attention of the torch backend against the reference."""

import pytest
import torch

from tandem.kernels.attention_backend import decode_attention_cpu, gather_blocks_cpu
from tandem.kernels.reference import paged_decode_attention_ref


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2),
                                        (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
def test_decode_attention_cpu_matches_reference(dtype, atol, hq, hkv, d):
    g = torch.Generator().manual_seed(hq * d)
    nb, bs = 256, 16
    seq_lens = torch.tensor([1, 17, 33, 130, 16] * 4, dtype=torch.int32)   # 20 rows: two groups
    nblk = (int(seq_lens.max()) + bs - 1) // bs
    tables = torch.randperm(nb, generator=g)[:len(seq_lens) * (nblk + 1)].view(len(seq_lens), -1)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    tables = tables.to(torch.int32)
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, seq_lens, d ** -0.5)
    got = decode_attention_cpu(q, kc, vc, tables, seq_lens, d ** -0.5, int(seq_lens.max()))
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_blocks_is_bit_exact(dtype):
    cache = torch.randn(10, 4, 2, 8).to(dtype)
    ids = torch.tensor([7, 0, 7, 3])
    assert torch.equal(gather_blocks_cpu(cache, ids), cache[ids])
