"""Sliding-window (and soft-capped) attention of the torch and compiled-CPU backends
and of the references, against a dense per-token computation: mixed batches of
decodes and prefill chunks that follow cached context (chunked prefill, prefix-cache
hits), windows shorter than, equal to and longer than the contexts."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels import reference as ref
from tandem.kernels.attention_backend import AttentionMetadata, TorchAttentionBackend

HQ, HKV, D, BS, NB = 4, 2, 16, 4, 64
# (cached tokens before this step, tokens this step): two decodes, a whole prompt,
# a chunk after 13 cached tokens, a chunk after a 3-block prefix hit.
SEQS = [(20, 1), (6, 1), (11, 11), (13, 7), (12, 9)]


def _backends():
    out = [TorchAttentionBackend()]
    try:
        from tandem.kernels.cpu.backend import CpuAttentionBackend
        out += [CpuAttentionBackend(), CpuAttentionBackend(batch_invariant=True)]
    except RuntimeError:        # no compiler here: the torch backend still runs
        pass
    return out


def _name(backend) -> str:
    return backend.name + ("-batch-invariant" if getattr(backend, "batch_invariant", False)
                           else "")


def _step(seed: int = 0):
    """Caches holding every cached token, this step's q/k/v and its metadata, and
    the full K/V ``[S, Hkv, D]`` of each sequence for the dense reference."""
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(NB, BS, HKV, D, generator=gen)
    value_cache = torch.randn(NB, BS, HKV, D, generator=gen)
    free = torch.randperm(NB, generator=gen).tolist()
    tables, slots, qsl, lens, full_k, full_v = [], [], [0], [], [], []
    t = sum(n for _, n in SEQS)
    q = torch.randn(t, HQ, D, generator=gen)
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    for cached, new in SEQS:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BS))]
        tables.append(blocks)
        pos = range(total)
        rows_k = torch.stack([key_cache[blocks[p // BS], p % BS] for p in pos])
        rows_v = torch.stack([value_cache[blocks[p // BS], p % BS] for p in pos])
        start = qsl[-1]
        rows_k[cached:], rows_v[cached:] = k[start:start + new], v[start:start + new]
        full_k.append(rows_k)
        full_v.append(rows_v)
        slots.extend(blocks[p // BS] * BS + p % BS for p in range(cached, total))
        qsl.append(start + new)
        lens.append(total)
    table = torch.zeros(len(SEQS), max(map(len, tables)), dtype=torch.int32)
    for i, b in enumerate(tables):
        table[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, num_decodes=2, max_seq_len=max(lens))
    return q, k, v, key_cache, value_cache, meta, full_k, full_v


def _dense(q, meta, full_k, full_v, scale, window, softcap):
    """Every query token on its own: keys ``p - window < j <= p``."""
    out = torch.empty_like(q)
    g = HQ // HKV
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        first = meta.seq_lens_cpu[i] - (end - start)
        for row in range(start, end):
            p = first + row - start
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(HQ):
                keys = full_k[i][lo:p + 1, h // g].double()
                s = keys @ q[row, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[row, h] = (torch.softmax(s, 0) @ full_v[i][lo:p + 1, h // g].double()).float()
    return out


@pytest.mark.parametrize("backend", _backends(), ids=_name)
@pytest.mark.parametrize("window, softcap", [(1, None), (5, None), (8, None), (21, None),
                                              (64, None), (None, 2.0), (6, 2.0)])
def test_windowed_attention_equals_dense(backend, window, softcap):
    q, k, v, key_cache, value_cache, meta, full_k, full_v = _step()
    scale = 1 / math.sqrt(D)
    options = {k_: v_ for k_, v_ in (("window", window), ("softcap", softcap)) if v_ is not None}
    out = backend.attention(q, k, v, key_cache, value_cache, meta, scale, **options)
    want = _dense(q, meta, full_k, full_v, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 21, None])
def test_references_take_the_window(window):
    q, k, v, key_cache, value_cache, meta, full_k, full_v = _step(seed=1)
    ref.reshape_and_cache_ref(k, v, key_cache, value_cache, meta.slot_mapping)
    scale = 1 / math.sqrt(D)
    want = _dense(q, meta, full_k, full_v, scale, window, None)
    nd = meta.num_decodes
    decode = ref.paged_decode_attention_ref(q[:nd], key_cache, value_cache,
                                            meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                            window=window)
    torch.testing.assert_close(decode, want[:nd], atol=2e-5, rtol=2e-5)
    qsl = meta.query_start_loc_cpu[nd:]
    prefill = ref.paged_prefill_attention_ref(q[qsl[0]:], key_cache, value_cache,
                                              meta.block_tables[nd:], [x - qsl[0] for x in qsl],
                                              meta.seq_lens_cpu[nd:], scale, window=window)
    torch.testing.assert_close(prefill, want[qsl[0]:], atol=2e-5, rtol=2e-5)


def test_batch_invariant_cpu_backend_takes_windows_per_token():
    """In batch-invariant mode a windowed, soft-capped layer attends every query token
    through the decode kernel over its own context: a prompt's token gives the same
    row as when it is decoded alone over the same cache."""
    try:
        from tandem.kernels.cpu import ops
        from tandem.kernels.cpu.backend import CpuAttentionBackend
        backend = CpuAttentionBackend(batch_invariant=True)
    except RuntimeError:
        pytest.skip("no compiled CPU kernels here")
    assert backend.supports_sliding_window and backend.supports_logit_softcap
    q, k, v, key_cache, value_cache, meta, _, _ = _step()
    out = backend.attention(q, k, v, key_cache, value_cache, meta, 0.25, window=6, softcap=2.0)
    # Each token of every sequence, decoded alone over the same cache with its own
    # context length, gives the same row bit for bit.
    qsl = meta.query_start_loc_cpu
    for s in range(meta.num_seqs):
        before = meta.seq_lens_cpu[s] - (qsl[s + 1] - qsl[s])
        for i, p in enumerate(range(qsl[s], qsl[s + 1])):
            one = ops.paged_decode_attention(q[p:p + 1], key_cache, value_cache,
                                             meta.block_tables[s:s + 1],
                                             torch.tensor([before + i + 1], dtype=torch.int32),
                                             0.25, window=6, softcap=2.0)
            assert torch.equal(one, out[p:p + 1]), (s, i)
