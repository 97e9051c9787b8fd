"""`kvfence serve --mode pd` (router + one prefill and one decode worker on this machine), `kvfence router` (the
HTTP front alone; workers join from anywhere) and `kvfence prefill|decode` (one worker process).

`serve --mode pd` hands each worker its configuration tree as JSON on standard input (`--config -`), never as a
rebuilt command line: every field reaches the workers, including ones added later. Each worker carries its
tree in its registration, so the router's `GET /debug/config` shows what every worker runs with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfence.config import Config
from kvfence.pd import cores, keys
from kvfence.pd.router import Router
from kvfence.runtime.http import FrontDoorClosed, open_front_door, tenant_shares
from kvfence.runtime.process import exit_on_sigterm, parent_death_signal, reap, usable_cpus
from kvfence.runtime.supervisor import RestartPolicy, Supervisor

if TYPE_CHECKING:
    from kvfence.server.serving import ClusterControl

log = logging.getLogger("kvfence.pd")
PD_ANSWER_TIMEOUT_S = 2.0  # a worker busy in a long step answers late; the page map shows who did not answer


class NoClusterKeys(Exception):
    """Exit 2: a router or worker without keys and without --insecure-cluster, or a bad keys directory."""


def no_keys_message(command: str) -> str:
    return (
        f"kvfence {command}: no cluster keys. A PD cluster authenticates its members and encrypts prompts and "
        "KV pages with ZeroMQ CURVE: run `kvfence keys init DIR` once, give every host its keys "
        "(docs/security.md), and start the router and every worker with --cluster-keys DIR. "
        "--insecure-cluster runs without them (anyone who reaches the ports can join)."
    )


def router_keys(config: Config) -> keys.RouterKeys | None:
    """The router's keys, None with --insecure-cluster (warned about at every start); raises NoClusterKeys."""
    if config.pd.insecure_cluster:
        keys.warn_insecure("router")
        return None
    if config.pd.cluster_keys is None:
        raise NoClusterKeys(no_keys_message("router"))
    try:
        return keys.RouterKeys.load(Path(config.pd.cluster_keys))
    except keys.KeyFileError as exc:
        raise NoClusterKeys(f"kvfence router: {exc}") from exc


def worker_keys(config: Config, role: str) -> keys.WorkerKeys | None:
    if config.pd.insecure_cluster:
        keys.warn_insecure(f"{role} worker")
        return None
    if config.pd.cluster_keys is None:
        raise NoClusterKeys(no_keys_message(role))
    try:
        return keys.WorkerKeys.load(Path(config.pd.cluster_keys), role, config.pd.cluster_key)
    except keys.KeyFileError as exc:
        raise NoClusterKeys(f"kvfence {role}: {exc}") from exc


def cmd_router(config: Config, args: argparse.Namespace) -> int:
    exit_on_sigterm()
    try:
        listeners = open_front_door(config, "router")
    except FrontDoorClosed as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        cluster_keys = router_keys(config)
    except NoClusterKeys as exc:
        print(exc, file=sys.stderr)
        return 2
    router = Router(
        bind=config.pd.bind,
        cluster_keys=cluster_keys,
        placement=config.pd.placement or "load",
        tenants=tenant_shares(config),
    )
    if cluster_keys is not None:  # revocation: `kill -HUP` re-reads the keys directory at once
        signal.signal(signal.SIGHUP, lambda *_: router.reload_keys())
    print(f"kvfence router: workers connect to {router.addr}", flush=True)
    try:
        if not router.wait_for_workers(
            config.pd.num_prefill, config.pd.num_decode, config.pd.registration_timeout
        ):
            print("kvfence router: workers did not register in time", file=sys.stderr)
            return 1
        return serve_router(router, config, listeners)
    finally:
        router.shutdown()


def cmd_serve_pd(config: Config, args: argparse.Namespace) -> int:
    """The router and its workers on this machine, supervised: a worker that dies is restarted (with --ray, on a
    Ray cluster instead: kvfence/runtime/ray_cluster.py). Keys are made here, in a private temporary directory, one pair
    per worker, and removed at exit: no configuration, and still only these processes can join."""
    exit_on_sigterm()
    try:  # the HTTP port first: the router and workers bind ports the OS picks, never this one
        listeners = open_front_door(config, "serve")
    except FrontDoorClosed as exc:
        print(exc, file=sys.stderr)
        return 2
    if config.pd.insecure_cluster:
        keys.warn_insecure("serve --mode pd")
        directory = None
    else:
        directory = keys.ephemeral(prefill=0, decode=0)
    try:
        router_keys = keys.RouterKeys.load(directory) if directory else None
        router = Router(
            bind="tcp://127.0.0.1:0",  # for the workers on this machine
            cluster_keys=router_keys,
            placement=config.pd.placement or "load",
            tenants=tenant_shares(config),
        )
        with LocalWorkers(router, config, directory) as local:
            pd = config.pd
            if not router.wait_for_workers(
                pd.prefill_workers, pd.decode_workers, pd.registration_timeout, alive=local.none_given_up
            ):
                print(
                    "kvfence serve --mode pd: the workers did not register (see their preflight above)",
                    file=sys.stderr,
                )
                return 1
            return serve_router(router, config, listeners, local.control())
    finally:
        if directory is not None:
            keys.remove(directory)


