"""P->D KV transfer bandwidth over the real data path, and TTFT of PD vs colocated serving.

    python bench/transfer.py [--windows 1,8,64] [--pages 125,13] [--transfers 8] [--page-bytes 737280]
                             [--ttft-requests 5] [--serve-threads N] [--skip-ttft] [--curve both|on|off]

Part 1. A sender and a receiver process ("spawn") talk ZeroMQ over TCP loopback as the PD workers do (prefill
binds a ROUTER, decode connects a DEALER, `wire.encode/decode`, copying sends) and run the real protocol cores:
`TransferReceiver.reserve` -> Ticket -> `TransferSender.start/on_ack` -> frames built by `sender.frame` (xxh3-128
per page) -> `receiver.on_frame` (checks, xxh3-128 again, tag stamp) -> `on_final` (transfer digest) -> Ready.
Pages go through the real `PagedKV.read_page/write_page` (float32, 16-token pages: a page is 60 strided rows of
[S, Hkv*Dh] as in SmolLM2-135M; --page-bytes must be a multiple of 3840, and a tiny one shows the fixed cost per
frame). Each transfer is timed on the receiver from `reserve` (first ticket) to Ready; GB/s = payload / that time
(1 GB = 1e9 B). Each (window, pages) row runs one untimed warm-up transfer, then --transfers timed ones in turn.
Both processes add up their CPU time (all threads, ZeroMQ's I/O thread included) and the wall time of each step.
Side by side, in this process first: page-by-page numpy copy between preallocated buffers, and xxh3-128 alone.
--curve both (the default) runs the plan twice: plain sockets, then ZeroMQ CURVE as a cluster with keys runs it
(the prefill's data socket a CURVE server behind a ZAP allowlist, the decode a CURVE client; kvfence/pd/keys.py),
and prints the bandwidth ratio.

Part 2. Starts `python -m kvfence serve --port P --kv-pages 1024`, then the same with `--mode pd` (its workers
with ephemeral keys: CURVE) and `--mode pd --insecure-cluster` (plain sockets), one at a time;
waits for /health; per prompt length sends one warm-up and --ttft-requests streaming completions one at a time
(exactly 200 / 2,000 random token ids, max_tokens=4, temperature 0), and times the first chunk carrying text.
`serve --mode pd` gives each worker half of --threads (default: all cores); colocated gets them all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import xxhash

Plan = list[tuple[int, int, bool]]  # per transfer (transfer id = index + 1): window, pages, timed
LAYOUT = "bench/float32/ps16"
LAYERS, PAGE_SIZE, DTYPE_BYTES = 30, 16, 4


class Laps:
    """Wall seconds per named step, added up per (window, pages) row; warm-up transfers go to a scratch row."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.row, self.t = self.rows[(0, 0)], 0.0

    def use(self, window: int, pages: int, timed: bool) -> None:
        self.row = self.rows[(window, pages) if timed else (0, 0)]

    def lap(self, name: str = "") -> None:
        now = time.perf_counter()
        if name:
            self.row[name] += now - self.t
        self.t = now


def make_cache(page_bytes: int, num_pages: int) -> Any:
    import torch

    from kvfence.model.paged_kv import PagedKV

    torch.set_num_threads(1)
    row = 2 * LAYERS * PAGE_SIZE * DTYPE_BYTES
    assert page_bytes % row == 0, f"--page-bytes must be a multiple of {row}"
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=1, head_dim=page_bytes // row)
    return PagedKV(cfg, num_pages, PAGE_SIZE, torch.float32, "cpu")  # type: ignore[arg-type]


