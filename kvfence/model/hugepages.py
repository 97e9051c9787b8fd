"""Big, long-lived CPU buffers on transparent huge pages (2 MiB), where Linux offers them.

Every decode step reads the KV pool at scattered places (each row's pages) and streams the GGUF blocks of every
linear layer. On 4 KiB pages each of those reads also walks the page tables, and in a virtual machine (nested
paging) a walk costs hundreds of cycles. Many systems enable transparent huge pages only for memory that asks for
them (`madvise` mode), so these buffers ask: an anonymous private mapping with MADV_HUGEPAGE, touched after the
advice, so that the kernel backs each aligned 2 MiB of it with one page. Measured on this machine
(docs/performance.md): decode attention over 8 rows, 349 against 450 us per layer with the same kernel.

Callers pass `huge=False` where the model's `KernelOptions.hugepages` is off (`KVFENCE_HUGEPAGES=0` feeds it):
plain `torch.empty` then; so does a platform or kernel without MADV_HUGEPAGE. Small buffers are never worth a
mapping of their own. The memory counts in RSS like any other.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # below this a buffer gains little and wastes up to a huge page
ALIGN = 64  # bytes: every tensor placed in an arena starts on a cache line


def empty(shape: Sequence[int], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor; from a huge-page mapping when it is big enough, `huge` and the platform has
    MADV_HUGEPAGE. Its memory is not touched yet, so the first write (which should follow soon) decides the page
    size."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapped = _mapping(nbytes) if huge and hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= MIN_BYTES else None
    if mapped is None:
        return torch.empty(*shape, dtype=dtype)
    return mapped.view(dtype).view(*shape)


def slots(specs: Sequence[tuple[Sequence[int], torch.dtype]], huge: bool = True) -> list[torch.Tensor]:
    """Uninitialized tensors of the given shapes and dtypes, laid out one after another (64-byte aligned) in one
    buffer that `empty` allocates, so that many mid-sized weights share huge pages. Filling them one at a time
    keeps a single source alive at once."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    arena = empty((total,), torch.uint8, huge)
    return [
        arena[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(*shape)
        for (shape, dtype), offset in zip(specs, offsets, strict=True)
    ]


def pack(tensors: Sequence[torch.Tensor], huge: bool = True) -> list[torch.Tensor]:
    """Copies of contiguous CPU `tensors` in one buffer (`slots`). Returns them in order."""
    placed = slots([(t.shape, t.dtype) for t in tensors], huge)
    for slot, t in zip(placed, tensors, strict=True):
        slot.copy_(t)
    return placed


def _mapping(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of a private anonymous mapping advised for huge pages, as a uint8 tensor that keeps it alive;
    None where the running kernel refuses the advice (built without transparent huge pages, or a sandbox).
    The mapping's start is only 4 KiB-aligned: the tensor begins at the first 2 MiB boundary inside it."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        buf.close()
        return None
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]
