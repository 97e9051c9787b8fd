"""`kvfence serve --mode pd --ray [auto|ADDRESS]`: the router and every worker as Ray actors (docs/scale-out.md).

What Ray does: discovery (the router's address reaches each worker at creation, nobody types it), placement (a
worker actor asks for one `kvfence_prefill` or `kvfence_decode` resource, so operators label nodes with
`ray start --resources`), liveness of processes and nodes, and restarts (`max_restarts`). What kvfence keeps:
the control and KV data planes are its own ZeroMQ sockets with CURVE keys (kvfence/pd/keys.py), so every page
frame is checked by the receiver (I2, I3) and nothing of a tenant's passes through Ray's object store or RPC;
only configuration trees and the workers' keys travel as actor arguments. Placement of requests is the router's
(by load, kvfence/pd/router_core.py), and so are admission (I5) and the fingerprint check at registration (I6).

Keys: the router actor makes the cluster's keys in a private directory on its node, a pool of `KEY_POOL` pairs
per role, and hands each worker actor only its own pair, the router's public key and (a prefill worker) the
decode public keys. A restarted actor gets the same arguments again, so it rejoins with its own key. Those
arguments travel through Ray's control plane, and Ray keeps them (its GCS, on the head node) to restart the
actor: run Ray on a network you trust (docs/security.md).

A worker actor whose process dies is restarted by Ray on a node with its resource, when there is one; the
router drops the dead worker at once (`RayHandle.exited` tells it), fails its requests with 503
`worker_unavailable`, and the replacement registers through the fingerprint check with a fresh pool, inheriting
nothing. An actor Ray gave up on is shown as given up by `kvfence cluster status`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from kvfence.config import Config
from kvfence.pd import keys
from kvfence.runtime.supervisor import RestartPolicy, Supervisor

log = logging.getLogger("kvfence.ray")
KEY_POOL = 16  # key pairs made per role: at most this many workers of a role over the deployment's life
RESOURCE = {"prefill": "kvfence_prefill", "decode": "kvfence_decode"}
NAMESPACE = "kvfence"


def node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _log_like_the_cli() -> None:
    """An actor's process starts without kvfence's logging set up: the same lines as `kvfence prefill` prints,
    in the actor's log (Ray forwards it to the driver)."""
    from kvfence.runtime.process import process_defaults

    process_defaults(os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class WorkerActor:
    """One PD worker process (a Ray actor): unpacks its keys, then runs `kvfence prefill|decode` on a thread,
    so that Ray's restart of the actor (a new process, `__init__` again) is a fresh worker that registers."""

    def __init__(self, tree: str, role: str, name: str, key_files: dict[str, bytes]) -> None:
        from kvfence.runtime.pd import run_worker

        _log_like_the_cli()
        self.keys_dir = keys.unpack(key_files)
        changes: dict[str, Any] = {"cluster_keys": str(self.keys_dir), "cluster_key": name}
        if role == "prefill":  # decode workers on other nodes connect here
            changes["data"] = f"tcp://{node_ip()}:0"
        config = Config.from_json(tree).replace(**changes)
        self.status: int | None = None
        self.worker: Any = None
        self.done = threading.Event()

        def run() -> None:
            try:
                self.status = run_worker(config, role, started=self._started)
            except BaseException:  # a crash: the process goes, so that Ray restarts the actor (max_restarts)
                log.exception("%s worker %s failed; its actor process exits", role, name)
                keys.remove(self.keys_dir)
                os._exit(1)
            keys.remove(self.keys_dir)
            self.done.set()  # it ended by itself (drained, refused by its preflight): wait_exit returns

        threading.Thread(target=run, name=f"kvfence-{name}", daemon=True).start()

    def _started(self, worker: Any) -> None:
        self.worker = worker

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "ip": node_ip()}

    def wait_exit(self) -> int:
        """Returns the worker's exit status once its loop ends (a drained worker told to shut down: 0)."""
        self.done.wait()
        return self.status if self.status is not None else 1

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.running = False


