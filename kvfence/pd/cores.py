"""Cores shared by the PD workers of one host: a worker steps on all of them while the others have nothing to step.

`kvfence serve --mode pd` on 2 cores gives each worker one thread. Then the decode worker, with a batch to step,
waits on one core while the prefill worker sits idle on the other between prompts (and the other way round: a
single request's prefill ran on half the machine). Here each worker publishes one byte, "I have a step to run",
in a small shared file, and before each step reads the others': alone, it steps on `max_threads`; with company,
on its own `threads`. A worker that turns busy while another runs a wide step overlaps with it for at most that
one step. Nothing here touches pages or requests: the file only sets thread counts, so a stale or torn read costs
speed, never isolation.

Slots: one byte per worker, claimed by role and number (prefill-i 2i, decode-i 2i + 1). The file is made by
`serve --mode pd`, or by the first of the workers started by hand with the same `--share-cores PATH`. A worker
that dies without closing (kill -9) leaves its byte set: the others keep to their own share until its
replacement (the same slot) clears it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SLOTS = 8
ROLE_SLOTS = {"prefill": 0, "decode": 1}


def create(path: Path) -> Path:
    """A fresh all-idle share file."""
    path.write_bytes(bytes(SLOTS))
    return path


class CoreShare:
    def __init__(self, path: Path, role: str, threads: int, max_threads: int, index: int = 0) -> None:
        """`index`: the worker's number within its role (prefill-1 is 1), so several workers of a role on one
        host publish apart; past SLOTS / 2 of a role they share a byte (costing speed, never isolation)."""
        if not 1 <= threads <= max_threads:
            raise ValueError(f"threads {threads} must be in 1..max_threads ({max_threads})")
        self.slot = (ROLE_SLOTS[role] + 2 * index) % SLOTS
        self.threads = threads
        self.max_threads = max_threads
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # by hand, the first worker makes it
        try:
            if os.fstat(fd).st_size < SLOTS:
                os.ftruncate(fd, SLOTS)  # zero bytes: every slot idle
            self._map = mmap.mmap(fd, SLOTS)
        finally:
            os.close(fd)
        self._busy = False
        self._map[self.slot] = 0

    def step_threads(self, busy: bool) -> int:
        """Publish whether this worker has a step to run; the threads that step should use."""
        self.publish(busy)
        others = any(b for i, b in enumerate(self._map[:SLOTS]) if i != self.slot)
        return self.threads if others else self.max_threads

    def publish(self, busy: bool) -> None:
        """Called again right after each step: a worker that just ran out of work must not look busy while it
        waits on its sockets, or the other worker's next step (a new prompt) would run on half the cores."""
        if busy != self._busy:
            self._map[self.slot] = int(busy)
            self._busy = busy

    def close(self) -> None:
        if not self._map.closed:
            self._map[self.slot] = 0
            self._map.close()
