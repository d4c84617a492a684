"""Int4 KV cache, ``kv_cache_dtype int4`` (KIVI on paged blocks, see
:mod:`tandem.kernels.int4_kv`): the codec (byte layouts, exact round trips of
representable values, error bounds), the cache write with its open-block K store,
attention over int4 blocks against attention over their dequantization (torch and
compiled), and the real model in float32 with int4 KV next to the same weights
with KV in the model dtype (block counts, what the store and the blocks hold,
tokens, prompt logprobs, chunking and prefix-cache invariance, n > 1, freed
blocks and entries, swap, the KV transfer and its handshake).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.runtime.model_runner import KVCache
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import RequestStatus
from tandem.kernels import int4_kv
from tandem.kernels import reference as ref
from tandem.kernels.attention_backend import (AttentionMetadata, TorchAttentionBackend,
                                              decode_attention_cpu)
from tandem.kvtransfer.layout import KVLayout, KVLayoutMismatchError
from tests.test_disagg_engine import _prefill, _reserve, _run_until

U8 = torch.uint8
# Bytes per block of the default model: 30 layers x K,V x 16 tokens x 3 heads x ...
F32_BLOCK = 30 * 2 * 16 * 3 * 64 * 4
INT4_BLOCK = 30 * 2 * 16 * 3 * 48          # ... 48-byte rows (32 of nibbles, 16 of fp16 pairs)
MEM = 40 * F32_BLOCK
# One entry of the open-block K store: 30 layers x 16 tokens x 3 heads x 64 float32.
STORE_ENTRY = 30 * 16 * 3 * 64 * 4
INT4_SEQS = 8                               # the int4 engine's max_num_seqs: its store entries
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Water boils at a temperature of", "Once upon a time, in a small village,"]


# -- the codec -------------------------------------------------------------------------------

@pytest.mark.parametrize("d,bs,group,row", [(64, 16, 32, 48), (64, 32, 32, 40), (80, 16, 16, 60),
                                            (40, 8, 8, 40), (128, 16, 32, 96), (64, 1, 32, 288)])
def test_row_geometry(d, bs, group, row):
    assert int4_kv.int4_kv_group_size(d) == group
    assert int4_kv.int4_kv_row_bytes(d, bs) == row


def test_shapes_that_cannot_be_packed_are_refused():
    for d in (0, 12, 36, 63):
        with pytest.raises(ValueError, match="head_dim"):
            int4_kv.int4_kv_row_bytes(d, 16)
    with pytest.raises(ValueError, match="block_size"):
        int4_kv.int4_kv_row_bytes(64, 24)          # 256 pair bytes do not split over 24 rows


def test_per_token_row_layout():
    """8 channels, one group: nibbles low first, then step and min as fp16, then zeros."""
    step, lo = 0.5, -1.0
    q = torch.tensor([0, 15, 3, 4, 7, 8, 1, 2])
    row = int4_kv.quantize_int4_tokens((q * step + lo).view(1, 8), 12)
    assert row.dtype == U8 and row.shape == (1, 12)
    assert row[0, :4].tolist() == [0 | 15 << 4, 3 | 4 << 4, 7 | 8 << 4, 1 | 2 << 4]
    assert row[0, 4:8].view(torch.float16).tolist() == [step, lo]
    assert row[0, 8:].tolist() == [0, 0, 0, 0]


def test_per_channel_block_layout():
    """A block of 4 tokens x 8 channels: channel c spans its own range over the 4
    tokens; row j carries the (step, min) pairs of channels 2j and 2j + 1."""
    step = torch.tensor([0.5, 1.0, 0.25, 2.0, 0.125, 4.0, 1.5, 0.75])
    lo = torch.tensor([-1.0, 0.0, 2.0, -8.0, 0.5, -3.0, 1.0, -0.25])
    q = torch.tensor([[0, 15, 3, 4, 7, 8, 1, 2], [15, 0, 0, 15, 15, 0, 0, 15],
                      [5, 5, 15, 0, 0, 15, 15, 0], [1, 2, 9, 9, 3, 3, 4, 4]])
    x = (q * step + lo).view(1, 4, 1, 8)
    rows = int4_kv.quantize_int4_key_blocks(x, 12)
    assert rows.shape == (1, 4, 1, 12)
    for j in range(4):
        assert rows[0, j, 0, :4].tolist() == [int(q[j, 2 * i]) | int(q[j, 2 * i + 1]) << 4
                                              for i in range(4)]
        pairs = rows[0, j, 0, 4:12].view(torch.float16).tolist()
        assert pairs == [step[2 * j].item(), lo[2 * j].item(),
                         step[2 * j + 1].item(), lo[2 * j + 1].item()]
    assert torch.equal(int4_kv.dequantize_int4_key_blocks(rows, 8, torch.float32), x)


def _representable(shape, groups_dim, g):
    """Codes spanning 0..15 along ``groups_dim`` with fp16 steps and minima."""
    q = torch.randint(0, 16, shape, generator=g)
    idx = [slice(None)] * len(shape)
    idx[groups_dim] = 0
    q[tuple(idx)] = 0
    idx[groups_dim] = 1
    q[tuple(idx)] = 15
    return q


@pytest.mark.parametrize("d", [64, 80, 40])
def test_representable_values_round_trip_exactly(d):
    g = torch.Generator().manual_seed(d)
    hkv, t, grp = 3, 7, int4_kv.int4_kv_group_size(d)
    row = int4_kv.int4_kv_row_bytes(d, 16)
    q = _representable((t, hkv, d // grp, grp), -1, g)
    step = (torch.rand(t, hkv, d // grp, 1, generator=g) + 0.01).half().float()
    lo = torch.randn(t, hkv, d // grp, 1, generator=g).half().float()
    x = (q * step + lo).flatten(-2)
    rows = int4_kv.quantize_int4_tokens(x, row)
    assert torch.equal(int4_kv.dequantize_int4_tokens(rows, d, torch.float32), x)
    # Per channel over a block of 16 tokens.
    qb = _representable((2, 16, hkv, d), 1, g)
    stepb = (torch.rand(2, 1, hkv, d, generator=g) + 0.01).half().float()
    lob = torch.randn(2, 1, hkv, d, generator=g).half().float()
    xb = qb * stepb + lob
    blocks = int4_kv.quantize_int4_key_blocks(xb, row)
    assert torch.equal(int4_kv.dequantize_int4_key_blocks(blocks, d, torch.float32), xb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_is_at_most_half_a_step(dtype):
    g = torch.Generator().manual_seed(7)
    hkv, d = 2, 64
    spread = torch.ones(d)
    spread[[3, 40]] = 20.0                        # two outlier channels, as K has
    x = (torch.randn(3, 16, hkv, d, generator=g) * spread).to(dtype)
    x[0, :, 0, 5] = 1.25                          # a constant channel: step 0, exact
    row = int4_kv.int4_kv_row_bytes(d, 16)
    tok = int4_kv.dequantize_int4_tokens(int4_kv.quantize_int4_tokens(x, row), d, torch.float32)
    xf = x.float()
    y = xf.unflatten(-1, (2, 32))
    step = (y.amax(-1) - y.amin(-1)) / 15
    err = (tok - xf).unflatten(-1, (2, 32)).abs().amax(-1)
    # Half a step, plus fp16 rounding of the step (x 15) and of the minimum.
    assert (err <= step * (0.5 + 15 * 2.0 ** -11) + y.abs().amax(-1) * 2.0 ** -10).all()
    ch = int4_kv.dequantize_int4_key_blocks(int4_kv.quantize_int4_key_blocks(x, row), d,
                                            torch.float32)
    step_c = (xf.amax(1) - xf.amin(1)) / 15
    err_c = (ch - xf).abs().amax(1)
    assert (err_c <= step_c * (0.5 + 15 * 2.0 ** -11) + xf.abs().amax(1) * 2.0 ** -10).all()
    assert torch.equal(ch[0, :, 0, 5], torch.full((16,), 1.25))
    # Per channel is the finer grid when a few channels are outliers (KIVI, sec. 3.2).
    assert (ch - xf).abs().mean() < 0.5 * (tok - xf).abs().mean()


# -- the cache write ----------------------------------------------------------------------------

def test_write_plan_kinds_whole_filled_and_open_blocks():
    """One step writes block 3 whole (offsets 0-3), completes block 1 whose first two
    tokens an earlier step put in store entry 0, and opens block 6 (entry 1)."""
    g = torch.Generator().manual_seed(5)
    hkv, d, bs, nb = 2, 16, 4, 8
    row = int4_kv.int4_kv_row_bytes(d, bs)
    kc, vc = torch.zeros(nb, bs, hkv, row, dtype=U8), torch.zeros(nb, bs, hkv, row, dtype=U8)
    store = torch.zeros(2, bs, hkv, d)
    earlier = torch.randn(2, hkv, d, generator=g)
    store[0, :2] = earlier
    k = torch.randn(9, hkv, d, generator=g)
    v = torch.randn(9, hkv, d, generator=g)
    slots = torch.tensor([12, 13, 14, 15, 6, 7, 24, 25, 26])
    plan = int4_kv.Int4WritePlan(
        store_tokens=torch.tensor([4, 5, 6, 7, 8]), store_slots=torch.tensor([2, 3, 4, 5, 6]),
        fill_blocks=torch.tensor([1]), fill_entries=torch.tensor([0]),
        whole_blocks=torch.tensor([3]), whole_starts=torch.tensor([0]),
        seq_open_entries=torch.tensor([1]))
    int4_kv.reshape_and_cache_int4(k, v, kc, vc, slots, store, plan)
    assert torch.equal(kc[3:4], int4_kv.quantize_int4_key_blocks(k[None, 0:4], row))
    block1 = torch.cat([earlier, k[4:6]])[None]
    assert torch.equal(kc[1:2], int4_kv.quantize_int4_key_blocks(block1, row))
    assert torch.equal(kc[6, :3], int4_kv.quantize_int4_tokens(k[6:9], row))   # open: per token
    assert torch.equal(store[1, :3], k[6:9])                                    # exact K kept
    assert torch.equal(vc.view(-1, hkv, row)[slots], int4_kv.quantize_int4_tokens(v, row))


def _tiny_cache(num_blocks=12, num_host_blocks=0):
    from tandem.engine.config import ModelConfig

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=10, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_model_len=256, tie_word_embeddings=True)
    return KVCache(cfg, num_blocks, 4, U8, torch.device("cpu"), num_host_blocks,
                   model_dtype=torch.float32)


def _write(kv, k, v, slots):
    """One step's write of ``k``/``v`` ``[L, T, Hkv, D]`` at ``slots``, as the engine does
    it (no attention follows: the plan's per-sequence entries are not asked for)."""
    plan = kv.plan_int4_write(slots, torch.zeros(0, 1, dtype=torch.int32), [])
    for layer in range(k.shape[0]):
        int4_kv.reshape_and_cache_int4(k[layer], v[layer], kv.tensor[layer, 0], kv.tensor[layer, 1],
                                       torch.tensor(slots), kv.open_keys[layer], plan)


@pytest.mark.parametrize("cuts", [[37], [5] * 7 + [2], [1] * 37, [16, 21], [3, 13, 21]])
def test_blocks_do_not_depend_on_how_the_sequence_is_cut(cuts):
    """37 tokens written in one step, in steps of 5, one at a time, ...: the same bytes
    in every block (K per channel in the 9 full ones), and the open block's exact K
    in the store."""
    g = torch.Generator().manual_seed(11)
    k = torch.randn(2, 37, 2, 16, generator=g) * torch.linspace(0.1, 3, 16)
    v = torch.randn(2, 37, 2, 16, generator=g)
    table = [7, 2, 9, 0, 4, 11, 5, 1, 8, 3]
    slots = [table[p // 4] * 4 + p % 4 for p in range(37)]
    whole = _tiny_cache()
    _write(whole, k, v, slots)
    kv = _tiny_cache()
    start = 0
    for n in cuts:
        _write(kv, k[:, start:start + n], v[:, start:start + n], slots[start:start + n])
        start += n
    assert torch.equal(kv.tensor, whole.tensor)
    assert kv.num_open_entries == 1
    assert torch.equal(kv.open_keys[:, kv._entry_of[3], :1], k[:, 36:37])
    row = kv.tensor.shape[-1]
    assert torch.equal(kv.tensor[1, 0, 9:10],
                       int4_kv.quantize_int4_key_blocks(k[1, None, 8:12], row))


def test_store_entries_follow_copy_on_write_swap_and_rebuild():
    """An open block forked (copy-on-write), swapped out and in, or arriving without
    its entry continues to the same bytes as the original once it fills."""
    g = torch.Generator().manual_seed(12)
    row = int4_kv.int4_kv_row_bytes(16, 4)
    k = torch.randn(2, 8, 2, 16, generator=g)
    v = torch.randn(2, 8, 2, 16, generator=g)
    ref_kv = _tiny_cache()
    _write(ref_kv, k[:, :6], v[:, :6], [0, 1, 2, 3, 4, 5])       # block 0 full, block 1 open
    _write(ref_kv, k[:, 6:], v[:, 6:], [6, 7])                     # block 1 fills
    want = ref_kv.tensor[:, :, 1]
    # Copy-on-write of the open block into block 5, then both continue.
    kv = _tiny_cache()
    _write(kv, k[:, :6], v[:, :6], [0, 1, 2, 3, 4, 5])
    kv.copy_blocks([(1, 5)])
    assert kv.num_open_entries == 2
    _write(kv, k[:, 6:], v[:, 6:], [22, 23])
    assert torch.equal(kv.tensor[:, :, 5], want)
    # Swapped out to host block 2 and back into block 8.
    kv = _tiny_cache(num_host_blocks=4)
    _write(kv, k[:, :6], v[:, :6], [0, 1, 2, 3, 4, 5])
    kv.swap_out([(1, 2)])
    kv.blocks_released([1])
    kv.blocks_allocated([8])
    kv.swap_in([(2, 8)])
    _write(kv, k[:, 6:], v[:, 6:], [34, 35])
    assert torch.equal(kv.tensor[:, :, 8], want)
    # The rows arrive without an entry (a KV transfer): rebuilt from the per-token rows,
    # so the block is quantized per channel from their decoded values.
    kv = _tiny_cache()
    kv.tensor[:, :, 6] = ref_kv.tensor[:, :, 1]
    kv.tensor[:, 0, 6, :2] = int4_kv.quantize_int4_tokens(k[:, 4:6], row)
    kv.blocks_allocated([6])
    _write(kv, k[:, 6:], v[:, 6:], [26, 27])
    decoded = torch.cat([int4_kv.dequantize_int4_tokens(
        int4_kv.quantize_int4_tokens(k[:, 4:6], row), 16, torch.float32), k[:, 6:]], dim=1)
    for layer in range(2):
        assert torch.equal(kv.tensor[layer, 0, 6:7],
                           int4_kv.quantize_int4_key_blocks(decoded[layer, None], row))
    assert kv.num_open_entries == 0


def test_the_store_grows_under_copy_on_write_swap_and_writes():
    """More open blocks than the store's first 8 entries, made by writes, by
    copy-on-write and by swap-in: the store doubles and keeps every entry's K."""
    g = torch.Generator().manual_seed(13)
    kv = _tiny_cache(num_blocks=40, num_host_blocks=4)
    first = kv.open_keys.shape[1]
    k = torch.randn(2, first, 2, 16, generator=g)
    _write(kv, k, k, [4 * i for i in range(first)])          # one token in each of 8 blocks
    assert kv.num_open_entries == first and kv.open_keys.shape[1] == first
    kv.copy_blocks([(0, 20)])                                 # a 9th entry
    assert kv.open_keys.shape[1] == 2 * first
    kv.swap_out([(1, 3)])
    kv.blocks_released([1])
    for b in range(21, 21 + first):                           # fill the grown store
        kv.copy_blocks([(2, b)])
    kv.blocks_allocated([30])
    kv.swap_in([(3, 30)])                                     # needs one more: grows again
    assert kv.open_keys.shape[1] == 4 * first
    for block, token in [(0, 0), (20, 0), (30, 1), (21, 2), (7, 7)]:
        assert torch.equal(kv.open_keys[:, kv._entry_of[block], 0], k[:, token])


def _int4_cache(nb, bs, hkv, d, seed):
    """K blocks all per channel (see :func:`_open_last_blocks`), V rows per token."""
    g = torch.Generator().manual_seed(seed)
    row = int4_kv.int4_kv_row_bytes(d, bs)
    k = torch.randn(nb, bs, hkv, d, generator=g) * torch.linspace(0.2, 4, d)
    kc = int4_kv.quantize_int4_key_blocks(k, row)
    vc = int4_kv.quantize_int4_tokens(torch.randn(nb, bs, hkv, d, generator=g), row)
    return kc, vc, k


def _open_last_blocks(kc, k, tables, seq_lens):
    """Rewrite each sequence's last block, where it is not full, per token."""
    row, bs = kc.shape[-1], kc.shape[1]
    for table, n in zip(tables.tolist(), seq_lens.tolist()):
        if n % bs:
            b = table[n // bs]
            kc[b] = int4_kv.quantize_int4_tokens(k[b], row)


@pytest.mark.parametrize("hq,hkv,d,bs", [(6, 2, 40, 4), (9, 3, 64, 16), (4, 4, 80, 8),
                                         (2, 1, 128, 16)])
def test_decode_attention_over_int4_equals_attention_over_its_dequantization(hq, hkv, d, bs):
    g = torch.Generator().manual_seed(hq * d)
    nb, nblk = 30, 6
    kc, vc, k = _int4_cache(nb, bs, hkv, d, d)
    seq_lens = torch.tensor([1, 7, bs * 3 + 1, bs * 5, bs], dtype=torch.int32)
    tables = torch.randperm(nb, generator=g).view(5, nblk).to(torch.int32)   # no block shared
    _open_last_blocks(kc, k, tables, seq_lens)
    full = int4_kv.full_blocks(seq_lens, nblk, bs)
    kd = int4_kv.dequantize_int4_blocks(kc[tables.long()], d, full, True, torch.float32)
    vd = int4_kv.dequantize_int4_tokens(vc[tables.long()], d, torch.float32)
    # The open-block K store: the open last blocks' exact K, at entries 4, 3, 2.
    entries = torch.tensor([4, 3, 2, -1, -1])
    store = torch.zeros(5, bs, hkv, d)
    kd_store = kd.clone()
    for i, n in enumerate(seq_lens.tolist()):
        if entries[i] >= 0:
            store[entries[i]] = k[tables[i, n // bs]]
            kd_store[i, n // bs] = k[tables[i, n // bs]]
    q = torch.randn(5, hq, d, generator=g)
    dense_tables = torch.arange(5 * nblk, dtype=torch.int32).view(5, nblk)

    def dense(kk):
        return ref.paged_decode_attention_ref(q, kk.reshape(-1, bs, hkv, d),
                                              vd.reshape(-1, bs, hkv, d), dense_tables,
                                              seq_lens, d ** -0.5)

    ops = _compiled_ops()
    for st, en, want in ((None, None, dense(kd)), (store, entries, dense(kd_store))):
        got = ref.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, d ** -0.5, None, st, en)
        cpu = decode_attention_cpu(q, kc, vc, tables, seq_lens, d ** -0.5, int(seq_lens.max()),
                                   st, en)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cpu, want, rtol=1e-5, atol=1e-6)
        if ops is None:
            continue
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
            out = ops.paged_decode_attention(q.to(dtype), kc, vc, tables, seq_lens, d ** -0.5,
                                             k_scale=None if st is None else st.to(dtype),
                                             v_scale=en)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    assert not torch.allclose(dense(kd), dense(kd_store))      # the store was read


def _compiled_ops():
    try:
        from tandem.kernels.cpu import ops
        ops.load_library()
    except (ImportError, RuntimeError):    # CpuKernelsUnavailable: no compiler here
        return None
    return ops


def test_prefill_chunk_after_cached_context_reads_the_int4_cache():
    """A 4-token chunk after 9 cached tokens (two full blocks, one open) through the
    torch backend: the write plan's store, then attention like the reference over
    the dequantized cache with the open block's K from the store."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, nb = 6, 2, 16, 4, 8
    row = int4_kv.int4_kv_row_bytes(d, bs)
    kc, vc = torch.zeros(nb, bs, hkv, row, dtype=U8), torch.zeros(nb, bs, hkv, row, dtype=U8)
    store = torch.zeros(2, bs, hkv, d)
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    k = torch.randn(13, hkv, d, generator=g)
    v = torch.randn(13, hkv, d, generator=g)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(13)])
    empty = torch.zeros(0, dtype=torch.int64)
    first = int4_kv.Int4WritePlan(torch.tensor([8]), torch.tensor([0]), empty, empty,
                                  torch.tensor([5, 2]), torch.tensor([0, 4]), torch.tensor([0]))
    int4_kv.reshape_and_cache_int4(k[:9], v[:9], kc, vc, slots[:9], store, first)
    # The chunk: tokens 9-11 complete block 7 (entry 0), token 12 opens block 0 (entry 1).
    plan = int4_kv.Int4WritePlan(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 4]),
                                 torch.tensor([7]), torch.tensor([0]), empty, empty,
                                 torch.tensor([1]))
    q = torch.randn(4, hq, d, generator=g)
    meta = AttentionMetadata(slot_mapping=slots[9:], block_tables=table,
                             seq_lens=torch.tensor([13], dtype=torch.int32),
                             query_start_loc_cpu=[0, 4], seq_lens_cpu=[13], num_decodes=0,
                             max_seq_len=13, int4_plan=plan)
    got = TorchAttentionBackend().attention(q, k[9:], v[9:], kc, vc, meta, d ** -0.5, store)
    assert torch.equal(kc[7:8], int4_kv.quantize_int4_key_blocks(k[None, 8:12], row))
    full = torch.tensor([True, True, True, False])
    kd = int4_kv.dequantize_int4_blocks(kc[table[0].long()], d, full, True, torch.float32)
    assert torch.equal(store[1, :1], k[12:13])
    kd[3, :1] = k[12:13]                    # the open block's K: exact, from the store
    vd = int4_kv.dequantize_int4_tokens(vc[table[0].long()], d, torch.float32)
    want = ref.paged_prefill_attention_ref(q, kd, vd, torch.arange(4)[None].int(), [0, 4],
                                           [13], d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="int4_plan"):
        TorchAttentionBackend().attention(q, k[9:], v[9:], kc, vc,
                                          dataclasses.replace(meta, int4_plan=None), d ** -0.5)


# -- configuration ---------------------------------------------------------------------------

def test_config_refuses_int4_where_it_cannot_run():
    int4 = CacheConfig(kv_cache_dtype="int4")
    EngineConfig(attention_backend="triton", cache=int4)     # the Triton kernels read it
    with pytest.raises(ValueError, match="batch_invariant.*kv_cache_dtype"):
        EngineConfig(dtype="float32", batch_invariant=True, cache=int4)
    with pytest.raises(ValueError, match="speculative.*int4"):
        EngineConfig(cache=int4, speculative=SpeculativeConfig(method="ngram"))
    from tandem.router.cli import _engine_config, build_parser

    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "int4", "hi"])
    assert _engine_config(args).cache.kv_cache_dtype == "int4"


# -- the real model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auto_llm(f32_weights):
    return LLM(dtype="float32", kv_cache_memory_bytes=MEM, num_host_blocks=0,
               weights_from=f32_weights)


@pytest.fixture(scope="module")
def int4_llm(f32_weights):
    return LLM(dtype="float32", kv_cache_memory_bytes=MEM, kv_cache_dtype="int4",
               num_host_blocks=0, max_num_seqs=INT4_SEQS, weights_from=f32_weights)


def test_int4_cache_holds_5_3_times_the_float32_blocks(auto_llm, int4_llm):
    """Blocks of 48-byte rows, 5.3x the float32 blocks per byte; the open-block K
    store for max_num_seqs sequences comes out of the same budget."""
    cfg = int4_llm.engine.model_config
    assert KVCache.bytes_per_block(cfg, 16, U8) == INT4_BLOCK
    assert KVCache.open_entry_bytes(cfg, 16, torch.float32) == STORE_ENTRY
    assert auto_llm.engine.kv_cache.num_blocks == 40
    blocks = (MEM - INT4_SEQS * STORE_ENTRY) // INT4_BLOCK
    assert int4_llm.engine.kv_cache.num_blocks == blocks == 192
    kv = int4_llm.engine.kv_cache
    assert kv.tensor.shape == (30, 2, 192, 16, 3, 48) and kv.tensor.dtype == U8
    assert kv.scales is None                        # every row or block has its own
    assert kv.open_keys.dtype == torch.float32
    assert kv.open_keys.shape == (30, INT4_SEQS, 16, 3, 64)
    held = kv.tensor.numel() + kv.open_keys.numel() * 4
    assert MEM - INT4_BLOCK < held <= MEM
    with pytest.raises(ValueError, match="kv_cache_memory_bytes.*open-block K store"):
        LLM(dtype="float32", kv_cache_memory_bytes=INT4_SEQS * STORE_ENTRY,
            kv_cache_dtype="int4", max_num_seqs=INT4_SEQS, weights_from=auto_llm)


def test_the_store_and_the_blocks_hold_the_models_keys(auto_llm, int4_llm):
    """Layer 0's K does not depend on the KV dtype (no attention before it): after a
    37-token prompt the int4 cache holds blocks 0-1 per channel from exactly those
    K values, and the open block's 5 tokens are in the store, exactly."""
    ids = auto_llm.tokenizer.encode(PROMPTS[3] * 4)[:37]
    e, dense = int4_llm.engine, auto_llm.engine
    two = dataclasses.replace(GREEDY, max_tokens=2)
    reqs = [eng.add_request(ids, two, "probe")[0] for eng in (e, dense)]
    for eng, req in zip((e, dense), reqs):
        eng.step()                                   # the whole prompt in one step
        assert req.num_computed_tokens == 37 and not req.is_finished
    blocks = e.kv_cache_manager.get_block_ids("probe")
    ref_blocks = dense.kv_cache_manager.get_block_ids("probe")
    kv, k_dense = e.kv_cache, dense.kv_cache.tensor[0, 0]                 # [NB, BS, Hkv, D]
    row = kv.tensor.shape[-1]
    for i in range(2):
        want = int4_kv.quantize_int4_key_blocks(k_dense[ref_blocks[i]][None], row)[0]
        assert torch.equal(kv.tensor[0, 0, blocks[i]], want)
    entry = kv._entry_of[blocks[2]]
    assert torch.equal(kv.open_keys[0, entry, :5], k_dense[ref_blocks[2], :5])
    assert torch.equal(kv.tensor[0, 0, blocks[2], :5],
                       int4_kv.quantize_int4_tokens(k_dense[ref_blocks[2], :5], row))
    for eng in (e, dense):
        while eng.has_unfinished_requests():
            eng.step()
    assert kv.num_open_entries == 0


def test_greedy_tokens_and_prompt_logprobs_close_to_model_dtype_kv(auto_llm, int4_llm):
    """Measured (float32 model, these prompts, 16 tokens each): the first divergence
    comes after 16, 5, 16 and 16 tokens (83% of the tokens before it) with the
    compiled kernels and with torch; the 50 scored prompt tokens' logprobs differ by
    0.17 / 0.20 on average, 0.80 / 0.79 at most, their mean NLL rises by 0.026 /
    0.045 nats. (benchmarks/kv_quant_quality.py and perplexity.py measure the same on
    ~1,000 and ~1,700 held-out tokens.) The bounds leave room for other CPUs'
    rounding, which 4-bit steps amplify: one flipped code changes every later
    layer's input."""
    text = " ".join(PROMPTS) + " The river rose slowly through the night, and by morning " \
        "the lower fields were under water while the engineers measured the flow."
    ids = auto_llm.tokenizer.encode(text)
    lp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    a = [x.logprob for x in auto_llm.generate([ids], lp)[0].prompt_logprobs[1:]]
    b = [x.logprob for x in int4_llm.generate([ids], lp)[0].prompt_logprobs[1:]]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert len(diffs) == len(ids) - 1
    assert sum(diffs) / len(diffs) < 0.3 and max(diffs) < 1.5
    assert abs(sum(b) - sum(a)) / len(a) < 0.1
    want = [o.outputs[0].token_ids for o in auto_llm.generate(PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in int4_llm.generate(PROMPTS, GREEDY)]
    before = [next((i for i, (x, y) in enumerate(zip(w, g)) if x != y), len(w))
              for w, g in zip(want, got)]
    assert all(n >= 1 for n in before)                   # the first token always agrees
    assert sum(before) >= 0.5 * sum(map(len, want)), before


LONG = PROMPTS[3] + " there lived an old clockmaker who repaired the clocks of the whole valley"


def _agreeing(want: list[int], got: list[int]) -> float:
    """Fraction of ``want`` that ``got`` repeats before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), len(want)) / len(want)


def test_prefix_hits_chunking_and_parallel_samples_run_through_the_store(int4_llm):
    """A prefix-cache hit, chunks of 5 tokens (blocks completed from the store) and
    n = 3 samples (open blocks copied on write, entries with them) give the tokens
    of the plain run (all five runs equal here). The rounding of matmuls over other batch shapes
    differs in the last bits, which can flip a 4-bit code (the bytes test above
    shows that nothing else differs); the bound leaves room for other CPUs.
    Entries and blocks are freed on every path."""
    prompt = int4_llm.tokenizer.encode(LONG)
    assert len(prompt) % 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = int4_llm.generate([prompt], params)[0].outputs[0].token_ids
    hit = int4_llm.generate([prompt], params)[0]                 # the prefix cache holds it
    assert hit.num_cached_tokens >= 16
    three = int4_llm.generate([prompt], dataclasses.replace(params, n=3))[0]
    chunked = LLM(dtype="float32", num_blocks=32, kv_cache_dtype="int4", num_host_blocks=0,
                  max_num_batched_tokens=5, enable_prefix_caching=False, weights_from=int4_llm)
    runs = [hit.outputs[0].token_ids, *(c.token_ids for c in three.outputs),
            chunked.generate([prompt], params)[0].outputs[0].token_ids]
    assert all(_agreeing(want, got) >= 0.5 for got in runs), runs
    for llm in (int4_llm, chunked):
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks and llm.engine.kv_cache.num_open_entries == 0


def test_every_exit_path_frees_blocks_and_store_entries(int4_llm):
    """Finish, stop string, abort, and an error raised inside ``generate``."""
    e = int4_llm.engine
    kv = e.kv_cache_manager
    out = int4_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40,
                                                        stop=["."]))[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert kv.num_free_blocks == kv.num_blocks and e.kv_cache.num_open_entries == 0
    ids = int4_llm.tokenizer.encode(PROMPTS[3])
    req = e.add_request(ids, GREEDY, "abort-me")[0]
    for _ in range(3):
        e.step()
    assert kv.num_free_blocks < kv.num_blocks and e.kv_cache.num_open_entries == 1
    assert e.abort_request("abort-me")
    e.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks and req.is_finished
    assert e.kv_cache.num_open_entries == 0

    def fail(engine):                        # an error in the middle of a generate call
        if engine.kv_cache.num_open_entries:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        int4_llm.generate(PROMPTS, dataclasses.replace(GREEDY, n=2), step_callback=fail)
    assert not e.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks and e.kv_cache.num_open_entries == 0
    again = int4_llm.generate(PROMPTS[:1], GREEDY)[0]          # the engine still serves
    assert len(again.outputs[0].token_ids) == GREEDY.max_tokens


def test_more_open_blocks_than_the_reserved_store_holds(int4_llm):
    """The engine reserves one store entry per sequence (max_num_seqs 8, counted in
    its KV budget); n = 9 samples of a prompt ending inside a block fork open blocks
    by copy-on-write while the shared one is still held, more than 8 at once: the
    store grows, and everything is freed after."""
    llm = LLM(dtype="float32", num_blocks=64, kv_cache_dtype="int4", num_host_blocks=0,
              max_num_seqs=8, weights_from=int4_llm)
    assert llm.engine.kv_cache.open_keys.shape[1] == 8
    prompt = llm.tokenizer.encode(LONG)
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, n=9, max_tokens=12,
                                                ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [12] * 9
    assert llm.engine.kv_cache.open_keys.shape[1] >= 16
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and llm.engine.kv_cache.num_open_entries == 0


def test_swap_preemption_moves_rows_and_store_entries_and_keeps_tokens(int4_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in int4_llm.generate(PROMPTS[:3], params)]
    small = LLM(dtype="float32", num_blocks=4, num_host_blocks=12, kv_cache_dtype="int4",
                preemption_mode="swap", weights_from=int4_llm)
    got = [o.outputs[0].token_ids for o in small.generate(PROMPTS[:3], params)]
    assert small.engine.num_preemptions > 0
    # Equal here; preemption changes the batches, whose matmuls can round differently
    # in the last bits on other CPUs and flip a 4-bit code (the entries' moves are
    # checked exactly in test_store_entries_follow_copy_on_write_swap_and_rebuild).
    assert all(_agreeing(w, g) >= 0.5 for w, g in zip(want, got)), (want, got)
    kv = small.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    assert small.engine.kv_cache.num_open_entries == 0


# -- KV transfer -----------------------------------------------------------------------------

def _remote_prefill(producer, consumer, prompt, rid):
    """One request prefilled on ``producer`` and decoded on ``consumer`` (the drivers of
    tests/test_disagg_engine.py); returns it and the number of blocks that moved."""
    req, ticket = _reserve(consumer, rid, prompt, GREEDY)
    done = _prefill(producer, rid, prompt, GREEDY, ticket)
    assert done.status is RequestStatus.FINISHED_LENGTH
    consumer.start_decode(rid, done.output_token_ids[0])
    _run_until(consumer, lambda: req.is_finished)     # waits for the layers, however slow
    return req, len(ticket["dst_block_ids"])


def test_int4_remote_prefill_and_the_layout_handshake(auto_llm, int4_llm):
    """The packed rows travel as they are. A prompt of whole blocks decodes the tokens
    of the colocated engine; one that ends inside a block arrives without its store
    entry, which the decode side rebuilds from the block's per-token rows."""
    cfg = int4_llm.config
    producer = LLMEngine(cfg, weights_from=int4_llm.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    consumer = LLMEngine(cfg, weights_from=int4_llm.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    f32_peer = LLMEngine(auto_llm.config, weights_from=auto_llm.engine, kv_transport="gloo")
    try:
        wire = consumer.kv_connector.layout()
        layout = KVLayout.from_dict(wire)
        assert (layout.dtype, layout.head_dim, layout.kv_scales_checksum) == ("uint8", 48, "")
        rdv = consumer.kv_connector.open_channel("prefill-0", "127.0.0.1")
        with pytest.raises(KVLayoutMismatchError,
                           match="head_dim prefill=64 decode=48; dtype prefill=float32 decode=uint8"):
            f32_peer.kv_connector.connect("decode-0", rdv, wire)
        producer.kv_connector.connect("decode-0", rdv, wire)
        aligned = int4_llm.tokenizer.encode(LONG * 3)[:32]
        want = int4_llm.generate([aligned], GREEDY)[0].outputs[0].token_ids
        req, n = _remote_prefill(producer, consumer, aligned, "r1")
        assert req.output_token_ids == want
        assert producer.kv_connector.kv_transfer_bytes == n * INT4_BLOCK
        unaligned = int4_llm.tokenizer.encode(LONG)
        req, _ = _remote_prefill(producer, consumer, unaligned, "r2")
        assert req.is_finished and len(req.output_token_ids) == GREEDY.max_tokens
        for e in (producer, consumer):
            while e.has_unfinished_requests():
                e.step()
            assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks
            assert e.kv_cache.num_open_entries == 0
    finally:
        for e in (producer, consumer, f32_peer):
            e.kv_connector.close()
