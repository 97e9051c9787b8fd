"""Process plumbing: environment defaults every kvfence process applies before anything loads, and children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, MutableMapping, Sequence

# oneDNN keeps every primitive it creates, up to 1,024 by default: one set per linear layer shape for each
# distinct prefill token count, about 45 MB after two W1 runs. 64 cost no measurable throughput on W1
# (docs/performance.md, session 6). Read by oneDNN when it first needs its cache; a value already in the
# environment wins. PD workers inherit it from `serve --mode pd`.
ONEDNN_CACHE_ENTRIES = "64"
# torch's own cache in front of oneDNN's (ideep's, per thread, 1,024 entries by default) keeps, per distinct
# input shape of every linear layer, about 0.7 MB: RSS grew by some 10 MB per W1 with new prompt lengths, with
# room for hundreds of MB more (docs/performance.md, session 8). A miss finds the primitive in oneDNN's cache.
TORCH_LINEAR_CACHE_ENTRIES = "32"


def process_defaults(environ: MutableMapping[str, str]) -> None:
    """Environment defaults for every kvfence process, applied before anything loads."""
    environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    environ.setdefault("LRU_CACHE_CAPACITY", TORCH_LINEAR_CACHE_ENTRIES)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 2


def reap(procs: Sequence[subprocess.Popen[bytes]], terminate: bool = False, grace_s: float = 30.0) -> None:
    """Wait for processes to exit (after SIGTERM when `terminate`); kill the ones that outlive `grace_s`."""
    for p in procs:
        if terminate:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def parent_death_signal() -> Callable[[], None] | None:
    """Linux: a `preexec_fn` that makes the child get SIGTERM when this process dies, even by kill -9 (elsewhere
    the workers' own silence timeouts end them). libc is loaded here, before the fork: the child only calls it."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_on_sigterm() -> None:
    """uvicorn re-raises the SIGTERM it caught once it has shut down; turn it into SystemExit so our `finally`
    blocks still stop the workers (a router killed with -9 is covered by the workers' own silence timeout)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
