"""What a KV transfer moves: the cache layout both ends must share, and the ticket.

The engine keeps one KV cache tensor per worker::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
               (index 0 of dim 1 is K, 1 is V)

Layer ``l``'s blocks ``b`` are ``kv_cache[l, :, b]``. ``num_blocks`` is a local
capacity and may differ between the two ends; every other dimension and the dtype
must match (:func:`check_compatible`).

A :class:`KVTransferTicket` is the decode side's reservation for one request. Its
``dst_block_ids`` cover the whole sequence; the decode side may already hold a
prefix (prefix caching), so only the blocks from ``num_cached_tokens // block_size``
on travel::

    tokens   | 0 ........ 31 | 32 ....... 63 | 64 ..... 79 |   num_tokens = 80
    blocks   |   b0    b1    |   b2    b3    |    b4       |   block_size = 16
    cached   |<-- num_cached_tokens = 32 --->|
    sent                     |    b2    b3        b4       |   sent_block_indices() = range(2, 5)

This module imports only torch (for dtype names) and is plain data otherwise.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

# dtype names accepted in a layout, and their torch dtypes. Kept explicit so a
# ticket coming from another process can never name an arbitrary torch attribute.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


class KVLayoutMismatchError(ValueError):
    """The two ends of a transfer disagree on the KV cache layout.

    The message names every mismatched field with both values, e.g.
    ``KV layout mismatch: block_size prefill=16 decode=32``.
    """


@dataclass(frozen=True)
class KVLayout:
    """Per-worker KV cache layout that must match across a transfer.

    Attributes:
        num_layers: transformer layers (dim 0 of the cache).
        block_size: tokens per block (dim 3).
        num_kv_heads: KV heads held by this worker (dim 4).
        head_dim: elements per head (dim 5); for an int4 cache the packed row's
            bytes (48 for a head dim of 64 and blocks of 16).
        dtype: element type name: ``"float32"``, ``"bfloat16"``, ``"float16"``,
            ``"float8_e4m3fn"`` (``kv_cache_dtype fp8_e4m3``) or ``"uint8"``
            (``kv_cache_dtype int4``: packed rows).
        kv_scales_checksum: for an fp8 cache, :func:`tandem.engine.runtime.kv_scales.scales_checksum`
            of the scales its bytes were quantized with (both ends
            calibrate them independently; equal checksums mean the bytes mean the
            same); ``""`` for a cache in the model dtype.

    Raises:
        ValueError: a non-positive dimension or an unknown dtype name.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_scales_checksum: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, kv_scales_checksum: str = "") -> KVLayout:
        """Layout of a ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
        cache (quantized with scales of checksum ``kv_scales_checksum``, if fp8).

        Raises:
            ValueError: the tensor is not 6-D with size 2 in dim 1, or has an
                unsupported dtype.
        """
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv_cache.shape)}")
        name = str(kv_cache.dtype).removeprefix("torch.")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(num_layers, block_size, num_kv_heads, head_dim, name, kv_scales_checksum)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes of one block of one layer, K and V together: ``2 * block_size * heads * head_dim * elem``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``num_blocks`` blocks of one layer as they travel: ``[2, num_blocks, block_size, heads, head_dim]``."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: missing or unknown keys, or invalid values.
        """
        return cls(**_exact_keys(cls, data))


def check_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise if KV computed with the ``prefill`` layout cannot land in a ``decode`` cache.

    Raises:
        KVLayoutMismatchError: one line per mismatched field, in field order, e.g.::

            KV layout mismatch: block_size prefill=16 decode=32; dtype prefill=float32 decode=bfloat16
    """
    diffs = [f"{f.name} prefill={getattr(prefill, f.name)} decode={getattr(decode, f.name)}"
             for f in fields(KVLayout) if getattr(prefill, f.name) != getattr(decode, f.name)]
    if diffs:
        raise KVLayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))


