"""The engine thread hands freed heap pages back to the OS once the server has been idle for a while after work
(kvfence/server/async_engine.py, IDLE_TRIM_S), and never while there is work or before any step ran."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvfence.engine import loop
from tests.server_harness import MODEL, running_server


def test_engine_thread_trims_the_heap_once_idle_after_work(tiny_model, monkeypatch):
    trims: list[int] = []
    trimmed = threading.Event()

    def record() -> None:
        trims.append(1)
        trimmed.set()

    monkeypatch.setattr(loop, "IDLE_TRIM_S", 0.05)
    monkeypatch.setattr(loop, "trim_heap", record)
    with running_server(tiny_model) as server:
        client = server.client()
        assert client.models.list().data  # the server answers, and no step has run: nothing to trim
        assert not trims
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert trimmed.wait(timeout=30)
        assert len(trims) == 1  # once per idle period, not on every wake-up


ARENA_TOP = """
import ctypes, sys, threading
from kvfence.engine.memory import trim_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

def work(out):
    big = libc.malloc(16 << 20)  # mmapped and freed: glibc raises its mmap and trim thresholds (16 and 32 MiB)
    ctypes.memset(big, 1, 16 << 20)
    libc.free(big)
    blocks = [libc.malloc(1 << 20) for _ in range(24)]  # now from this thread's arena, like a step's activations
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)  # back into the arena's top, 24 MiB: under the trim threshold, so it stays resident
    before = rss_mib()
    trim_heap()
    out.append(before - rss_mib())

freed = []
t = threading.Thread(target=work, args=(freed,))
t.start()
t.join()
print(freed[0])
"""


def _glibc_untuned() -> bool:
    try:
        glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        glibc = False
    return (
        glibc and "GLIBC_TUNABLES" not in os.environ and not any(k.startswith("MALLOC_") for k in os.environ)
    )


@pytest.mark.skipif(
    not _glibc_untuned(),
    reason="measures glibc's thread arenas: needs glibc without MALLOC_* or GLIBC_TUNABLES",
)
def test_trim_heap_releases_the_top_of_a_thread_arena():
    """malloc_trim alone leaves the top chunk of a non-main thread's arena resident (the engine thread's: about
    35 MiB after W1); trim_heap lowers the trim threshold for one free on the calling thread, which releases it."""
    out = subprocess.run([sys.executable, "-c", ARENA_TOP], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 16, (
        f"trim_heap released only {float(out.stdout):.1f} MiB of a 24 MiB arena top"
    )


def test_pd_worker_trims_once_per_idle_period_after_work():
    from kvfence.engine.loop import IdleTrim

    idle = IdleTrim(idle_s=2.0)
    assert not idle.due(False, 10.0)  # no work yet: nothing to trim
    assert not idle.due(True, 11.0)
    assert not idle.due(False, 12.9)
    assert idle.due(False, 13.0)  # 2 s after the last work
    assert not idle.due(False, 20.0)  # once per idle period
    assert not idle.due(True, 21.0) and not idle.due(True, 30.0)  # never while there is work
    assert idle.due(False, 32.5)