def sender_main(port_q: Any, plan: Plan, page_bytes: int, pool_pages: int, keys_dir: str | None) -> None:
    """Prefill side: answers each ticket with frames of n pages of its own pool, as PrefillWorker does."""
    from pathlib import Path

    import zmq

    from kvfence.pd import keys, wire
    from kvfence.pd.messages import FrameAck, Ticket
    from kvfence.pd.sender import ReleaseLocal, SendFinal, SendFrames, TransferSender

    cache = make_cache(page_bytes, pool_pages)
    cache.kv.normal_()
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if keys_dir is not None:  # as PrefillWorker with --cluster-keys: only decode keys get in
        own = keys.WorkerKeys.load(Path(keys_dir), "prefill", None)
        gate = keys.Gate(ctx)
        gate.accept(keys.DATA_DOMAIN, own.decode_allowed)
        keys.serve_curve(sock, own.own, keys.DATA_DOMAIN)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    senders: dict[int, tuple[bytes, Any]] = {}
    laps, done = Laps(), 0
    while done < len(plan):
        peer, *body = sock.recv_multipart()
        message = wire.decode(body)
        if isinstance(message, Ticket):
            cpu0 = time.process_time()
            window, _, _ = plan[message.transfer_id - 1]
            s = TransferSender(message, message.num_pages, LAYOUT, window)
            senders[message.transfer_id] = (peer, s)
            actions = s.start()
        else:
            assert isinstance(message, FrameAck), message
            peer, s = senders[message.transfer_id]
            actions = s.on_ack(message)
        laps.use(*plan[s.ticket.transfer_id - 1])
        for action in actions:
            if isinstance(action, SendFrames):
                for i in action.indices:
                    laps.lap()
                    payload = cache.read_page((s.ticket.transfer_id * s.ticket.num_pages + i) % pool_pages)
                    laps.lap("read_page")
                    frame = s.frame(i, payload)
                    laps.lap("frame+digest")
                    sock.send_multipart([peer, *wire.encode(frame)], copy=True)
                    laps.lap("send")
            elif isinstance(action, SendFinal):
                sock.send_multipart([peer, *wire.encode(action.final)], copy=True)
            else:
                assert isinstance(action, ReleaseLocal), action
                laps.row["cpu"] += time.process_time() - cpu0
                done += 1
    port_q.put({k: dict(v) for k, v in laps.rows.items()})
    sock.close(linger=1000)


def receiver_main(
    port: int, plan: Plan, page_bytes: int, pool_pages: int, out_q: Any, keys_dir: str | None
) -> None:
    """Decode side: one reservation at a time, validate + write each frame back to back, as DecodeWorker does."""
    from pathlib import Path

    import zmq

    from kvfence.ids import RequestId
    from kvfence.kv.pool import PagePool
    from kvfence.pd import keys, wire
    from kvfence.pd.messages import FinalFrame, PageFrame, TransferId
    from kvfence.pd.receiver import Applied, Ready, TransferReceiver

    cache = make_cache(page_bytes, pool_pages)
    pool = PagePool(pool_pages, PAGE_SIZE)
    receiver = TransferReceiver(pool, LAYOUT, page_bytes, cache.write_page)
    sock = zmq.Context().socket(zmq.DEALER)
    if keys_dir is not None:  # as DecodeWorker.connect: the prefill's public key, named by the router
        own = keys.WorkerKeys.load(Path(keys_dir), "decode", None)
        prefill = keys.load_public(Path(keys_dir) / "prefill" / "prefill-0.key")
        keys.connect_curve(sock, own.own, prefill.principal)
    sock.connect(f"tcp://127.0.0.1:{port}")
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    laps = Laps()
    for tid, (window, pages, timed) in enumerate(plan, 1):
        laps.use(window, pages, timed)
        start, cpu0 = time.perf_counter(), time.process_time()
        sock.send_multipart(wire.encode(receiver.reserve(TransferId(tid), RequestId(f"r{tid}"), pages)))
        ready = None
        while ready is None:
            laps.lap()
            message = wire.decode(sock.recv_multipart())
            laps.lap("recv+decode")
            if isinstance(message, PageFrame):
                verdict = receiver.on_frame(message)
                laps.lap("on_frame (checks, write_page, xxh3, stamp)")
                assert isinstance(verdict, Applied), verdict
                sock.send_multipart(wire.encode(verdict.ack))
                laps.lap("ack")
            else:
                assert isinstance(message, FinalFrame), message
                result = receiver.on_final(message)
                assert isinstance(result, Ready), result
                ready = result
        laps.row["cpu"] += time.process_time() - cpu0
        if timed:
            times[(window, pages)].append(time.perf_counter() - start)
        assert not pool.release(ready.leases)
    receiver.check_integrity()
    assert not receiver.stats.dropped and not receiver.stats.failed, receiver.stats
    out_q.put((dict(times), {k: dict(v) for k, v in laps.rows.items()}))


