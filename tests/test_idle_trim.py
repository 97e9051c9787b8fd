"""The engine thread hands freed heap pages back to the OS once the server has been idle for a while after work
(kvfence/server/async_engine.py, IDLE_TRIM_S), and never while there is work or before any step ran."""

from __future__ import annotations

import threading

from kvfence.server import async_engine
from tests.server_harness import MODEL, running_server


def test_engine_thread_trims_the_heap_once_idle_after_work(tiny_model, monkeypatch):
    trims: list[int] = []
    trimmed = threading.Event()

    def record() -> None:
        trims.append(1)
        trimmed.set()

    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 0.05)
    monkeypatch.setattr(async_engine, "trim_heap", record)
    with running_server(tiny_model) as server:
        client = server.client()
        assert client.models.list().data  # the server answers, and no step has run: nothing to trim
        assert not trims
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert trimmed.wait(timeout=30)
        assert len(trims) == 1  # once per idle period, not on every wake-up
