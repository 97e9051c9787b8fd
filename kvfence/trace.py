"""Structured page events, for checking a run after the fact (kvfence/sim/trace_check.py).

The page pool, the engine and the transfer receiver call `emit` at the points that matter for isolation:
a page leased, stamped, sealed, shared, released, reclaimed; a step about to read a block table; a transfer
frame applied. Tracing is off unless a sink is installed, and then `emit` is one global check: no cost on the
hot path of a normal run.

    KVFENCE_TRACE=/some/dir kvfence prefill ...   each process appends JSON lines to DIR/<role>-<pid>.jsonl

The simulator installs its own sink and names the node before each event it dispatches (one thread).
Event names follow the Promela model (verify/transfer.pml) where one exists.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

Sink = Callable[[dict[str, Any]], None]

enabled = False  # read before building an event: tracing costs nothing when off
node = ""  # who is emitting (a worker's role-pid, or the simulator's node name)
_sink: Sink | None = None


def install(sink: Sink | None, name: str = "") -> None:
    """Send events to `sink` (None: tracing off). `name` labels this process's events."""
    global enabled, node, _sink
    _sink, enabled = sink, sink is not None
    node = name or node


def emit(event: str, **fields: Any) -> None:
    if _sink is not None:
        _sink({"ev": event, "node": node, **fields})


def install_from_env(role: str) -> Path | None:
    """KVFENCE_TRACE=DIR: append this process's events to DIR/<role>-<pid>.jsonl. Returns the file, if any."""
    directory = os.environ.get("KVFENCE_TRACE")
    if not directory:
        return None
    path = Path(directory) / f"{role}-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    out: TextIO = path.open("a", encoding="utf-8", buffering=1)
    lock = threading.Lock()

    def write(event: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(event, separators=(",", ":")) + "\n")

    install(write, f"{role}-{os.getpid()}")
    return path
