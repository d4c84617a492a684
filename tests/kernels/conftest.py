"""Kernel tests run natively on CUDA and under the Triton interpreter on CPU.

``TRITON_INTERPRET`` must be set before the kernel modules are imported (Triton
decides at ``@triton.jit`` time whether a kernel is interpreted), hence here,
before any test module of this folder is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402



def make_attention_batch(paged_kv, device: torch.device, dtype: torch.dtype,
                         decode_lens: list[int], prefill_chunks: list[tuple[int, int]],
                         hq: int, hkv: int, d: int, bs: int, seed: int = 0):
    """One step's attention inputs, decodes first: caches holding every context
    token (:func:`make_paged_kv`), the step's fresh q/k/v (views of one fused
    projection, as the model passes them) and its metadata. ``prefill_chunks``:
    ``(query length, context length)`` each.

    Returns:
        ``(q [T, hq, d], k [T, hkv, d], v [T, hkv, d], key_cache, value_cache, meta)``.
    """
    from tandem.kernels.attention_backend import AttentionMetadata

    seq_lens = decode_lens + [s for _, s in prefill_chunks]
    q_lens = [1] * len(decode_lens) + [q for q, _ in prefill_chunks]
    _, _, k_cache, v_cache, tables = paged_kv(seq_lens, hkv, d, bs, dtype, device, seed=seed)
    qsl, slots = [0], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        qsl.append(qsl[-1] + q_len)
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    t = qsl[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, num_decodes=len(decode_lens),
        max_seq_len=max(seq_lens))
    return (q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), k_cache, v_cache,
            meta)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_paged_kv(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, device: torch.device, seed: int = 0,
                  spare_blocks: int = 3):
    """A poisoned paged cache holding random K/V for each sequence.

    Blocks are handed out in a shuffled order (block tables are neither
    contiguous nor sorted) and rows are padded with block 0. Every slot that
    holds no token of any sequence is NaN, so a kernel that reads past a
    sequence's context shows NaN; ``clean`` copies with those slots zeroed are
    what the references see.

    Returns:
        ``(key_cache, value_cache, key_clean, value_clean, block_tables)``,
        caches ``[NB, BS, Hkv, D]``, block tables ``[B, max_blocks]`` int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    # Block 0 is the padding value of the tables; keep it out of every sequence.
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    for i, (n, nblk) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = torch.tensor([perm.pop() for _ in range(nblk)], dtype=torch.int64)
        block_tables[i, :nblk] = ids.to(torch.int32)
        t = torch.arange(n)
        slots = ids[t // block_size] * block_size + t % block_size
        flat_k[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_v[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    key_clean = torch.nan_to_num(key_cache, nan=0.0)
    value_clean = torch.nan_to_num(value_cache, nan=0.0)
    return (key_cache.to(device), value_cache.to(device), key_clean.to(device),
            value_clean.to(device), block_tables.to(device))


@pytest.fixture
def paged_kv():
    return make_paged_kv