def run_transfers(args: argparse.Namespace, baseline: dict[str, float]) -> None:
    from kvfence.pd import keys

    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.curve]
    gbps: dict[str, dict[tuple[int, int], float]] = {}
    for curve in modes:
        keys_dir = keys.ephemeral() if curve == "on" else None
        try:
            gbps[curve] = transfers(args, baseline, str(keys_dir) if keys_dir else None)
        finally:
            if keys_dir is not None:
                keys.remove(keys_dir)
    if len(gbps) == 2:
        print("\nCURVE on / off, GB/s ratio per row: " + "  ".join(
            f"w={w} n={n}: {gbps['on'][(w, n)] / gbps['off'][(w, n)]:.2f}" for (w, n) in gbps["off"]))  # fmt: skip


def transfers(
    args: argparse.Namespace, baseline: dict[str, float], keys_dir: str | None
) -> dict[tuple[int, int], float]:
    plan: Plan = [
        (w, n, timed) for w in args.windows for n in args.pages for timed in [False] + [True] * args.transfers
    ]
    pool_pages = 2 * max(args.pages)  # FIFO free list: consecutive transfers land on different pages
    ctx = mp.get_context("spawn")
    sender_q, receiver_q = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=sender_main, args=(sender_q, plan, args.page_bytes, pool_pages, keys_dir))
    sender.start()
    port = sender_q.get(timeout=120)
    receiver = ctx.Process(
        target=receiver_main, args=(port, plan, args.page_bytes, pool_pages, receiver_q, keys_dir)
    )
    receiver.start()
    times, rx_phases = receiver_q.get(timeout=1800)
    tx_phases = sender_q.get(timeout=60)
    for p in (sender, receiver):
        p.join(timeout=30)
    curve = "CURVE (encrypted, authenticated)" if keys_dir else "plain (no keys)"
    print(
        f"\nP->D transfer, ZeroMQ TCP loopback, {curve}, {args.transfers} timed transfers per row (median):"
    )
    print(" window  pages      MB  ms/xfer     GB/s  xfers/s  wall us/page  2 digests  CPU us/page: tx    rx")
    result = {}
    for (w, n), ts in times.items():
        t, num, mb = statistics.median(ts), len(ts) * n, n * args.page_bytes / 1e6
        result[(w, n)] = mb / t / 1e3
        share = f"{100 * 2 * baseline['xxh3-128'] * n / t:8.1f}%"
        cpu = f"{1e6 * tx_phases[(w, n)]['cpu'] / num:15.0f} {1e6 * rx_phases[(w, n)]['cpu'] / num:5.0f}"
        print(f" {w:6d} {n:6d} {mb:7.1f} {1e3 * t:8.1f} {mb / t / 1e3:8.3f} {1 / t:8.1f} {1e6 * t / n:13.0f} "
              f"{share} {cpu}")  # fmt: skip
    print("wall us/page per step (includes time preempted; recv+decode includes waiting for the sender):")
    for (w, n), ts in times.items():
        tx, rx = ({k: f"{1e6 * v / len(ts) / n:.0f}" for k, v in ph[(w, n)].items() if k != "cpu"}
                  for ph in (tx_phases, rx_phases))  # fmt: skip
        print(f" w={w:<3d} n={n:<4d} tx: {tx} | rx: {rx}".replace("'", ""))
    return result


