"""OpenMP worker pools and the engine thread (kvfence/engine/llm_engine.py: `on_passing_thread`).

A thread that runs a parallel region keeps its OpenMP workers while it lives; libgomp stops letting workers spin
once it manages more threads than there are CPUs. `kvfence serve` loads the model on a passing thread so that the
engine thread's pool is the only one, and its workers wait for the next region spinning, not asleep.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfence.engine.loop import on_passing_thread

PROBE = r"""
import os, sys, threading
import torch
from kvfence.engine.loop import on_passing_thread

n = len(os.sched_getaffinity(0))  # what libgomp counts as available CPUs
torch.set_num_threads(n)
tensors = []

def load():  # stands for model loading: parallel regions with every core
    tensors.extend([torch.randn(1 << 21), torch.randn(1 << 21)])
    for _ in range(5):
        torch.add(*tensors)

def sleeps():  # voluntary switches: a worker going to sleep (preemption by other processes does not count)
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:
            pass
    return total

if sys.argv[1] == "main":
    load()
else:
    on_passing_thread(load)
per_region = []

def engine():  # the engine thread: many short parallel regions, a little Python between them
    torch.set_num_threads(n)
    for _ in range(20):
        torch.add(*tensors)
    before = sleeps()
    for _ in range(300):
        torch.add(*tensors)
    per_region.append((sleeps() - before) / 300)

t = threading.Thread(target=engine)
t.start()
t.join()
print(per_region[0], "libgomp" in open("/proc/self/maps").read())
"""


def test_on_passing_thread_returns_and_raises_on_another_thread():
    import threading

    assert on_passing_thread(lambda: threading.current_thread().name) == "kvfence-load"
    with pytest.raises(ZeroDivisionError):
        on_passing_thread(lambda: 1 // 0)
    with pytest.raises(SystemExit):
        on_passing_thread(lambda: sys.exit(3))


def _cpu_quota() -> float | None:
    """CPUs this cgroup may use (cgroup v2 `cpu.max`), None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _probe(where: str) -> tuple[float, bool]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, where], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    per_region, gomp = out.stdout.strip().splitlines()[-1].split()
    return float(per_region), gomp == "True"


@pytest.mark.skipif(
    sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2+ CPUs"
)
def test_loading_on_a_passing_thread_keeps_the_engine_threads_workers_spinning():
    """Loaded on the main thread, the engine thread's OpenMP worker sleeps and is woken at every parallel
    region (one sleep or more per region); loaded on a passing thread, it spins between them."""
    quota = _cpu_quota()
    if quota is not None and quota < len(os.sched_getaffinity(0)):
        pytest.skip(f"a CPU quota of {quota:.1f} below the {len(os.sched_getaffinity(0))} CPUs libgomp sees")
    passing, gomp = _probe("passing")
    if not gomp:
        pytest.skip("this torch does not use GNU OpenMP (libgomp)")
    assert passing < 0.2
    assert _probe("main")[0] > 0.5  # the control: what `kvfence serve` did before session 7


def test_serve_loads_and_builds_the_engine_off_the_main_thread(tiny_dir, monkeypatch):
    """`kvfence serve` leaves the main thread without an OpenMP pool: the model loads and the engine is built
    on passing threads (uvicorn is stubbed out; the command returns once it would serve)."""
    import threading

    from kvfence.cli import main
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.model import loader
    from kvfence.runtime import http

    seen: dict[str, str] = {}
    real_load, real_init = loader.load_model, LLMEngine.__init__

    def load_model(*args, **kwargs):
        seen["load"] = threading.current_thread().name
        return real_load(*args, **kwargs)

    def init(self, *args, **kwargs):
        seen["engine"] = threading.current_thread().name
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(loader, "load_model", load_model)
    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(http.Front, "run", lambda *args, **kwargs: seen.setdefault("served", "yes"))
    assert main(["serve", "--model", str(tiny_dir), "--kv-pages", "64", "--port", "0"]) == 0
    assert seen == {"load": "kvfence-load", "engine": "kvfence-load", "served": "yes"}
