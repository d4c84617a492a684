"""Gathering a layer's blocks for the wire and scattering them back into a cache.

A layer of the cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
blocks travel as one contiguous ``[2, n, block_size, num_kv_heads, head_dim]``
tensor in the order of the ticket's block ids.

On CPU the copies go through numpy on a byte view of the tensors. torch's
``index_select`` / ``index_copy_`` split these small copies over OpenMP threads,
and when another process (the peer worker, the model) holds the cores, an
OpenMP barrier waits for a descheduled thread: measured on 2 cores, a
128-token, 30-layer receive took 95-530 ms instead of ~10 ms, and an
``index_copy_`` of 128 bfloat16 blocks took 4.9 ms against numpy's 0.03 ms.
numpy's fancy indexing copies each block's bytes in the calling thread only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def _bytes_view(layer_cache: torch.Tensor) -> np.ndarray | None:
    """numpy uint8 view ``[2, NB, bs, heads, head_dim * itemsize]`` sharing memory, or
    None if impossible. A view of some of a cache's heads (a tensor-parallel pair's,
    strided in the heads' dimension) works too: numpy copies through the strides."""
    if layer_cache.device.type != "cpu" or layer_cache.stride(-1) != 1 or layer_cache.requires_grad:
        return None
    return layer_cache.view(torch.uint8).numpy()


def gather_blocks(layer_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy of ``layer_cache[:, block_ids]``: ``[2, len(block_ids), bs, heads, head_dim]``, contiguous, same dtype and device."""
    view = _bytes_view(layer_cache)
    if view is None:
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=layer_cache.device)
        return layer_cache.index_select(1, index)
    gathered = np.take(view, np.asarray(block_ids, dtype=np.int64), axis=1)
    return torch.from_numpy(gathered).view(layer_cache.dtype)


def scatter_blocks(layer_cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """``layer_cache[:, block_ids] = blocks`` in place; ``blocks`` is ``[2, len(block_ids), bs, heads, head_dim]``.

    Raises:
        ValueError: ``blocks`` has another shape or dtype than the destination blocks.
    """
    expected = (layer_cache.shape[0], len(block_ids), *layer_cache.shape[2:])
    if tuple(blocks.shape) != expected or blocks.dtype != layer_cache.dtype:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} do not fit "
                         f"{expected} {layer_cache.dtype}")
    view = _bytes_view(layer_cache)
    if view is None:
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=layer_cache.device)
        layer_cache.index_copy_(1, index, blocks.to(layer_cache.device))
        return
    source = blocks.detach().cpu().contiguous()
    view[:, np.asarray(block_ids, dtype=np.int64)] = source.view(torch.uint8).numpy()
