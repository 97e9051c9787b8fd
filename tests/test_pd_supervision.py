"""`kvfence serve --mode pd` keeps its workers running (kvfence/runtime/supervisor.py), with real processes:
kill -9 of a worker fails only its in-flight requests (503 worker_unavailable), readiness turns 503, the worker is
restarted and serves again with nobody's help; a crash loop is given up on; `kvfence cluster scale` adds and
drains workers at run time.

A request is held in flight deterministically by stopping (SIGSTOP) the worker it is placed on, and the test
waits until the router's /cluster/status counts it there before killing the worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pd_cluster import pd_serve
from tests.server_harness import SCRAPE_KEY

ADMIN = "admin-key-for-tests"
KEYS = {"key-a": "tenant-a"}
BODY = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def wait_for(condition: Callable[[], Any], what: str, within_s: float = 120.0) -> Any:
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # poll interval
    return value


def status(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/cluster/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def registered(url: str, role: str) -> list[dict[str, Any]]:
    return [w for w in status(url)["workers"] if w["role"] == role]


def complete(url: str, body: dict[str, Any] = BODY) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "llama", **body},
        headers={"Authorization": "Bearer key-a"},
        timeout=120,
    )


def ready(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


FLAGS = ("--page-size", "4", "--kv-pages", "96", "--admin-key", ADMIN)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_kill_9_of_a_worker_fails_its_requests_turns_readiness_503_and_the_worker_comes_back(
    tiny_dir, keys_file, role
):
    with pd_serve(tiny_dir, keys_file, *FLAGS) as url:
        first = complete(url)
        assert first.status_code == 200
        expected = first.json()["choices"][0]["text"]
        (victim,) = registered(url, role)
        assert ready(url) == 200 and httpx.get(f"{url}/health/live").status_code == 200
        os.kill(victim["pid"], signal.SIGSTOP)  # holds the requests placed on it
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(complete, url) for _ in range(4)]
            wait_for(lambda: registered(url, role)[0]["in_flight"] == 4, "4 requests in flight on the worker")
            os.kill(victim["pid"], signal.SIGKILL)
            failed = [a.result() for a in answers]
        assert [a.status_code for a in failed] == [503] * 4
        assert {a.json()["error"]["code"] for a in failed} == {"worker_unavailable"}
        assert all(a.headers.get("retry-after") for a in failed)
        # the replacement takes seconds to start (a new process, a model to load): until then, not ready
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["reason"]
        assert httpx.get(f"{url}/health/live").status_code == 200  # the router itself is fine
        wait_for(lambda: ready(url) == 200, "readiness to come back")
        again = complete(url)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
        (replacement,) = registered(url, role)
        assert replacement["pid"] != victim["pid"] and replacement["name"] == victim["name"]
        slot = next(s for s in status(url)["supervised"] if s["role"] == role)
        assert slot["restarts"] == 1 and slot["last_exit"] == -signal.SIGKILL and slot["state"] == "running"
        scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
        assert f'kvfence_cluster_worker_restarts_total{{name="{role}-0",role="{role}"}} 1.0' in scraped
        assert "kvfence_cluster_ready 1.0" in scraped


def kvfence_cluster(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvfence", "cluster", *args, "--url", url, "--admin-key", ADMIN]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_crash_loop_is_given_up_on_and_cluster_scale_starts_a_fresh_worker(tiny_dir, keys_file):
    with pd_serve(tiny_dir, keys_file, *FLAGS, "--max-restarts", "0") as url:
        (victim,) = registered(url, "decode")
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(
            lambda: any(s["state"] == "given_up" for s in status(url)["supervised"]), "the worker given up on"
        )
        assert ready(url) == 503 and complete(url).status_code == 503
        shown = kvfence_cluster(url, "status")
        assert shown.returncode == 0 and "given_up" in shown.stdout and "NO" in shown.stdout, shown
        scaled = kvfence_cluster(url, "scale", "--prefill-workers", "1", "--decode-workers", "1")
        assert scaled.returncode == 0 and "added: decode-1" in scaled.stdout, scaled
        wait_for(lambda: ready(url) == 200, "the fresh worker to register")
        assert complete(url).status_code == 200


def test_cluster_scale_adds_a_worker_that_takes_traffic_and_drains_it_away(tiny_dir, keys_file):
    """Scale out to two decode workers: the new one takes traffic while the old one is busy. Scale in: the
    newest drains with a request in flight, takes nothing new, finishes that request (200), then leaves."""
    with pd_serve(tiny_dir, keys_file, *FLAGS) as url:
        scaled = kvfence_cluster(url, "scale", "--prefill-workers", "1", "--decode-workers", "2")
        assert scaled.returncode == 0, scaled.stderr
        wait_for(lambda: len(registered(url, "decode")) == 2, "the second decode worker")
        old, new = sorted(registered(url, "decode"), key=lambda w: w["name"])
        assert new["name"] == "decode-1"
        by_name = lambda name: next(w for w in registered(url, "decode") if w["name"] == name)  # noqa: E731
        try:
            with ThreadPoolExecutor(2) as pool:
                os.kill(old["pid"], signal.SIGSTOP)  # both idle: the first request goes to the first in turn
                held_old = pool.submit(complete, url)
                wait_for(lambda: by_name("decode-0")["in_flight"] == 1, "a request on the old worker")
                assert complete(url).status_code == 200  # the old one is loaded: placed on the new one
                os.kill(new["pid"], signal.SIGSTOP)
                held_new = pool.submit(complete, url)  # the new one is the less loaded: it takes this one
                wait_for(lambda: by_name("decode-1")["in_flight"] == 1, "a request on the new worker")
                os.kill(old["pid"], signal.SIGCONT)  # (stopped only briefly: 5 s without heartbeats is death)
                assert held_old.result().status_code == 200
                # scale in: the newest decode worker drains, with its request in flight
                scaled = httpx.post(f"{url}/cluster/scale", json={"prefill_workers": 1, "decode_workers": 1},
                                    headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)  # fmt: skip
                assert scaled.json()["draining"] == ["decode-1"], scaled.text
                wait_for(lambda: by_name("decode-1")["state"] == "draining", "the drain to start")
                assert complete(url).status_code == 200  # placed on decode-0: a draining worker takes nothing
                os.kill(new["pid"], signal.SIGCONT)
                assert held_new.result().status_code == 200  # it finished its request...
                wait_for(lambda: [w["name"] for w in registered(url, "decode")] == ["decode-0"], "the drain")
                assert by_name("decode-0")["placed_total"] == 2  # ...and left; the old one was never drained
        finally:
            os.kill(old["pid"], signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.kill(new["pid"], signal.SIGCONT)
        names = lambda: sorted(s["name"] for s in status(url)["supervised"])  # noqa: E731
        wait_for(lambda: names() == ["decode-0", "prefill-0"], "the drained process to exit")
        supervised = status(url)["supervised"]
        assert all(s["restarts"] == 0 for s in supervised)
        for body in (
            {"prefill_workers": 0, "decode_workers": 1},
            {"prefill_workers": "1", "decode_workers": True},
        ):
            bad = httpx.post(f"{url}/cluster/scale", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
            assert bad.status_code == 400, bad.text  # "1" and true are no worker counts
        tenant = httpx.get(f"{url}/cluster/status", headers={"Authorization": "Bearer key-a"})
        assert tenant.status_code == 403  # a tenant's key opens no operator route


def test_a_worker_refused_by_its_preflight_is_not_restarted_and_serve_exits(tiny_dir):
    """A pool too small for the context is a configuration error: the worker's preflight refuses it (I6), the
    supervisor does not restart it, and `serve --mode pd` exits 1 at once instead of looping."""
    cmd = [sys.executable, "-m", "kvfence", "serve", "--mode", "pd", "--model", str(tiny_dir), "--page-size", "4",
           "--kv-pages", "96", "--decode-kv-pages", "8", "--dtype", "float32", "--port", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "a configuration error, not restarted" in done.stderr
        and "the workers did not register" in done.stderr
    )
    assert (
        done.stderr.count("refused: the KV pool holds") + done.stdout.count("refused: the KV pool holds") == 1
    )


def test_serve_pd_holds_the_http_port_before_anything_takes_a_port(monkeypatch):
    """`serve --mode pd`'s router and workers bind ports the OS picks; were --port still free then, the OS could
    hand it to one of them (it did once in a full test run: "address already in use", the server exited). The
    HTTP port is bound first: when the router is made, binding --port fails."""
    import argparse
    import socket

    from kvfence.config import Config
    from kvfence.runtime import pd as runtime_pd
    from tests.pd_cluster import free_port

    class Made(Exception):
        pass

    port = free_port()
    taken: list[bool] = []

    def router(**kwargs: Any) -> None:
        with socket.socket() as probe:  # with SO_REUSEADDR, which lets a socket share a port only bound
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                taken.append(False)
            except OSError:
                taken.append(True)
        raise Made

    monkeypatch.setattr(runtime_pd, "Router", router)
    monkeypatch.setattr(runtime_pd, "exit_on_sigterm", lambda: None)
    with pytest.raises(Made):
        runtime_pd.cmd_serve_pd(Config.of(port=port, insecure_cluster=True), argparse.Namespace())
    assert taken == [True]


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_a_port_in_use_is_said_at_once(mode, tmp_path):
    """--port held by another process: exit 2 naming it, before any model is read or worker started (the model
    path does not exist, and nothing says so: it was never opened)."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        cmd = [sys.executable, "-m", "kvfence", "serve", "--mode", mode, "--port", str(port)]
        cmd += ["--model", str(tmp_path / "none.gguf")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    said = f"kvfence serve: cannot serve on --host 127.0.0.1 --port {port}: Address already in use"
    assert done.stderr.strip().splitlines()[-1] == said  # the config's dump above it, nothing else
    assert "no such file" not in done.stderr and "started prefill worker" not in done.stderr
