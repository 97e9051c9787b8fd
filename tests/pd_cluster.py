"""A PD cluster for tests: a router in this process, prefill and decode workers as real subprocesses talking
ZeroMQ over TCP on loopback. Not a test module."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from kvfence.engine.request import SamplingParams
from kvfence.pd import cores, keys
from kvfence.pd.router import Router
from kvfence.runtime.process import reap
from tests.conftest import make_engine, run_all
from tests.server_harness import SCRAPE_KEY


@contextlib.contextmanager
def start_cluster(
    tiny_dir,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    prefill_faults: str = "",
    checks: bool = True,
    dead_after_s: float = 3.0,
    prefill_pages: int = 64,
    decode_pages: int = 96,
    transfer_timeout_s: float = 20.0,
    window: int = 2,
    netns_prefill: Sequence[str] = (),
    bind: str = "tcp://127.0.0.1:0",
    prefill_data: str | None = None,
    env: dict[str, str] | None = None,
    share_cores: Path | None = None,
    secure: bool = True,
) -> Iterator[Router]:
    """`netns_prefill`: a command prefix (ip netns exec NS) to run the prefill workers on another host.
    `share_cores`: a file for kvfence/pd/cores.py; the workers then step on 2 threads while alone.
    `secure`: cluster keys (CURVE, I10) in a temporary directory, one key per worker; False: --insecure-cluster.
    The router's `keys_dir` attribute names the directory (None without keys)."""
    keys_dir = keys.ephemeral(num_prefill, num_decode) if secure else None
    cluster_keys = keys.RouterKeys.load(keys_dir) if keys_dir else None
    router = Router(bind=bind, dead_after_s=dead_after_s, cluster_keys=cluster_keys)
    router.keys_dir = keys_dir  # type: ignore[attr-defined]
    # float32, as the colocated references the tests compare with (the CLI's default, auto, is bfloat16 here)
    common = ["--model", str(tiny_dir), "--router", router.addr, "--threads", "1", "--page-size", "4",
              "--dtype", "float32", "--transfer-timeout", str(transfer_timeout_s)]  # fmt: skip
    common += ["--cluster-keys", str(keys_dir)] if keys_dir else ["--insecure-cluster"]
    common += [] if checks else ["--no-integrity-checks"]
    if share_cores is not None:
        common += ["--share-cores", str(cores.create(share_cores)), "--max-threads", "2"]
    env = {**os.environ, **(env or {}), "KVFENCE_FAULTS": prefill_faults, "KVFENCE_FAULT_ARMING": "1"}
    worker = [sys.executable, "-m", "kvfence"]
    prefill = [*netns_prefill, *worker, "prefill", *common, "--kv-pages", str(prefill_pages),
               "--transfer-window", str(window)]  # fmt: skip
    prefill += ["--data", prefill_data] if prefill_data else []
    named = lambda role, i: ["--cluster-key", f"{role}-{i}"] if keys_dir else []  # noqa: E731
    procs = [subprocess.Popen([*prefill, *named("prefill", i)], env=env) for i in range(num_prefill)]
    decode = [*worker, "decode", *common, "--kv-pages", str(decode_pages)]
    decode_env = {**env, "KVFENCE_FAULTS": ""}
    procs += [subprocess.Popen([*decode, *named("decode", i)], env=decode_env) for i in range(num_decode)]
    try:
        alive = lambda: all(p.poll() is None for p in procs)  # noqa: E731
        if not router.wait_for_workers(num_prefill, num_decode, 120, alive=alive):
            pytest.fail("workers did not register (or one exited)")
        yield router
    finally:
        router.shutdown()
        reap(procs)
        if keys_dir is not None:
            keys.remove(keys_dir)


def jobs_for(model, n: int, seed: int, prefix: str = "r") -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return {f"{prefix}{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(5, 30))] for i in range(n)}


def colocated_reference(model, jobs, params) -> dict:
    engine = make_engine(model)
    for rid, ids in jobs.items():
        engine.add_request(ids, params, request_id=rid)
    return {k: v.token_ids for k, v in run_all(engine).items()}


def collect(
    router: Router, jobs: dict[str, list[int]], params: SamplingParams, tenant: str = "tenant-a"
) -> dict:
    """Submit every job at once; return each request's final output."""
    outputs: queue.Queue = queue.Queue()
    for rid, ids in jobs.items():
        router.submit(ids, params, rid, tenant, outputs.put)
    final = {}
    while len(final) < len(jobs):
        out = outputs.get(timeout=120)
        if out.finished:
            final[out.request_id] = out
    return final


def audit_clean(router: Router, within_s: float = 30.0) -> None:
    """Every worker's pool, engine and transfer invariants hold, and every page is free again (aborts may still
    be on their way when the client has its answer, so this polls until it holds or `within_s` passes)."""
    deadline = time.monotonic() + within_s
    while True:
        reports, late = router.audit(timeout=30)
        assert not late and reports, late
        for r in reports:
            assert r["ok"], f"{r['role']} worker {r['pid']}: {r['error']}"
        leaking = [r for r in reports if r["num_free"] != r["num_pages"]]
        if not leaking:
            return
        assert time.monotonic() < deadline, f"pages not free after {within_s} s: {leaking}"
        time.sleep(0.1)  # poll interval


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def undersized_prefill(decode_pages: int) -> list[str]:
    """`serve --mode pd` flags: a prefill pool of 32 pages of 4 tokens, half the tiny model's context (the 2026
    incident's configuration, allowed with --allow-undersized-pool), and `decode_pages` for decode."""
    return ["--page-size", "4", "--prefill-kv-pages", "32", "--decode-kv-pages", str(decode_pages),
            "--allow-undersized-pool"]  # fmt: skip


@contextlib.contextmanager
def pd_serve(
    model_dir: Path, keys_file: Path, *flags: str, env: dict[str, str] | None = None, mode: str = "pd"
) -> Iterator[str]:
    """`kvfence serve --mode pd` (router + prefill + decode processes, 2 threads), or `mode` colocated (one
    process); yields the base URL once /health answers, fails at once if the server exits."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--mode", mode, "--model", str(model_dir), "--port",
           str(port), "--api-keys", str(keys_file), "--threads", "2", "--dtype", "float32", "--metrics-key",
           SCRAPE_KEY, *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "KVFENCE_FAULTS": "", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # poll /health until the router answers
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"kvfence serve --mode {mode} did not come up"
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)  # the poll interval, cut short only if the server exits
                pytest.fail(f"kvfence serve --mode {mode} exited")
        yield url
    finally:
        reap([proc], terminate=True)