def run_baselines(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per page for a plain copy and for xxh3-128 alone, over as many distinct pages as a long transfer."""
    n, size = max(args.pages), args.page_bytes
    src = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    dst.fill(1)  # fault the pages in before timing
    ops: dict[str, Callable[[int], object]] = {
        "memcpy": lambda i: np.copyto(dst[i], src[i]),
        "xxh3-128": lambda i: xxhash.xxh3_128_digest(src[i].data),
    }
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores, load average {load}; page = {size:,} B")
    print(f"baselines, page by page over {n} pages ({n * size / 1e6:.1f} MB) in this process, median of 5:")
    per_page = {}
    for name, op in ops.items():
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                op(i)
            ts.append(time.perf_counter() - t0)
        per_page[name] = statistics.median(ts) / n
        print(f"  {name:10s} {size / per_page[name] / 1e9:7.2f} GB/s  {1e6 * per_page[name]:7.1f} us/page")
    return per_page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_chunk_s(client: Any, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streaming completion to the first chunk with text (else the first chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start, first, any_chunk = time.perf_counter(), None, None
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            assert "choices" in chunk, chunk.get("error", chunk)
            any_chunk = any_chunk or now
            if first is None and any(c["text"] for c in chunk["choices"]):
                first = now
    assert any_chunk is not None, "no chunk in the stream"
    return (first or any_chunk) - start


@contextlib.contextmanager
def serving(args: argparse.Namespace, mode: str) -> Iterator[tuple[Any, str, str]]:
    """Start `kvfence serve` in its own process group, wait for /health; yield (client, model name, log path)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--port", str(port), "--kv-pages", "1024"]
    cmd += {"colocated": [], "pd": ["--mode", "pd"], "pd-insecure": ["--mode", "pd", "--insecure-cluster"]}[
        mode
    ]
    cmd += ["--threads", str(args.serve_threads)] if args.serve_threads else []
    log = tempfile.NamedTemporaryFile("w", prefix=f"kvfence-bench-{mode}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()  # the server holds its own descriptor
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            for _ in range(1200):
                assert proc.poll() is None, f"server exited, see {log.name}"
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        break
                time.sleep(0.5)
            yield client, client.get("/v1/models").json()["data"][0]["id"], log.name
    finally:
        # SIGINT, not SIGTERM: uvicorn re-raises a captured SIGTERM after shutting down, which kills
        # `serve --mode pd` before it stops its workers (they linger until they notice the router is gone).
        # The group kill catches whatever is left.
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_ttft(args: argparse.Namespace) -> None:
    import httpx

    results: dict[str, dict[int, list[float] | str]] = {"colocated": {}, "pd": {}, "pd-insecure": {}}
    for mode, out in results.items():
        rng = np.random.default_rng(1)
        with serving(args, mode) as (client, model, log):
            for length in args.prompt_lens:
                prompts = rng.integers(1000, 49000, (args.ttft_requests + 1, length)).tolist()  # no specials
                try:
                    first_chunk_s(client, model, prompts[0])  # warm-up
                    out[length] = [first_chunk_s(client, model, p) for p in prompts[1:]]
                except (AssertionError, httpx.HTTPError) as exc:
                    out[length] = f"{mode} failed: {exc} (server log {log})"
    threads = args.serve_threads or "server default"
    print(
        f"\nTTFT over HTTP (streaming, max_tokens=4), {args.ttft_requests} requests each, --threads {threads}:"
    )
    print(
        " prompt  colocated p50  pd (keys) p50  pd (insecure) p50  keys/insecure   (ms: colocated ; keys ; insecure)"
    )
    p50 = {
        m: {n: statistics.median(r) for n, r in out.items() if isinstance(r, list)}
        for m, out in results.items()
    }
    for n in args.prompt_lens:
        c, p, q = (p50[m].get(n) for m in ("colocated", "pd", "pd-insecure"))
        cells = [f"{1e3 * x:9.1f} ms" if x is not None else "   failed" for x in (c, p, q)]
        ratio = f"{p / q:14.2f}" if p is not None and q is not None else " " * 14
        raw = " ; ".join(" ".join(f"{1e3 * x:.0f}" for x in r) if isinstance(r, list) else "-"
                         for r in (results[m][n] for m in ("colocated", "pd", "pd-insecure")))  # fmt: skip
        print(f" {n:6d} {cells[0]:>14s} {cells[1]:>14s} {cells[2]:>18s} {ratio}   ({raw})")
    for out in results.values():
        for r in out.values():
            if isinstance(r, str):
                print(f" {r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--windows", type=ints, default=[1, 8, 64], help="page frames in flight, comma-separated")
    ap.add_argument("--pages", type=ints, default=[125, 13], help="pages per transfer (125 ~ 2,000 tokens)")
    ap.add_argument("--transfers", type=int, default=8, help="timed transfers per (window, pages)")
    ap.add_argument("--page-bytes", type=int, default=LAYERS * 2 * PAGE_SIZE * 3 * 64 * DTYPE_BYTES)
    ap.add_argument("--ttft-requests", type=int, default=5, help="timed requests per mode and prompt length")
    ap.add_argument("--prompt-lens", type=ints, default=[200, 2000])
    ap.add_argument("--serve-threads", type=int, default=None, help="--threads for both servers")
    ap.add_argument("--skip-ttft", action="store_true", help="run only the transfer part")
    ap.add_argument(
        "--curve", choices=("both", "on", "off"), default="both", help="transfer part: CURVE on/off"
    )
    args = ap.parse_args()
    run_transfers(args, run_baselines(args))
    if not args.skip_ttft:
        run_ttft(args)


if __name__ == "__main__":
    main()
