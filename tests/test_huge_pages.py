"""The loaded weights' memory collapsed into transparent huge pages
(tandem.engine.runtime.huge_pages)."""

from __future__ import annotations

import mmap
import platform

import pytest
import torch

from tandem.engine.runtime.huge_pages import (HUGE_PAGE, HugePagesForNewMemory,
                                              anonymous_regions, new_memory)


def test_new_memory_is_the_part_no_earlier_range_covers():
    before = [(0x1000, 0x5000), (0x9000, 0xA000)]
    after = [(0x1000, 0x8000), (0x9000, 0xA000), (0xB000, 0xC000), (0x20000, 0x30000)]
    assert new_memory(after, before) == [(0x5000, 0x8000), (0xB000, 0xC000), (0x20000, 0x30000)]
    # a hole punched in a new range by an old one, and a range that shrank
    assert new_memory([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert new_memory([(0, 100)], [(0, 200)]) == []
    assert new_memory([(0, 100)], []) == [(0, 100)]


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def _huge_kib_in(start: int, end: int) -> int:
    """AnonHugePages (KiB) of the mappings of /proc/self/smaps overlapping [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and len(line.split()) >= 5 and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < end and b > start
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(_thp_mode() == "never" or not _kernel_at_least(6, 1),
                    reason="needs transparent huge pages and MADV_COLLAPSE (Linux 6.1+)")
def test_memory_mapped_in_the_block_ends_in_huge_pages_with_its_data():
    expected = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    with HugePagesForNewMemory() as hp:
        # A mapping of its own: a tensor from malloc may reuse heap memory an earlier
        # test freed (not new, so left as it is), as in a long-lived process.
        buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        weight = torch.frombuffer(buf, dtype=torch.float32).view(4096, 4096)
        weight.copy_(expected)
    assert torch.equal(weight, expected)                    # collapsing moved no data
    start = weight.data_ptr()
    assert hp.collapsed >= 30 * HUGE_PAGE
    assert _huge_kib_in(start, start + weight.numel() * 4) >= 30 * HUGE_PAGE // 1024
    assert any(a <= start < b for a, b in anonymous_regions())


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    with HugePagesForNewMemory() as hp:
        buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        weight = torch.frombuffer(buf, dtype=torch.float32).view(4096, 4096)
        weight.fill_(1.0)
    assert not hp.enabled and hp.collapsed == 0
    assert weight.sum().item() == 4096 * 4096
    if _thp_mode() == "madvise":     # nothing else gives this new mapping huge pages
        assert _huge_kib_in(weight.data_ptr(), weight.data_ptr() + weight.numel() * 4) == 0
