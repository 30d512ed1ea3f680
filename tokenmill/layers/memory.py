"""Host memory for the weights a CPU step streams: one private anonymous mapping that the OS may back with 2 MiB
pages (transparent huge pages, where the kernel grants them to mappings that ask: "madvise" or "always" in
/sys/kernel/mm/transparent_hugepage/enabled). A one-row step reads every weight once; on 4 KiB pages that is a TLB
miss every 4 KiB, which a VM's nested page tables make dear."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

ALIGN = 64  # bytes: each copy starts on a cache line, at a boundary every dtype's view accepts
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_granted() -> bool:
    """Whether this OS backs a mapping that asks (MADV_HUGEPAGE) with huge pages: Linux with transparent huge pages
    set to "always" or "madvise"."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None or getattr(mmap, "MAP_PRIVATE", None) is None:
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def anonymous_bytes(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """nbytes of private anonymous memory as a uint8 tensor (POSIX: mmap.MAP_PRIVATE exists): the OS hands its pages
    out zeroed as they are first written, none resident before. huge_pages: advised MADV_HUGEPAGE, before any page is
    written (the first write's fault then hands out a huge one). Unmapped when the last tensor over it goes."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge_pages:
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors, side by side in one anonymous mapping advised MADV_HUGEPAGE, each contiguous and at a
    64-byte boundary; the mapping lives as long as any copy does. The tensors themselves where the OS grants no huge
    pages (huge_pages_granted) or there are no bytes to copy."""
    sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in tensors]
    if not huge_pages_granted() or sum(sizes) == 0:
        return list(tensors)
    arena = anonymous_bytes(sum(sizes), huge_pages=True)
    copies, offset = [], 0
    for tensor, size in zip(tensors, sizes, strict=True):
        copy = arena[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
        offset += size
    return copies