class RayHandle:
    """A worker actor, as the supervisor sees it (a `supervisor.Handle`). Ray restarts the actor up to
    `max_restarts` times; each death is told to the router at once (`on_death`), and only a death Ray does not
    restart from counts as the worker's exit."""

    def __init__(self, actor: Any, name: str, on_death: Any) -> None:
        self.actor, self.name, self.on_death = actor, name, on_death
        self.pid: int | None = None
        self.node: str | None = None
        self.deaths = 0
        self._info = actor.info.remote()
        self._done = actor.wait_exit.remote()

    def exited(self) -> int | None:
        import ray

        if self.pid is None and ray.wait([self._info], timeout=0)[0]:
            try:
                info = ray.get(self._info)
                self.pid, self.node = info["pid"], info["node"][:12]
            except ray.exceptions.RayError:
                pass
        if not ray.wait([self._done], timeout=0)[0]:
            return None
        try:
            return int(ray.get(self._done))
        except ray.exceptions.ActorUnavailableError:  # its process (or node) died and Ray is restarting it
            if self.pid is not None:  # this incarnation was seen alive: one death, told to the router now
                self.deaths += 1
                log.error("worker actor %s (pid %s) died; Ray restarts it", self.name, self.pid)
                self.on_death(self.pid, self.name)
                self.pid = None
            self._info, self._done = self.actor.info.remote(), self.actor.wait_exit.remote()
            return None
        except ray.exceptions.RayError as exc:  # dead for good: Ray gave up on it (max_restarts)
            log.error("worker actor %s (pid %s) is gone: %s", self.name, self.pid, type(exc).__name__)
            self.on_death(self.pid, self.name)
            return -1

    def stop(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayWorkers:
    """The worker actors of one deployment, started, watched and scaled from the router actor."""

    def __init__(self, router: Any, config: Config, keys_dir: Path) -> None:
        self.router, self.config, self.keys_dir = router, config, keys_dir
        self._next = {"prefill": 0, "decode": 0}
        # Ray restarts actors; the supervisor only reports the ones Ray gave up on, and scales
        self.supervisor = Supervisor(router, self._launch, RestartPolicy(max_restarts=0), names=self._name)

    def start(self) -> None:
        for role, count in (
            ("prefill", self.config.pd.prefill_workers),
            ("decode", self.config.pd.decode_workers),
        ):
            for _ in range(count):
                self.supervisor.add(role)
        self.supervisor.start()

    def none_given_up(self) -> bool:
        return all(s["state"] != "given_up" for s in self.supervisor.status())

    def _name(self, role: str) -> str:
        if self._next[role] >= KEY_POOL:
            raise ValueError(f"this deployment made keys for {KEY_POOL} {role} workers; all have been used")
        name = f"{role}-{self._next[role]}"
        self._next[role] += 1
        return name

    def _launch(self, role: str, name: str) -> RayHandle:
        import ray

        from kvfence.runtime.pd import worker_config

        threads = self.config.engine.threads or 1
        tree = worker_config(self.config, role, self.router.addr, threads).replace(share_cores=False)
        restarts = self.config.pd.max_restarts
        actor = (
            ray.remote(WorkerActor)
            .options(
                name=f"kvfence-{name}-{os.getpid()}",
                namespace=NAMESPACE,
                num_cpus=threads,
                resources={RESOURCE[role]: 1},
                max_restarts=restarts,
                max_concurrency=4,  # wait_exit blocks; info and stop still answer
            )
            .remote(tree.to_json(), role, name, keys.bundle(self.keys_dir, role, name))
        )
        log.info("started %s worker actor %s", role, name)
        return RayHandle(actor, name, self.router.worker_exited)


PORT_TAKEN = "kvfence serve --ray: cannot serve on"  # how `hold_port` begins its line for the router actor


class RouterActor:
    """The router and its HTTP front (a Ray actor on the driver's node): it makes the keys, starts the worker
    actors and serves until told to stop."""

    def __init__(self, tree: str) -> None:
        from kvfence.pd.router import Router
        from kvfence.runtime.http import FrontDoorClosed, hold_port, tenant_shares

        _log_like_the_cli()
        self.config = Config.from_json(tree)
        # the HTTP port before the router's, which the OS picks (it could pick --port while this one is free)
        try:
            self.listeners = hold_port(self.config.server.host, self.config.server.port, "serve --ray")
        except FrontDoorClosed as exc:  # the driver finds this line in the actor's error (cmd_serve_ray)
            raise RuntimeError(str(exc)) from exc
        self.keys_dir = keys.ephemeral(prefill=KEY_POOL, decode=KEY_POOL)
        self.router = Router(
            bind=f"tcp://{node_ip()}:0",
            cluster_keys=keys.RouterKeys.load(self.keys_dir),
            placement=self.config.pd.placement or "load",
            tenants=tenant_shares(self.config),
        )
        self.workers = RayWorkers(self.router, self.config, self.keys_dir)
        self.workers.start()

    def wait_ready(self, timeout: float) -> bool:
        pd = self.config.pd
        return self.router.wait_for_workers(
            pd.prefill_workers, pd.decode_workers, timeout, alive=self.workers.none_given_up
        )

    def serve(self) -> int:
        """The HTTP front, until the process is asked to stop (blocks one of the actor's threads)."""
        from kvfence.runtime.pd import serve_router

        return serve_router(self.router, self.config, self.listeners, self.control())

    def control(self) -> Any:
        from kvfence.server.serving import ClusterControl

        def status() -> dict[str, Any]:
            return {"workers": self.router.cluster_status(), "supervised": self.workers.supervisor.status()}

        return ClusterControl(status, self.workers.supervisor.scale)

    def status(self) -> dict[str, Any]:
        return dict(self.control().status())

    def scale(self, prefill: int, decode: int) -> dict[str, Any]:
        return self.workers.supervisor.scale(prefill, decode)

    def audit(self, timeout: float = 10.0) -> tuple[list[dict[str, Any]], list[str]]:
        return self.router.audit(timeout)

    def stop(self) -> None:
        self.workers.supervisor.stop_supervising()  # first: a worker leaving now is not a death to report
        self.router.shutdown()
        self.workers.supervisor.stop_workers()
        keys.remove(self.keys_dir)


def start_router(config: Config, ray_module: Any) -> Any:
    """The router actor, on this (the driver's) node: its HTTP port is where `kvfence serve` was run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray_module.get_runtime_context().get_node_id()
    return (
        ray_module.remote(RouterActor)
        .options(
            num_cpus=0,
            max_concurrency=8,  # serve() blocks one thread; status, scale and audit use others
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            namespace=NAMESPACE,
        )
        .remote(config.to_json())
    )


def cmd_serve_ray(config: Config, args: argparse.Namespace) -> int:
    from kvfence.runtime.http import front_door_problem
    from kvfence.runtime.process import exit_on_sigterm

    exit_on_sigterm()
    if problem := front_door_problem(config, "serve"):
        print(problem, file=sys.stderr)
        return 2
    try:
        import ray
    except ImportError:
        print("kvfence serve --ray: Ray is not installed: pip install 'kvfence[ray]'", file=sys.stderr)
        return 2
    address = config.pd.ray
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(
            f"kvfence serve --ray {address}: cannot reach a Ray cluster ({exc}). Start one with `ray start "
            "--head` (and `ray start --address HEAD:6379 --resources '{\"kvfence_decode\": 1}'` on each "
            "worker node; docs/scale-out.md)",
            file=sys.stderr,
        )
        return 2
    offered = ray.cluster_resources()  # type: ignore[no-untyped-call]
    missing = [r for r in RESOURCE.values() if not offered.get(r)]
    if missing:
        log.warning("no node of this Ray cluster offers %s yet: those workers wait until one joins "
                    "(ray start --resources; docs/scale-out.md)", ", ".join(missing))  # fmt: skip
    router = start_router(config, ray)
    try:
        try:
            ready = ray.get(router.wait_ready.remote(config.pd.registration_timeout))
        except ray.exceptions.RayActorError as exc:  # the router actor's __init__ raised: its port, say
            said = [line.strip() for line in str(exc).splitlines() if PORT_TAKEN in line]
            print(
                said[-1].split("RuntimeError: ")[-1] if said else f"kvfence serve --ray: {exc}",
                file=sys.stderr,
            )
            return 2
        if not ready:
            print("kvfence serve --ray: the workers did not register (see their logs above)", file=sys.stderr)
            return 1
        return int(ray.get(router.serve.remote()))
    finally:
        with contextlib.suppress(Exception):  # the router may be gone already: its actors die with the job
            ray.get(router.stop.remote(), timeout=30)
        ray.kill(router)
