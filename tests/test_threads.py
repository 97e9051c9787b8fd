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

from kvfence.engine.llm_engine import on_passing_thread

PROBE = r"""
import os, sys, threading
import torch
from kvfence.engine.llm_engine import on_passing_thread

n = os.cpu_count()
torch.set_num_threads(n)
a, b = torch.randn(1 << 21), torch.randn(1 << 21)

def load():  # stands for model loading: parallel regions with every core
    for _ in range(5):
        torch.add(a, b)

def switches():
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            total += sum(int(l.split()[1]) for l in f if "ctxt_switches" in l)
    return total

if sys.argv[1] == "main":
    load()
else:
    on_passing_thread(load)
per_region = []

def engine():  # the engine thread: many short parallel regions, a little Python between them
    torch.set_num_threads(n)
    for _ in range(20):
        torch.add(a, b)
    before = switches()
    for _ in range(300):
        torch.add(a, b)
    per_region.append((switches() - before) / 300)

t = threading.Thread(target=engine)
t.start()
t.join()
print(per_region[0])
"""


def test_on_passing_thread_returns_and_raises_on_another_thread():
    import threading

    assert on_passing_thread(lambda: threading.current_thread().name) == "kvfence-load"
    with pytest.raises(ZeroDivisionError):
        on_passing_thread(lambda: 1 // 0)


@pytest.mark.skipif(sys.platform != "linux" or (os.cpu_count() or 1) < 2, reason="needs Linux and 2+ CPUs")
def test_loading_on_a_passing_thread_keeps_the_engine_threads_workers_spinning():
    """Loaded on the main thread, the engine thread's OpenMP worker sleeps and is woken at every parallel
    region (one context switch or more per region); loaded on a passing thread, it spins between them."""

    def probe(where: str) -> float:
        env = {**os.environ, "OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""}
        env = {k: v for k, v in env.items() if v}
        out = subprocess.run(
            [sys.executable, "-c", PROBE, where], capture_output=True, text=True, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr
        return float(out.stdout.strip().splitlines()[-1])

    assert probe("passing") < 0.2
    assert probe("main") > 0.5  # the control: what `kvfence serve` did before session 7


def test_serve_loads_and_builds_the_engine_off_the_main_thread(tiny_dir, monkeypatch):
    """`kvfence serve` leaves the main thread without an OpenMP pool: the model loads and the engine is built
    on passing threads (uvicorn is stubbed out; the command returns once it would serve)."""
    import threading

    import uvicorn

    from kvfence.cli import main
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.model import loader

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
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: seen.setdefault("served", "yes"))
    assert main(["serve", "--model", str(tiny_dir), "--port", "1"]) == 0
    assert seen == {"load": "kvfence-load", "engine": "kvfence-load", "served": "yes"}
