"""Memory the Linux kernel may back with 2 MiB pages (transparent huge pages), for the C forward's packed weights.

A decode step streams every packed weight once (269 MB for the default model). On 4 KiB pages that is about 66,000
pages a step, each a TLB miss, and the hardware prefetchers stop at every page boundary; on 2 MiB pages it is about
130. Linux backs an anonymous private mapping with huge pages when asked before the pages are first touched, where
``/sys/kernel/mm/transparent_hugepage/enabled`` reads ``[madvise]`` (or without asking where it reads
``[always]``). So :func:`huge_buffer` maps and advises the memory, and the engine packs its weights into it
afterwards. Elsewhere (THP ``never``, another OS) the buffer is an ordinary mapping and nothing else changes;
``MEDUSA_HUGE_PAGES=0`` asks for ordinary PyTorch memory. Measured in docs/reports/prefetch-l1.md.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64's transparent huge page)
ENV_SWITCH = "MEDUSA_HUGE_PAGES"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise`` or ``never``), None where it has none."""
    try:
        found = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def describe() -> str:
    """Where :func:`huge_buffer` puts memory now, in a few words (for ``medusa-bench model``)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"4 KiB pages ({ENV_SWITCH}=0)"
    mode = thp_mode()
    if mode in ("always", "madvise"):
        return "2 MiB pages"
    return f"4 KiB pages (transparent huge pages: {mode or 'none on this system'})"


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor [nbytes] that starts at a 2 MiB boundary of an anonymous private mapping advised
    for huge pages (before any of its pages is touched). The tensor keeps the mapping alive."""
    if nbytes < 0:
        raise ValueError(f"a buffer of {nbytes} bytes")
    if os.environ.get(ENV_SWITCH, "1") == "0" or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch (usually off)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping; touches no page
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def _spans(sizes: list[int], dtype: torch.dtype, align: int) -> list[tuple[int, int]]:
    """(byte offset, bytes) of each of ``sizes`` elements of ``dtype`` laid out one after another, each offset a
    multiple of ``align``; and last, (the total the layout needs, 0)."""
    width = torch.empty(0, dtype=dtype).element_size()
    spans, at = [], 0
    for n in sizes:
        spans.append((at, n * width))
        at += -(-n * width // align) * align
    return spans + [(at, 0)]


def carve(buffer: torch.Tensor, sizes: list[int], dtype: torch.dtype, align: int = 4096) -> list[torch.Tensor]:
    """Consecutive 1-D tensors of ``sizes`` elements of ``dtype`` in ``buffer`` (uint8), each starting ``align``
    bytes after a boundary of the buffer (views: they share its memory)."""
    spans = _spans(sizes, dtype, align)[:-1]
    if spans and spans[-1][0] + spans[-1][1] > buffer.numel():
        raise ValueError(f"{sum(sizes)} elements of {dtype} do not fit in {buffer.numel()} bytes")
    return [buffer[at:at + nbytes].view(dtype) for at, nbytes in spans]


def carved_bytes(sizes: list[int], dtype: torch.dtype, align: int = 4096) -> int:
    """The bytes :func:`carve` needs for ``sizes`` elements of ``dtype``."""
    return _spans(sizes, dtype, align)[-1][0]
