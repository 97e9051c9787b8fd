"""Recovery of `kvfence serve --mode pd` from `kill -9` of a worker (docs/scale-out.md): how many requests fail,
how long readiness (GET /health) stays 503, and the time until requests succeed again, with nobody's help.

    python bench/recovery.py [--role decode|prefill] [--rounds 3] [--model PATH]

Starts its own server (the default model unless --model), keeps `--concurrency` requests in flight, kills the
worker of `--role` with SIGKILL once per round, and prints one line per round and a summary: requests in flight
that failed (503 worker_unavailable), requests refused while not ready (503 engine_unavailable; the clients then
wait as Retry-After says, as a load balancer would), seconds /health answered 503, seconds from the kill to the
next success. Prints numbers; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

ADMIN = "bench-admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--log", default=None, help="write the server's output here")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvfence",
        "serve",
        "--mode",
        "pd",
        "--port",
        str(port),
        "--admin-key",
        ADMIN,
    ]
    cmd += ["--model", args.model] if args.model else []
    log = open(args.log, "w") if args.log else subprocess.DEVNULL  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait(lambda: status_code(url + "/health") == 200, 300)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        stats = {"ok": 0, "failed": 0, "refused": 0}
        stop = threading.Event()
        lock = threading.Lock()

        def client() -> None:
            while not stop.is_set():
                try:
                    body = {
                        "model": model,
                        "prompt": "Tell me about the sea.",
                        "max_tokens": 32,
                        "temperature": 0,
                    }
                    r = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
                    code = r.json()["error"]["code"] if r.status_code != 200 else None
                except httpx.TransportError:
                    code = "transport"
                key = {None: "ok", "worker_unavailable": "failed"}.get(code, "refused")
                with lock:
                    stats[key] += 1
                if key == "refused":  # a well-behaved client waits as Retry-After says (1 s)
                    time.sleep(float(r.headers.get("retry-after", 1)) if code != "transport" else 1.0)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        print(
            f"kill -9 of the {args.role} worker, {args.concurrency} requests in flight, {args.rounds} rounds"
        )
        print("round  in-flight-failed  refused-while-not-ready  not-ready-s  back-to-ok-s")
        rows = []
        for n in range(args.rounds):
            time.sleep(3.0)  # steady load before the kill (a benchmark's warm-up, not synchronization)
            pid = next(w["pid"] for w in cluster(url)["workers"] if w["role"] == args.role)
            with lock:
                failed_before, refused_before = stats["failed"], stats["refused"]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait(lambda: status_code(url + "/health") == 503, 30)
            not_ready = time.monotonic()
            wait(lambda: status_code(url + "/health") == 200, 300)
            ready = time.monotonic()
            with lock:
                ok_at_ready = stats["ok"]
            wait(lambda at=ok_at_ready: stats["ok"] > at, 300)
            back = time.monotonic()
            with lock:
                failed, refused = stats["failed"] - failed_before, stats["refused"] - refused_before
            rows.append((failed, refused, ready - not_ready, back - killed))
            print(f"{n + 1:5}  {failed:16}  {refused:23}  {ready - not_ready:11.2f}  {back - killed:12.2f}")
        stop.set()
        for t in threads:
            t.join(timeout=120)
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(4)]
        print(f"mean   {mean[0]:16.1f}  {mean[1]:23.1f}  {mean[2]:11.2f}  {mean[3]:12.2f}"
              f"   (requests ok overall: {stats['ok']})")  # fmt: skip
        restarts = [s["restarts"] for s in cluster(url)["supervised"] if s["role"] == args.role]
        print(f"restarts of the {args.role} worker: {restarts[0]}")
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
    return 0


def cluster(url: str) -> dict:
    return dict(
        httpx.get(f"{url}/cluster/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    )


def status_code(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def wait(condition, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.02)  # poll interval


if __name__ == "__main__":
    sys.exit(main())