def worker_config(
    config: Config,
    role: str,
    router_addr: str,
    threads: int,
    cores_file: str | None = None,
    keys_dir: Path | None = None,
    name: str | None = None,
) -> Config:
    """One worker's tree: the server's, with its role's pool, `threads` threads (and all of this host's when
    alone, with a core share), and its key `name` in `keys_dir` (None: --insecure-cluster). A role's own size
    wins over --kv-pages, which wins over --kv-cache-memory."""
    pages = config.pd.prefill_kv_pages if role == "prefill" else config.pd.decode_kv_pages
    size = pages or config.cache.kv_pages
    total = config.engine.threads or usable_cpus()
    return config.replace(
        router=router_addr,
        threads=threads,
        kv_pages=size,
        kv_cache_memory=None if size else config.cache.kv_cache_memory,
        cores_file=cores_file,
        max_threads=total if cores_file else None,
        admin_key=None,
        metrics_key=None,
        api_keys=None,
        cluster_keys=str(keys_dir) if keys_dir else None,
        cluster_key=name if keys_dir else None,
    )


def worker_configs(
    config: Config, router_addr: str, cores_file: str | None, keys_dir: Path | None = None
) -> dict[str, Config]:
    """The default layout's two trees (one prefill, one decode worker, half the threads each)."""
    threads = max(1, (config.engine.threads or usable_cpus()) // 2)
    return {
        role: worker_config(config, role, router_addr, threads, cores_file, keys_dir, f"{role}-0")
        for role in ("prefill", "decode")
    }


class ProcessHandle:
    """A worker process of `serve --mode pd` (a `supervisor.Handle`)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid: int | None = proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """Wait for it to exit (the router told it to), then SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10.0)
            reap([self.proc], terminate=self.proc.poll() is None, grace_s=10.0)


