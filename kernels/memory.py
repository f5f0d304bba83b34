"""Large CPU buffers on transparent huge pages.

A decode step streams every weight it holds once (hundreds of MB on the bench model, tens of GB on a
real one). On 4 KiB pages that is a TLB miss every 4 KiB, each a page walk, and the hardware
prefetchers stop at every page's end; on 2 MiB pages both happen 512 times less often. Linux backs
anonymous memory with 2 MiB pages where the memory asks for them (`madvise(MADV_HUGEPAGE)`) when
`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` (the default of many distributions, and
this project's machines') or `always`; torch's allocator does not ask. On the bench model
(docs/benchmarks.md, "Weights on huge pages"): the lm_head's product at 1-4 rows 1.06x, decode at
batch 1 1.02-1.09x, at batch 8 and 64 1.03x; products bound by arithmetic gain nothing.

Where the kernel has no transparent huge pages (`never`, or a build without them) the advice is
refused or ignored and the memory is ordinary: nothing else changes. `--no-huge-pages` (every
worker and engine) leaves the weights on torch's allocator: on a VM that hands free memory back to
its host, a huge page is often one the host must fault in again, and loading took longer here."""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger("moemesh.kernels")

HUGE_PAGE = 2 << 20
_asked = True  # use_huge_pages


def use_huge_pages(on: bool) -> None:
    """Whether `empty_huge` asks for huge pages from here on, in this process (`--no-huge-pages`)."""
    global _asked
    _asked = on


def empty_huge(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU, in its own anonymous mapping advised to be backed
    by huge pages, starting on a 2 MiB boundary, where it is at least one huge page (a last, partial
    one stays on 4 KiB pages); smaller buffers (and a Python without `MADV_HUGEPAGE`) are plain
    torch.empty, and so is every buffer after `use_huge_pages(False)`. Freed with the last tensor
    that views it. The pages are zero until written; like torch.empty's, they are faulted in (and
    counted against the host's memory) only when first touched."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _asked or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # (no address space for it: torch's allocator gives its own error)
        log.debug("no mapping of %d bytes for huge pages (%s): torch's allocator instead", nbytes, e)
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf: unmapped with the last view
    start = -raw.data_ptr() % HUGE_PAGE
    tail = start + nbytes // HUGE_PAGE * HUGE_PAGE  # the last huge page the buffer only partly fills
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, tail - start)
        if tail < start + nbytes:  # 4 KiB pages there: a whole 2 MiB page would hold up to 2 MiB of nothing
            buf.madvise(mmap.MADV_NOHUGEPAGE, tail, len(buf) - tail)
    except OSError as e:  # EINVAL: a kernel built without transparent huge pages
        log.debug("madvise(MADV_HUGEPAGE) refused (%s): small pages", e)
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t (on the CPU) in `empty_huge` memory."""
    assert t.device.type == "cpu", t.device
    out = empty_huge(t.shape, t.dtype)
    out.copy_(t)
    return out
