"""Process memory: hand the heap pages that loading and bursts of steps free back to the OS (glibc keeps them).

Used once after loading (`return_freed_memory`) and by the engine loop when it has been idle for a while
(kvfence/engine/loop.py). Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import sys


def return_freed_memory() -> None:
    """Give the heap pages that loading freed (dequantized tensors, unfused and unpacked copies: about 550 MB for
    SmolLM2 in bfloat16) back to the OS; glibc keeps them otherwise. Call once the `LoadedModel` is dropped."""
    import gc

    gc.collect()
    trim_heap()


# glibc's mallopt parameters (malloc.h) and the values trim_heap leaves set
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # what glibc's own threshold grows to (its maximum) once steps free big activations
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # and the trim threshold with it: steps never pay for trimming
IDLE_TRIM_THRESHOLD = 1 << 20


def trim_heap() -> None:
    """Return free heap pages to the OS (a step's activations leave about 100 MB of them behind after a burst,
    docs/performance.md). No-op outside glibc.

    `malloc_trim` releases the free pages inside every arena, but not the top chunk of the arenas of threads other
    than the main one: about 35 MiB stayed resident after W1 (docs/performance.md, session 10). glibc trims a
    thread arena's top only when a free of 64 KiB or more lands in that arena and the top exceeds the trim
    threshold. So the threshold is lowered for one such free on the calling thread (the engine thread, when it
    trims at idle), and set back to the value glibc's dynamic threshold reaches under load, where it stays fixed
    (setting it turns the dynamic adjustment off, so the mmap threshold is fixed at its maximum, too)."""
    if sys.platform != "linux":
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        # thresholds the operator set (MALLOC_*_ variables, glibc tunables) are left alone; and where glibc
        # refuses ours (a heap size capped by huge-page tunables), only malloc_trim runs
        if not _malloc_tuned_by_operator() and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
            if libc.mallopt(M_TRIM_THRESHOLD, IDLE_TRIM_THRESHOLD) == 1:
                block = libc.malloc(256 << 10)  # from this thread's arena; its free trims that arena's top
                libc.free(block)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.malloc_trim(0)


def _malloc_tuned_by_operator() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in os.environ
    )