class LocalWorkers:
    """`serve --mode pd`'s workers: processes on this machine, each with its own key, supervised
    (kvfence/runtime/supervisor.py) and scaled at run time."""

    def __init__(self, router: Router, config: Config, keys_dir: Path | None) -> None:
        self.router, self.config, self.keys_dir = router, config, keys_dir
        self.share: Path | None = None
        if config.pd.share_cores:
            fd, name = tempfile.mkstemp(
                prefix="kvfence-cores-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
            os.close(fd)
            self.share = cores.create(Path(name))
        self._die_with_parent = parent_death_signal()
        self._next = {"prefill": 0, "decode": 0}
        policy = RestartPolicy(config.pd.max_restarts, config.pd.restart_window or RestartPolicy.window)
        self.supervisor = Supervisor(router, self._launch, policy, names=self._name, retire=self._retire)

    def __enter__(self) -> LocalWorkers:
        for role, count in (
            ("prefill", self.config.pd.prefill_workers),
            ("decode", self.config.pd.decode_workers),
        ):
            for _ in range(count):
                self.supervisor.add(role)
        self.supervisor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.supervisor.stop_supervising()  # first: a worker leaving now is not a crash to restart
        self.router.shutdown()  # tells the workers to exit
        self.supervisor.stop_workers()
        if self.share is not None:
            self.share.unlink(missing_ok=True)

    def none_given_up(self) -> bool:
        return all(s["state"] != "given_up" for s in self.supervisor.status())

    def control(self) -> ClusterControl:
        from kvfence.server.serving import ClusterControl

        def status() -> dict[str, Any]:
            return {"workers": self.router.cluster_status(), "supervised": self.supervisor.status()}

        return ClusterControl(status, self.supervisor.scale)

    def _name(self, role: str) -> str:
        """The next worker's name, and its key pair (the router reads the allowlist again at once)."""
        name = f"{role}-{self._next[role]}"
        self._next[role] += 1
        if self.keys_dir is not None:
            keys.add(self.keys_dir, role, name)
            self.router.reload_keys()
        return name

    def _retire(self, role: str, name: str) -> None:
        """A drained worker left: its key leaves the allowlist, so nothing can come back as it."""
        if self.keys_dir is not None:
            for suffix in (".key", ".key_secret"):
                (self.keys_dir / role / f"{name}{suffix}").unlink(missing_ok=True)
            self.router.reload_keys()

    def _launch(self, role: str, name: str) -> ProcessHandle:
        workers = self.config.pd.prefill_workers + self.config.pd.decode_workers
        threads = max(1, (self.config.engine.threads or usable_cpus()) // workers)
        share = str(self.share) if self.share else None
        tree = worker_config(self.config, role, self.router.addr, threads, share, self.keys_dir, name)
        cmd = [sys.executable, "-m", "kvfence", role, "--config", "-"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, preexec_fn=self._die_with_parent)
        assert proc.stdin is not None
        proc.stdin.write(tree.to_json().encode())
        proc.stdin.close()
        log.info("started %s worker %s (pid %d)", role, name, proc.pid)
        return ProcessHandle(proc)


def serve_router(
    router: Router, config: Config, listeners: list[socket.socket], cluster: ClusterControl | None = None
) -> int:
    from kvfence.dashboard.routes import envelope
    from kvfence.model.loader import load_tokenizer
    from kvfence.pd.remote import RemoteEngine, WorkersCollector
    from kvfence.runtime.http import serve_http
    from kvfence.server.metrics import ServerMetrics

    remote = RemoteEngine(router, load_tokenizer(config.model.model))
    print(
        f"kvfence router: context length {remote.context_length} (the smallest any worker holds)", flush=True
    )
    metrics = ServerMetrics()
    if cluster is None:  # `kvfence router`: workers started by hand join and leave on their own
        from kvfence.server.serving import ClusterControl

        cluster = ClusterControl(lambda: {"workers": router.cluster_status(), "supervised": None})
    control = cluster
    # each worker's pool from its heartbeats; readiness and the launcher's restarts
    metrics.registry.register(WorkersCollector(router, lambda: control.status()["supervised"]))

    async def kv_source() -> dict[str, Any]:
        workers, errors = await asyncio.to_thread(router.debug_kv, PD_ANSWER_TIMEOUT_S)
        return envelope("pd", workers, errors)

    def config_view() -> dict[str, Any]:
        return {"mode": "pd", "config": config.to_dict(public=True), "workers": router.worker_configs()}

    return serve_http(
        remote,
        config,
        metrics,
        config_view=config_view,
        kv_source=kv_source,
        cluster=cluster,
        listeners=listeners,
    )


def cmd_worker(config: Config, args: argparse.Namespace) -> int:
    """One prefill or decode worker: preflight (I6), then register with the router and serve."""
    return run_worker(config, args.command)


def run_worker(config: Config, role: str, started: Callable[[Any], None] = lambda worker: None) -> int:
    """`kvfence prefill|decode`, or a Ray worker actor's thread (kvfence/runtime/ray_cluster.py), which is
    handed the worker by `started` before it serves (to stop it: `worker.running = False`)."""
    from kvfence import trace
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.memory import return_freed_memory
    from kvfence.pd.cores import CoreShare
    from kvfence.pd.worker import DecodeWorker, PrefillWorker
    from kvfence.runtime.colocated import clamped, run_preflight

    pd = config.pd
    if pd.router is None:
        print(f"kvfence {role}: --router is required (the router's control address)", file=sys.stderr)
        return 2
    try:  # before the model loads: a missing or unsafe key fails at once
        cluster_keys = worker_keys(config, role)
    except NoClusterKeys as exc:
        print(exc, file=sys.stderr)
        return 2
    share = None
    if pd.cores_file and config.engine.decode_threads is not None:  # the share sets every step's threads
        print(f"kvfence {role}: --decode-threads does nothing with --share-cores (each step runs on --threads "
              "or --max-threads); leave one out", file=sys.stderr)  # fmt: skip
        return 2
    if pd.cores_file:  # before the model loads: a bad thread count fails at once
        threads = config.engine.threads or 1
        index = re.search(r"(\d+)$", pd.cluster_key or "")  # prefill-1: its own byte in the share file
        share = CoreShare(
            Path(pd.cores_file), role, threads, pd.max_threads or threads, int(index.group(1)) if index else 0
        )
    report, loaded = run_preflight(config)  # I6: a worker whose pool cannot hold its context refuses
    if not report.can_start:
        return 1
    config = clamped(config, report)
    traced = trace.install_from_env(role)  # KVFENCE_TRACE=DIR: page events for kvfence.sim.trace_check
    if traced is not None:
        log.warning("tracing page events to %s", traced)
    engine = LLMEngine(config, loaded)
    del loaded
    return_freed_memory()
    public = config.to_dict(public=True)
    worker: PrefillWorker | DecodeWorker
    if role == "prefill":
        worker = PrefillWorker(
            engine, pd.router, pd.data, pd, cores=share, config=public, cluster_keys=cluster_keys
        )
    else:
        worker = DecodeWorker(engine, pd.router, pd, cores=share, config=public, cluster_keys=cluster_keys)
    worker.preflight = report  # shown per worker on the router's page map
    log.info("%s worker up, router %s", role, pd.router)
    started(worker)
    worker.serve()
    return 2 if worker.refusal else 0  # refused: a configuration error, which a restart would meet again
