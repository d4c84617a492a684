"""CPU memory in transparent huge pages (2 MiB): the paged KV cache, and the model's
weights once they are loaded.

A decode step reads every weight and every cached K/V row of its batch; with 4 KiB
pages each 4 KiB of them costs a TLB entry. The KV cache is allocated in its own
2 MiB-aligned mapping advised for huge pages (:func:`zeros_in_huge_pages`). The
weights are allocated by torch and oneDNN (the packed linear weights are opaque
tensors whose memory Tandem cannot place), so after loading, the anonymous memory
the load added is collapsed into huge pages where it lies
(:func:`collapse_into_huge_pages`, Linux's ``MADV_COLLAPSE``, kernel 6.1 or later).
``TANDEM_HUGE_PAGES=0`` keeps the loaded weights in 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
"""Bytes of one transparent huge page on x86-64."""

MADV_COLLAPSE = 25
"""Linux's ``madvise`` advice that backs a range with huge pages synchronously
(include/uapi/asm-generic/mman-common.h; kernel 6.1+); Python's mmap module lacks it."""

Region = tuple[int, int]
"""A virtual address range ``[start, end)`` in bytes."""


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in its own anonymous mapping, 2 MiB aligned and
    advised for transparent huge pages (``MADV_HUGEPAGE``).

    Decode attention reads blocks scattered over the whole KV cache; with 4 KiB
    pages nearly every block costs TLB misses (decode attention over randomly
    placed blocks, 64 sequences x 30 layers: 34.6 ms with 4 KiB pages, 31.1 ms
    with huge pages). Falls back to ``torch.zeros`` for small tensors or where
    ``madvise`` is unavailable. The mapping lives as long as the tensor; all of it
    is committed at once, like ``torch.zeros``.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:   # THP disabled in this kernel: plain pages, still correct
        pass
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % HUGE_PAGE
    tensor = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
    # Fault every page in now (the mapping reads as zeros already): first touches
    # later, with compaction to find huge pages, would stall the first steps.
    return tensor.zero_()


def anonymous_regions(maps: str = "/proc/self/maps") -> list[Region]:
    """This process's private anonymous read-write mappings (the ``[heap]`` and the
    unnamed ones: where malloc, torch and oneDNN put tensors), sorted; ``[]`` where
    ``maps`` cannot be read (not Linux)."""
    regions = []
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if fields[1].startswith("rw") and fields[1][3] == "p" and path in ("", "[heap]"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    regions.append((start, end))
    except OSError:
        return []
    return sorted(regions)


def new_memory(after: list[Region], before: list[Region]) -> list[Region]:
    """The parts of the sorted ranges ``after`` that no range of ``before`` covers:
    the anonymous memory mapped (or the heap grown) between two
    :func:`anonymous_regions` calls."""
    out = []
    for start, end in after:
        for b_start, b_end in before:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def collapse_into_huge_pages(regions: list[Region]) -> int:
    """Back the 2 MiB-aligned parts of ``regions`` with transparent huge pages now
    (``madvise(MADV_COLLAPSE)``), whatever the system's THP mode short of ``never``.

    The data stays where it is; a partly used 2 MiB range becomes wholly resident
    (an engine process of 1.75 GB grew by 30-40 MB when all of its anonymous
    memory was collapsed). Ranges the kernel refuses (memory locked, a huge page
    not available) keep their pages.

    Returns:
        Bytes now in huge pages; 0 where the kernel lacks ``MADV_COLLAPSE`` or THP
        is disabled.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for start, end in regions:
        start = -(-start // HUGE_PAGE) * HUGE_PAGE
        end = end // HUGE_PAGE * HUGE_PAGE
        if end - start < HUGE_PAGE:
            continue
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
        elif ctypes.get_errno() == 22:    # EINVAL: no MADV_COLLAPSE here, or THP 'never'
            return done
    return done


class HugePagesForNewMemory:
    """``with HugePagesForNewMemory(): load()`` collapses the anonymous memory the
    block added (:func:`new_memory`) into huge pages when it ends without error;
    nothing where ``TANDEM_HUGE_PAGES=0``. ``collapsed`` holds the bytes.

    The offline engine's decode step with the weights so collapsed against in 4
    KiB pages, two engines in one process (SmolLM2-135M, 2-core AMX host): 2-5%
    shorter at 1 and 64 sequences, bfloat16 and float32
    (``benchmarks/huge_page_weights.py``; benchmarks/README.md, "The weights in
    huge pages").
    """

    def __init__(self):
        self.enabled = os.environ.get("TANDEM_HUGE_PAGES", "1") != "0"
        self.collapsed = 0
        self._before: list[Region] = []

    def __enter__(self) -> "HugePagesForNewMemory":
        if self.enabled:
            self._before = anonymous_regions()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled and exc_type is None:
            self.collapsed = collapse_into_huge_pages(new_memory(anonymous_regions(),
                                                                 self._before))
            logger.debug("%.0f MiB of loaded weights in huge pages", self.collapsed / 2**20)
