"""What the KV page map costs: GET /debug/kv on a loaded server, and the engine-thread time of one snapshot.

    python bench/dashboard.py [--model PATH] [--kv-pages 4096] [--page-size 4] [--requests 48]
                              [--prompt-len 300] [--new-tokens 40] [--polls 20] [--threads 2]

Starts the colocated app in this process (port 0) with an admin key, fills most of the pool with --requests
prompts of --prompt-len random tokens (real prefill), then, while they decode, polls /debug/kv --polls times at
the page's rate (2/s). Prints per poll: the snapshot's time on the engine thread (what serving pays), the JSON
size, and the HTTP round trip (which also waits for the step in progress, since the snapshot is taken between
steps). The engine-thread share at 2 polls/s is the direct cost against throughput.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import httpx

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.loop import on_passing_thread
from kvfence.engine.request import SamplingParams
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.server.app import build_app
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.background import serve_in_thread
from kvfence.server.serving import ServerSettings

ADMIN = "bench-admin"
POLL_S = 0.5  # the dashboard's rate


def fill(engine: LLMEngine, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(3, vocab) for _ in range(args.prompt_len)], params)


def decoding(snapshot: dict[str, object], n: int) -> bool:
    (w,) = snapshot["workers"]  # type: ignore[misc]
    return len(w["requests"]) == n and all(r["phase"] == "decode" for r in w["requests"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--kv-pages", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--polls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    config = Config.of(
        model=args.model, kv_pages=args.kv_pages, page_size=args.page_size, max_num_seqs=args.requests,
        max_num_batched_tokens=4096, threads=args.threads,
    )  # fmt: skip
    engine = AsyncEngine(on_passing_thread(lambda: LLMEngine(config)))  # stepped on the engine thread
    settings = ServerSettings(Path(args.model).stem, admin_key=ADMIN)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        engine.call_between_steps(lambda: fill(engine.engine, args))
        while not decoding(http.get("/debug/kv", headers=headers).json(), args.requests):
            threading.Event().wait(POLL_S)  # the poll interval
        print(f"prefill of {args.requests} x {args.prompt_len} tokens: {time.perf_counter() - t0:.1f} s")
        rows = []
        for _ in range(args.polls):
            start = time.perf_counter()
            response = http.get("/debug/kv", headers=headers)
            round_trip = (time.perf_counter() - start) * 1000
            (w,) = response.json()["workers"]
            rows.append((w["snapshot_ms"], len(response.content), round_trip, w["counts"]))
            threading.Event().wait(max(0.0, POLL_S - round_trip / 1000))  # the page's poll rate
        live = engine.call_between_steps(engine.engine.live_requests)
        for request in live:
            engine.abort(request.request_id)
    report(rows, args)


def report(rows: list[tuple[float, int, float, dict[str, int]]], args: argparse.Namespace) -> None:
    snap = [r[0] for r in rows]
    trips = [r[2] for r in rows]
    held = statistics.median(r[3]["leased"] + r[3]["sealed"] for r in rows)
    print(f"pool {args.kv_pages} pages x {args.page_size} tokens, {args.requests} requests decoding, "
          f"median {held:.0f} pages held")  # fmt: skip
    print(f"snapshot on the engine thread: median {statistics.median(snap):.2f} ms, max {max(snap):.2f} ms")
    print(f"/debug/kv body: {statistics.median(r[1] for r in rows) / 1024:.0f} KiB")
    print(f"/debug/kv round trip (waits for the step in progress): median {statistics.median(trips):.0f} ms, "
          f"max {max(trips):.0f} ms")  # fmt: skip
    share = statistics.median(snap) / (POLL_S * 1000)
    print(f"engine-thread share at one poll per {POLL_S} s: {share:.3%}")


if __name__ == "__main__":
    main()
