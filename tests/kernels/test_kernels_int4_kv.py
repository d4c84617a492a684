"""The Triton attention kernels reading an int4 KV cache (``kv_cache_dtype int4``,
KIVI: per-channel K in full blocks, per-token rows elsewhere, the open last block's
K from the store) against the torch references on the same bytes."""

import pytest
import torch

from tandem.kernels import int4_kv
from tandem.kernels.paged_decode_attention import paged_decode_attention
from tandem.kernels.paged_prefill_attention import paged_prefill_attention
from tandem.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def int4_paged_kv(seq_lens, hkv, d, bs, dtype, device, seed=0, no_entry=()):
    """An int4 paged cache of random K/V as the engine writes it: each sequence's full
    blocks with per-channel K, its open last block with per-token K rows and the exact
    K in an open-block store entry (none for the sequences in ``no_entry``: blocks
    that arrived by KV transfer), V per token; unused bytes random (poison).

    Returns:
        ``(key_cache, value_cache, block_tables int32 [B, max_blocks], store
        [S, BS, Hkv, D] in dtype, entries int64 [B], key_clean, value_clean)`` on
        ``device``; the clean caches have zeros where the others have poison, for the
        references (which dequantize whole blocks, unused slots too).
    """
    gen = torch.Generator().manual_seed(seed)
    row = int4_kv.int4_kv_row_bytes(d, bs)
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = (num_blocks, bs, hkv, row)
    key_cache = torch.zeros(shape, dtype=torch.uint8)
    value_cache = torch.zeros(shape, dtype=torch.uint8)
    used = torch.zeros(num_blocks, bs, dtype=torch.bool)
    store = torch.randn(len(seq_lens) + 1, bs, hkv, d, generator=gen).to(dtype)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    entries = []
    for i, (n, nblk) in enumerate(zip(seq_lens, blocks_per_seq)):
        # K with fixed outlier channels (what per-channel K is for), V plain.
        k = (torch.randn(n, hkv, d, generator=gen)
             * (1 + 4 * (torch.arange(d) % 7 == 0))).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        ids = [perm.pop() for _ in range(nblk)]
        tables[i, :nblk] = torch.tensor(ids, dtype=torch.int32)
        entry = -1
        for j, b in enumerate(ids):
            kj, vj = k[j * bs:(j + 1) * bs], v[j * bs:(j + 1) * bs]
            used[b, :len(kj)] = True
            value_cache[b, :len(vj)] = int4_kv.quantize_int4_tokens(vj, row)
            if len(kj) == bs:
                key_cache[b] = int4_kv.quantize_int4_key_blocks(kj[None], row)[0]
            else:
                key_cache[b, :len(kj)] = int4_kv.quantize_int4_tokens(kj, row)
                if i not in no_entry:
                    entry = i + 1          # entry 0 stays unused
                    store[entry, :len(kj)] = kj
        entries.append(entry)
    poison = [torch.where(used[..., None, None], c,
                          torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8))
              for c in (key_cache, value_cache)]
    return (*(c.to(device) for c in poison), tables.to(device), store.to(device),
            torch.tensor(entries, dtype=torch.int64, device=device), key_cache.to(device),
            value_cache.to(device))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single", "splitk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hkv,group,d,bs", [(2, 3, 64, 16), (1, 2, 40, 32), (3, 1, 32, 128)])
def test_decode_attention_reads_int4(device, dtype, hkv, group, d, bs, num_splits):
    """Full blocks only, an open last block with and without a store entry, one token.
    The 128-token blocks of head_dim 32 (one per-channel parameter byte per row: each
    fp16 of a channel's step and offset spans two rows) with a group of 1 are index
    paths that no dtype enters: under the interpreter they run in float32 only, the
    dtypes' own paths (the store read in the dtype, K/V rounded to it, bfloat16 upcast)
    being those of the other two shapes."""
    if device.type == "cpu" and bs == 128 and dtype != torch.float32:
        pytest.skip("interpreter: the 128-token blocks in float32 only (see the docstring)")
    seq_lens = [2 * bs, 300, 1, 2 * bs + 3]
    kc, vc, tables, store, entries, kr, vr = int4_paged_kv(seq_lens, hkv, d, bs, dtype, device,
                                                           no_entry=(3,))
    assert entries.tolist()[0] == -1 and entries.tolist()[3] == -1
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = paged_decode_attention(q, kc, vc, tables, lens, scale, max(seq_lens),
                                 num_splits=num_splits, k_scale=store, v_scale=entries)
    # The reference in float32 (K/V decoded to float32, not rounded to the dtype).
    want = paged_decode_attention_ref(q.float(), kr, vr, tables, lens, scale, k_scale=store,
                                      v_scale=entries)
    assert out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    # The store is read: without it, the open blocks' K come from their int4 rows.
    no_store = paged_decode_attention(q, kc, vc, tables, lens, scale, max(seq_lens),
                                      num_splits=num_splits)
    want_rows = paged_decode_attention_ref(q.float(), kr, vr, tables, lens, scale)
    torch.testing.assert_close(no_store.float(), want_rows.float(), atol=atol, rtol=rtol)
    # (sequence 1's open block: the output is the store's, not the rows')
    err_store = (out[1].float() - want[1].float()).abs().max()
    assert (out[1].float() - want_rows[1].float()).abs().max() > 2 * err_store


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hkv,group,d,bs", [(2, 3, 64, 16), (1, 2, 40, 32)])
def test_prefill_attention_reads_int4(device, dtype, hkv, group, d, bs):
    """Chunks after a cached prefix and whole prompts; every key, the chunk's own
    included, read from the int4 cache (the open block's K from the store)."""
    seq_lens = [70, 2 * bs, 5, 45]
    q_lens = [20, 2 * bs, 5, 1]
    kc, vc, tables, store, entries, kr, vr = int4_paged_kv(seq_lens, hkv, d, bs, dtype, device)
    gen = torch.Generator().manual_seed(3)
    t = sum(q_lens)
    q = torch.randn(t, hkv * group, d, generator=gen).to(dtype).to(device)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    out = paged_prefill_attention(
        q, kc, vc, tables, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), max(q_lens), d ** -0.5,
        k_scale=store, v_scale=entries)
    # The reference in float32 (its bfloat16 SDPA rounds more than the kernel does).
    want = paged_prefill_attention_ref(q.float(), kr, vr, tables, qsl, seq_lens, d ** -0.5,
                                       k_scale=store, v_scale=entries)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)


def test_int4_arguments_are_checked(device):
    kc, vc, tables, store, entries, _, _ = int4_paged_kv([20], 2, 64, 16, torch.float32,
                                                          device)
    q = torch.randn(1, 2, 64, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        paged_decode_attention(q, kc, vc, tables, lens, 0.125, k_scale=store)
    with pytest.raises(ValueError, match="key_cache"):
        paged_decode_attention(q, kc[..., :40].contiguous(), vc[..., :40].contiguous(), tables,
                               lens, 0.125)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, kc, vc, tables, lens, 0.125, k_scale=store[:, :8],
                               v_scale=entries)
    with pytest.raises(ValueError, match="v_scale"):
        paged_decode_attention(q, kc, vc, tables, lens, 0.125, k_scale=store,
                               v_scale=entries.int())
