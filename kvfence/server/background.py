"""Run an app with uvicorn in a background thread on a free loopback port (tests, benchmarks).

The socket is bound and listening before uvicorn starts, so clients may connect at once: connections wait in
the backlog until the app's startup (which starts the engine thread) is done. No sleeps, no polling.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


@contextmanager
def serve_in_thread(app: FastAPI, timeout: float = 60.0) -> Iterator[str]:
    """Yield the base URL (`http://127.0.0.1:PORT`); on exit, shut the server down and wait for it."""
    # proto must say TCP: asyncio sets TCP_NODELAY only on such sockets, and without it every response waits
    # ~40 ms for the client's delayed ACK (headers and body are two writes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    host, port = sock.getsockname()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
