"""Latency of over-length rejections (I5) against a running server, and the pages they allocated (must be 0).

    python bench/rejection.py [--model PATH] [--requests 300] [--kv-pages 256] [--page-size 16]

Starts the real app in-process on a free loopback port with the default model (or --model), then sends
--requests over-length requests of three kinds, one after another on one keep-alive connection:
  - completions with a token-id prompt one token longer than the context (no tokenization cost);
  - completions with a text prompt of about 2x the context (tokenized on the server);
  - chat with the same text (chat template, then tokenized).
Prints p50/p99/max latency per kind, for comparison the latency of a valid 1-token completion, and the pages
the pool handed out during the rejections (counted by wrapping `PagePool.allocate`), which must be 0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.loop import on_passing_thread
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.server.app import build_app
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.background import serve_in_thread
from kvfence.server.serving import ServerSettings

MODEL = "bench"


def count_allocations(engine: LLMEngine) -> list[int]:
    """Wrap the pool's allocator; the returned one-item list holds the number of pages handed out."""
    pool, counter = engine.pool, [0]
    real: Callable[[int], Any] = pool.allocate

    def allocate(num_pages: int) -> Any:
        counter[0] += num_pages
        return real(num_pages)

    pool.allocate = allocate  # type: ignore[method-assign]
    return counter


def timed(http: httpx.Client, path: str, body: dict[str, Any], n: int, status: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = http.post(path, json=body)
        times.append(time.perf_counter() - t0)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"
    return times


def report(name: str, times: list[float]) -> None:
    ms = sorted(t * 1000 for t in times)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(f"  {name:<34} p50 {statistics.median(ms):7.2f} ms   p99 {p99:7.2f} ms   max {ms[-1]:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--kv-pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    config = Config.of(
        model=args.model, kv_pages=args.kv_pages, page_size=args.page_size, threads=args.threads
    )
    engine = on_passing_thread(lambda: LLMEngine(config))  # stepped on the engine thread (docs/server.md)
    ctx = engine.limits.context_length
    allocated = count_allocations(engine)
    text = "hello world " * ctx  # about 2 tokens per repetition: twice the context
    cases = [
        ("completions, token ids (ctx + 1)", "/v1/completions", {"model": MODEL, "prompt": [5] * (ctx + 1)}),
        (f"completions, text ({len(text)} chars)", "/v1/completions", {"model": MODEL, "prompt": text}),
        (
            "chat, text",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": text}]},
        ),
    ]
    app = build_app(AsyncEngine(engine), ServerSettings(MODEL))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        valid = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
        timed(http, "/v1/completions", valid, 3, 200)  # warm-up: first forward pass, connection
        before = allocated[0]
        print(f"model {args.model}, context {ctx} tokens, pool {args.kv_pages} x {args.page_size}")
        print(f"over-length rejections, {args.requests} each, sequential on one connection:")
        for name, path, body in cases:
            timed(http, path, body, 5, 400)  # warm-up
            report(name, timed(http, path, body, args.requests, 400))
        pages = allocated[0] - before
        report("valid 1-token completion (baseline)", timed(http, "/v1/completions", valid, 50, 200))
        print(f"pages allocated during {len(cases) * (args.requests + 5)} rejections: {pages}")
        assert pages == 0, "a rejected request allocated KV pages (I5 violated)"


if __name__ == "__main__":
    main()