@dataclass(frozen=True)
class KVTransferTicket:
    """The decode side's reservation for one request's KV; small enough for any control plane.

    Attributes:
        request_id: the request this KV belongs to (for errors and logs).
        transfer_id: non-negative id, unique among the transfers in flight on one
            sender/receiver pair; the receiver matches arriving layers by it.
        dst_block_ids: destination block ids for the whole sequence, one per
            ``block_size`` tokens: ``len == ceil(num_tokens / block_size)``; those
            that receive data are distinct, and distinct from the others.
        num_cached_tokens: leading tokens whose KV the decode side already holds
            (prefix cache) or does not need (before its first block inside a
            sliding window, where every layer's window has passed them); blocks
            wholly inside that prefix are not sent.
        num_tokens: tokens of the sequence whose KV exists after prefill.
        layout: the destination cache's layout.
        attempt: the router's attempt number for the request (0 first), for logs
            and for a control plane telling a late attempt from the current one.
        producer_generation: the incarnation (cluster registry generation) of the
            producer the decode side's channel was opened for; a producer of any
            other generation refuses the ticket, so a zombie never writes into
            blocks reserved for its successor.

    Raises:
        ValueError: inconsistent counts, negative or duplicate block ids, a
            negative attempt or generation.
    """

    request_id: str
    transfer_id: int
    dst_block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_tokens: int
    layout: KVLayout
    attempt: int = 0
    producer_generation: int = 0

    def __post_init__(self) -> None:
        # Accept a list for convenience but store a tuple: the dataclass is frozen and
        # hashable, and a list would let a caller mutate the reservation afterwards.
        object.__setattr__(self, "dst_block_ids", tuple(int(b) for b in self.dst_block_ids))
        if self.transfer_id < 0:
            raise ValueError(f"transfer_id must be >= 0, got {self.transfer_id}")
        for name in ("attempt", "producer_generation"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if not 0 <= self.num_cached_tokens <= self.num_tokens:
            raise ValueError(f"num_cached_tokens must be in [0, num_tokens={self.num_tokens}], "
                             f"got {self.num_cached_tokens}")
        num_blocks = -(-self.num_tokens // self.layout.block_size)
        if len(self.dst_block_ids) != num_blocks:
            raise ValueError(
                f"dst_block_ids has {len(self.dst_block_ids)} ids, but {self.num_tokens} tokens "
                f"at block_size {self.layout.block_size} need {num_blocks}")
        if any(b < 0 for b in self.dst_block_ids):
            raise ValueError(f"dst_block_ids must be >= 0, got {list(self.dst_block_ids)}")
        # Blocks that receive data must be distinct, and none of them may also be an
        # unsent leading block; the unsent ones may repeat a placeholder (a
        # sliding-window model's null block).
        sent = self.sent_dst_block_ids
        unsent = self.dst_block_ids[:len(self.dst_block_ids) - len(sent)]
        if len(set(sent)) != len(sent) or not set(sent).isdisjoint(unsent):
            raise ValueError(f"dst_block_ids must be distinct, got {list(self.dst_block_ids)}")

    def sent_block_indices(self) -> range:
        """Indices into the sequence's blocks (and ``dst_block_ids``) whose KV travels.

        A partly cached block is sent whole: the prefix cache only shares full blocks,
        so a partial one is the receiver's private copy and gets overwritten.
        """
        return range(self.num_cached_tokens // self.layout.block_size, len(self.dst_block_ids))

    @property
    def sent_dst_block_ids(self) -> tuple[int, ...]:
        """Destination block ids that receive data, in sequence order."""
        return self.dst_block_ids[self.num_cached_tokens // self.layout.block_size:]

    @property
    def num_sent_blocks(self) -> int:
        return len(self.sent_block_indices())

    @property
    def bytes_per_layer(self) -> int:
        """Bytes sent for each layer: ``num_sent_blocks * layout.bytes_per_block_per_layer``."""
        return self.num_sent_blocks * self.layout.bytes_per_block_per_layer

    def to_dict(self) -> dict[str, Any]:
        """Plain Python types only (str, int, list, dict): safe for Ray, JSON or protobuf Struct."""
        return {
            "request_id": self.request_id,
            "transfer_id": self.transfer_id,
            "dst_block_ids": list(self.dst_block_ids),
            "num_cached_tokens": self.num_cached_tokens,
            "num_tokens": self.num_tokens,
            "layout": self.layout.to_dict(),
            "attempt": self.attempt,
            "producer_generation": self.producer_generation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferTicket:
        """Inverse of :meth:`to_dict`. A dict from before ``attempt`` and
        ``producer_generation`` existed loads with both 0.

        Raises:
            ValueError: missing or unknown keys, or invalid values.
        """
        values = _exact_keys(cls, data)
        values["layout"] = KVLayout.from_dict(values["layout"])
        values["dst_block_ids"] = tuple(values["dst_block_ids"])
        return cls(**values)


def _exact_keys(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Copy of ``data`` after checking its keys are ``cls``'s fields: all of them,
    except that fields with a default (added later) may be missing.

    Strict so that a peer running a different version fails loudly instead of
    silently dropping a field it does not know.
    """
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing, unknown = required - data.keys(), data.keys() - names
    if missing or unknown:
        raise ValueError(f"{cls.__name__}.from_dict: missing keys {sorted(missing)}, "
                         f"unknown keys {sorted(unknown)}")
    return dict(data)
