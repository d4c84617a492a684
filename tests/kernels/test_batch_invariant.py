"""Batch-invariant CPU kernels (``EngineConfig.batch_invariant``): the linear kernel of
``csrc/linear.cpp`` and per-token attention through the paged decode kernel.

Invariance is checked bit for bit: a row computed alone, in any sub-batch, at any
offset, or with another thread count equals the same row of one big call. Accuracy
is checked against float64 references on irregular shapes (N not a multiple of the
16-column panel, odd K).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tandem.kernels.attention_backend import AttentionMetadata, default_scale
from tandem.kernels.cpu.backend import CpuAttentionBackend, per_token_context
from tandem.kernels import reference as ref
from tandem.kernels.cpu.linear import invariant_linear, pack_invariant_weight

DTYPES = [torch.float32, torch.bfloat16]
# Output rounding of the dtype plus float32 accumulation over K <= 600 terms.
RTOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3}


def _linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (16, 16), (19, 33), (100, 577), (48, 64)])
def test_linear_matches_float64_reference(dtype, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(13, k, generator=g).to(dtype)
    y = invariant_linear(x, pack_invariant_weight(w), n)
    assert y.shape == (13, n) and y.dtype == dtype
    expect = _linear_ref(x, w)
    scale = expect.abs().max().clamp_min(1e-6)
    assert ((y.double() - expect).abs().max() / scale).item() <= RTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), m=st.integers(1, 40), data=st.data())
def test_linear_row_is_the_same_in_any_batch(dtype, n, k, m, data):
    g = torch.Generator().manual_seed(n * 7919 + k * 31 + m)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    pw = pack_invariant_weight(w)
    full = invariant_linear(x, pw, n)
    start = data.draw(st.integers(0, m - 1))
    stop = data.draw(st.integers(start + 1, m))
    part = invariant_linear(x[start:stop], pw, n)
    assert torch.equal(part, full[start:stop])
    # The same rows among other rows: a different batch, the same bits.
    other = torch.randn(data.draw(st.integers(0, 9)), k, generator=g).to(dtype)
    mixed = invariant_linear(torch.cat([other, x[start:stop], other]), pw, n)
    assert torch.equal(mixed[len(other):len(other) + stop - start], full[start:stop])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_the_same_with_one_thread_or_two(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g).to(dtype)
    x = torch.randn(37, 96, generator=g).to(dtype)
    pw = pack_invariant_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant_linear(x, pw, 200)
        torch.set_num_threads(2)
        two = invariant_linear(x, pw, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_linear_strided_rows_and_out():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 24, generator=g)
    big = torch.randn(9, 50, generator=g)
    x = big[:, 3:27]                                   # rows strided by 50
    out = torch.full((9, 60), 7.0)
    pw = pack_invariant_weight(w)
    invariant_linear(x, pw, 40, out=out[:, 10:50])
    assert torch.equal(out[:, 10:50], invariant_linear(x.contiguous(), pw, 40))
    assert (out[:, :10] == 7.0).all() and (out[:, 50:] == 7.0).all()


def test_linear_refuses_what_it_cannot_run():
    pw = pack_invariant_weight(torch.randn(8, 6))
    with pytest.raises(ValueError, match="x:"):
        invariant_linear(torch.randn(2, 6, dtype=torch.bfloat16), pw, 8)
    with pytest.raises(ValueError, match="in_features"):
        invariant_linear(torch.randn(2, 5), pw, 8)
    with pytest.raises(ValueError, match="weight:"):
        pack_invariant_weight(torch.randn(8, 6, dtype=torch.float16))


# -- attention ------------------------------------------------------------------------------
def _paged(dtype, lens, hkv=3, d=64, bs=16, seed=0):
    """A cache holding sequences of the given lengths in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // bs) for n in lens]
    ids = torch.randperm(sum(nblk) + 3, generator=g)[:sum(nblk)].to(torch.int32)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    at = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = ids[at:at + n]
        at += n
    kc = torch.randn(sum(nblk) + 3, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(sum(nblk) + 3, bs, hkv, d, generator=g).to(dtype)
    return kc, vc, tables


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_attention_equals_causal_reference(dtype):
    """A step of two decodes and two prefill chunks (one after cached context):
    every token's output matches causal attention over its context."""
    lens, q_lens = [20, 5, 37, 50], [1, 1, 37, 14]
    kc, vc, tables = _paged(dtype, lens)
    hq, hkv, d = 9, 3, 64
    t = sum(q_lens)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(slot_mapping=torch.zeros(t, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc_cpu=qsl, seq_lens_cpu=lens, num_decodes=2,
                             max_seq_len=max(lens))
    table, ctx = per_token_context(meta)
    assert ctx.tolist() == [20, 5, *range(1, 38), *range(37, 51)]
    scale = default_scale(d)
    out = CpuAttentionBackend(batch_invariant=True).attend_per_token(q, kc, vc, meta, scale)
    for i in range(4):
        k = ref._gather_kv(kc, tables[i], lens[i]).transpose(0, 1).double()
        v = ref._gather_kv(vc, tables[i], lens[i]).transpose(0, 1).double()
        qi = q[qsl[i]:qsl[i + 1]].transpose(0, 1).double()
        expect = ref._causal_sdpa(qi, k, v, scale, True).transpose(0, 1)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_attention_is_the_same_chunked_or_decoded(dtype):
    """Position p of a 40-token sequence gets the same bits as a prefill token of
    one 40-token chunk, of a 17-token chunk after cached context, and as a decode."""
    lens = [40]
    kc, vc, tables = _paged(dtype, lens, seed=2)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, 9, 64, generator=g).to(dtype)
    backend = CpuAttentionBackend(batch_invariant=True)
    scale = default_scale(64)

    def run(start, end, num_decodes):
        meta = AttentionMetadata(slot_mapping=torch.zeros(end - start, dtype=torch.int64),
                                 block_tables=tables, seq_lens=torch.tensor([end], dtype=torch.int32),
                                 query_start_loc_cpu=[0, end - start], seq_lens_cpu=[end],
                                 num_decodes=num_decodes, max_seq_len=end)
        return backend.attend_per_token(q[start:end], kc, vc, meta, scale)

    whole = run(0, 40, 0)
    assert torch.equal(run(23, 40, 0), whole[23:])
    assert torch.equal(run(39, 40, 1), whole[39:])


@pytest.mark.parametrize("kw,match", [
    (dict(device="cuda"), "CPU only"),
    (dict(attention_backend="torch"), "compiled CPU kernels"),
    (dict(dtype="float16"), "float32 or bfloat16"),
])
def test_config_refuses_what_the_mode_cannot_run(kw, match):
    from tandem.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"batch_invariant: .*{match}"):
        EngineConfig(batch_invariant=True, **kw)


def test_linear_layers_switch_to_the_invariant_kernel():
    """process_weights_after_loading(batch_invariant=True) packs every layer and
    keeps no plain copy; the layer then computes what the kernel computes."""
    from tandem.engine.model.linear import Linear, process_weights_after_loading

    torch.manual_seed(0)
    layer = Linear(24, [16, 8, 8], params_dtype=torch.float32)
    w = layer.weight.detach().clone()
    model = torch.nn.Sequential(layer)
    process_weights_after_loading(model, batch_invariant=True)
    assert layer.invariant_weight is not None and not hasattr(layer, "weight")
    x = torch.randn(5, 24)
    assert torch.equal(layer(x), invariant_linear(x, pack_invariant_weight(w), 32))
    process_weights_after_loading(model, batch_invariant=True)        # idempotent
    assert torch.equal(layer(x), invariant_linear(x, pack_invariant_weight(w), 32))
