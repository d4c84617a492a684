"""Block gather/scatter against torch's own indexing, for every KV dtype."""

import pytest
import torch

from tandem.kvtransfer.blocks import gather_blocks, scatter_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layer(dtype, num_blocks=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, 16, 3, 8, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_index_select(dtype):
    layer = _layer(dtype)
    ids = [7, 0, 4, 5]
    gathered = gather_blocks(layer, ids)
    assert gathered.dtype == dtype and gathered.shape == (2, 4, 16, 3, 8) and gathered.is_contiguous()
    assert torch.equal(gathered, layer.index_select(1, torch.tensor(ids)))
    gathered.fill_(0)  # a copy, not a view
    assert torch.equal(layer, _layer(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_the_named_blocks(dtype):
    layer = torch.full((2, 9, 16, 3, 8), -3.0, dtype=dtype)
    blocks = _layer(dtype, num_blocks=3, seed=1)
    scatter_blocks(layer, [8, 2, 5], blocks)
    expected = torch.full_like(layer, -3.0)
    expected[:, [8, 2, 5]] = blocks
    assert torch.equal(layer, expected)


def test_non_contiguous_cache_takes_the_torch_path():
    layer = _layer(torch.float32).transpose(3, 4).contiguous().transpose(3, 4)  # [2, 9, 16, 3, 8], not contiguous
    assert not layer.is_contiguous()
    assert torch.equal(gather_blocks(layer, [3, 1]), layer[:, [3, 1]])
    blocks = _layer(torch.float32, num_blocks=2, seed=2)
    scatter_blocks(layer, [6, 0], blocks)
    assert torch.equal(layer[:, [6, 0]], blocks)


def test_scatter_rejects_a_wrong_shape_or_dtype():
    layer = torch.zeros(2, 9, 16, 3, 8)
    with pytest.raises(ValueError, match=r"blocks \(2, 2, 16, 3, 8\) torch.float32 do not fit "
                                         r"\(2, 3, 16, 3, 8\) torch.float32"):
        scatter_blocks(layer, [0, 1, 2], torch.zeros(2, 2, 16, 3, 8))
    with pytest.raises(ValueError, match="torch.bfloat16 do not fit"):
        scatter_blocks(layer, [0], torch.zeros(2, 1, 16, 3, 8, dtype=torch.bfloat16))
