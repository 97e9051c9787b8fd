"""What every engine loop shares, the colocated server's engine thread (kvfence/server/async_engine.py) and a PD
worker's loop (kvfence/pd/worker.py): the thread hand-off that keeps one OpenMP pool, and idle trimming.

Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kvfence.engine.memory import trim_heap

T = TypeVar("T")
IDLE_TRIM_S = 2.0  # a server (colocated or PD worker) trims once it has had no work for this long


class IdleTrim:
    """When to hand freed heap pages back: once per idle period, `idle_s` after the last step that had work,
    never before any work (nothing to trim) and never while there is work. The loop reports each round
    (`due`), or asks how long it may sleep before a trim is due (`wait_s`)."""

    def __init__(self, idle_s: float | None = None) -> None:
        self.idle_s = IDLE_TRIM_S if idle_s is None else idle_s
        self.last_work: float | None = None  # None: trimmed since the last work, or no work yet

    def worked(self, now: float) -> None:
        self.last_work = now

    def wait_s(self, now: float) -> float | None:
        """Seconds until a trim is due (0: now), or None when none is pending."""
        if self.last_work is None:
            return None
        return max(0.0, self.idle_s - (now - self.last_work))

    def due(self, worked: bool, now: float) -> bool:
        """After a round that did (`worked`) or did not do work: True once per idle period, when it is time."""
        if worked:
            self.worked(now)
            return False
        if self.wait_s(now) == 0.0:
            self.last_work = None
            return True
        return False

    def trim_if_due(self, worked: bool, now: float) -> bool:
        if self.due(worked, now):
            trim_heap()
            return True
        return False


def on_passing_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a thread that ends when it returns, and return its result (or raise its exception).

    For torch work done before an engine is stepped on another thread (model loading, engine construction):
    a thread that runs an OpenMP parallel region keeps a pool of OpenMP workers for as long as it lives, and
    libgomp stops letting workers spin between regions once it manages more threads than there are CPUs. With
    the main thread's pool alive, every parallel region of the engine thread then puts its worker to sleep and
    wakes it again: on 2 cores, 230 context switches and twice the time per decode step with 2 threads
    (docs/performance.md, session 7). A pool dies with its thread, so loading here leaves the engine thread's
    pool the only one."""
    box: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="kvfence-load", daemon=True)  # Ctrl-C does not wait for it
    thread.start()
    thread.join()
    if failure:
        raise failure.pop()  # not failure[0]: the traceback would keep this frame, and `fn`'s, alive in a cycle
    return box.pop()
