"""The PD router process: `RouterCore` (kvfence/pd/router_core.py: registry, admission, placement, fan-in)
behind a ZeroMQ ROUTER socket and one I/O thread. The HTTP front calls `submit` and `abort` from any thread and
gets outputs through a callback; other threads hand the I/O thread work through a queue and a wake-up.
Questions to every worker (the page map, the integrity audit) are polls: sent with a nonce, answered on the I/O
thread, read by the caller.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvfence.engine.fairness import TenantShare
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import RequestId
from kvfence.pd import control, keys
from kvfence.pd.control import ControlMessage
from kvfence.pd.router_core import NoWorkers, OnOutput, RouterCore, WorkerInfo

log = logging.getLogger("kvfence.pd.router")
RELOAD_S = 1.0  # the keys directory is re-read this often: a removed key drops its worker within a second

__all__ = ["NoWorkers", "OnOutput", "Router", "RouterCore", "WorkerInfo"]


@dataclass
class _Poll:
    """One question fanned out to every worker (a page map, an integrity audit); answers arrive on the I/O
    thread and are read by the caller."""

    waiting: dict[bytes, str] = field(default_factory=dict)  # identity -> name, for "did not answer"
    answers: dict[bytes, ControlMessage] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


class Router(RouterCore):
    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        ctx: zmq.Context[Any] | None = None,
        dead_after_s: float = 5.0,
        faults: Faults | None = None,
        cluster_keys: keys.RouterKeys | None = None,
        placement: str = "load",
        tenants: Mapping[str, TenantShare] | None = None,
    ) -> None:
        """`tenants`: weights and page shares from the keys file, sent to every worker at registration.
        `cluster_keys`: CURVE on the control plane, workers admitted by the keys directory's allowlists
        (I10); None only for a cluster run with --insecure-cluster (and tests of the protocol itself)."""
        roles = cluster_keys.allowed() if cluster_keys else None
        super().__init__(dead_after_s, faults, roles=roles, placement=placement, tenants=tenants)
        # with keys, a context of its own: ZAP (who may connect) is per context, and this router owns it
        self._own_ctx = ctx is None and cluster_keys is not None
        self.ctx = ctx or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.keys = cluster_keys
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.gate: keys.Gate | None = None
        self.handshakes: keys.Handshakes | None = None
        if cluster_keys is not None:
            self.gate = keys.Gate(self.ctx)
            self.gate.accept(keys.CONTROL_DOMAIN, lambda: self.roles or {})
            keys.serve_curve(self.socket, cluster_keys.own, keys.CONTROL_DOMAIN)
            self.handshakes = keys.Handshakes(self.socket)
        self.principal = cluster_keys.own.principal if cluster_keys else ""
        host = bind.rsplit(":", 1)[0]
        if bind.endswith(":0"):
            self.addr = f"{host}:{self.socket.bind_to_random_port(host)}"
        else:
            self.socket.bind(bind)
            self.addr = bind
        self._wake_addr = f"inproc://router-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        self._registered = threading.Condition()
        self._last_ping = 0.0
        self._last_reload = time.monotonic()
        self._running = True
        self.loop_errors = 0  # exceptions the I/O thread caught and survived
        self._polls: dict[int, _Poll] = {}  # I/O thread only
        self._nonces = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="kvfence-router", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------------

    def wait_for_workers(
        self, num_prefill: int, num_decode: int, timeout: float, alive: Callable[[], bool] = lambda: True
    ) -> bool:
        """Wait until enough workers of each role registered; False on timeout, or as soon as `alive()` turns
        False (the launcher's "a worker process exited"), checked once a second."""

        def ready() -> bool:
            roles = [w.role for w in list(self.workers.values())]
            return roles.count("prefill") >= num_prefill and roles.count("decode") >= num_decode

        deadline = time.monotonic() + timeout
        with self._registered:
            while not self._registered.wait_for(ready, min(1.0, max(0.0, deadline - time.monotonic()))):
                if not alive() or time.monotonic() >= deadline:
                    return False
            return True

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str, on_output: OnOutput
    ) -> None:
        """Admit against every stage (I5) before anything is sent; raises AdmissionError or NoWorkers."""
        self.admit(len(prompt_ids), params, tenant)
        self._post(lambda: self.route(prompt_ids, params, RequestId(request_id), tenant, on_output))

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.cancel(RequestId(request_id)))

    def debug_kv(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every registered worker's KV page map (kvfence/dashboard), each taken between that worker's engine
        steps; waits up to `timeout` s. Returns (maps, one line per worker that did not answer in time)."""
        answers, late = self.ask(control.DebugKv, timeout)
        maps = [
            {**msg.snapshot, "address": w.data_addr, "pid": w.pid}
            for w, msg in answers
            if isinstance(msg, control.DebugKv) and msg.snapshot is not None
        ]
        return sorted(maps, key=lambda m: (m["role"] != "prefill", m["name"])), late

    def audit(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every worker's integrity audit (pool, engine and transfer invariants; free pages), taken between
        its engine steps. Returns (one dict per worker with role/pid/ok/error/num_pages/num_free, late)."""
        answers, late = self.ask(control.Check, timeout)
        checked = [(w, msg) for w, msg in answers if isinstance(msg, control.Checked)]
        return [{**_fields(msg), "role": w.role, "pid": w.pid} for w, msg in checked], late

    def arm(self, identity: bytes, spec: str) -> None:
        """Arm fault knobs on one worker (debug/test only; the worker obeys only with KVFENCE_FAULT_ARMING=1)."""
        self._post(lambda: self._send(identity, control.Arm(spec)))

    def ask(
        self, question: Callable[[int], ControlMessage], timeout: float
    ) -> tuple[list[tuple[WorkerInfo, ControlMessage]], list[str]]:
        """Send `question(nonce)` to every registered worker and wait up to `timeout` s for their answers."""
        nonce, poll = next(self._nonces), _Poll()
        self._post(lambda: self._ask(question, nonce, poll))
        poll.done.wait(timeout)
        self._post(lambda: self._forget(nonce))
        with poll.lock:
            workers = dict(self.workers)
            answers = [(workers[i], msg) for i, msg in poll.answers.items() if i in workers]
            late = [f"{name} did not answer within {timeout:g} s" for i, name in poll.waiting.items()
                    if i not in poll.answers]  # fmt: skip
        return answers, late

    def worker_exited(self, pid: int | None, name: str) -> None:
        """A launcher saw a worker die (`RouterCore.forget`): its requests fail now, not after its heartbeats."""
        self._post(lambda: self.forget(pid=pid, name=name if self.keys is not None else None))

    def alive(self) -> bool:
        """Whether the I/O thread runs (liveness: GET /health/live answers 503 once it does not)."""
        return self._thread.is_alive()

    def is_registered(self, pid: int | None) -> bool:
        """Whether a worker with this process id is registered (any thread)."""
        return pid is not None and any(w.pid == pid for w in list(self.workers.values()))

    def drain_worker(self, pid: int | None, name: str) -> None:
        """Scale-in: no new placements on that worker; it is told to shut down once its requests end, or as soon
        as it registers if it has not yet."""
        self._post(lambda: self.drain_matching(pid, name))

    def cluster_status(self) -> list[dict[str, Any]]:
        """The registered workers as placement sees them (any thread): `kvfence cluster status`."""
        return [
            {
                "role": w.role,
                "name": w.name,
                "pid": w.pid,
                "data_addr": w.data_addr,
                "state": "draining" if w.draining else "ready",
                "pool_pages": w.pool_pages,
                "pool_free": w.pool_free,
                "in_flight": w.placed,
                "placed_total": w.placed_total,
                "committed_pages": w.committed_pages,
                "waiting": w.num_waiting,
            }
            for w in list(self.workers.values())
        ]

    def reload_keys(self) -> None:
        """Re-read the keys directory now (SIGHUP); the I/O thread also does every RELOAD_S."""
        self._post(self._reload_keys)

    def shutdown(self) -> None:
        def stop() -> None:
            for identity in self.workers:
                self._send(identity, control.Shutdown())
            self._running = False

        self._post(stop)
        self._thread.join(timeout=10)
        if self.handshakes is not None:
            self.handshakes.close()
        self.socket.close(linger=1000)  # let the shutdown messages reach the workers
        for sock in (self._wake_rx, self._wake_tx):
            sock.close(0)
        if self.gate is not None:
            self.gate.stop()
        if self._own_ctx:
            self.ctx.term()

    def _post(self, fn: Callable[[], None]) -> None:
        self._work.put(fn)
        with self._wake_lock:
            self._wake_tx.send(b"")

    # ---- the I/O thread ---------------------------------------------------------------------------------

    def _send(self, identity: bytes, message: ControlMessage) -> None:
        self.socket.send_multipart([identity, control.encode(message)])

    def _workers_changed(self) -> None:
        with self._registered:
            self._registered.notify_all()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        if self.handshakes is not None:
            poller.register(self.handshakes.monitor, zmq.POLLIN)
        while self._running:
            try:
                self._turn(poller)
            except Exception:  # one bad message or bug must not stop routing for everyone (counted, logged)
                self.loop_errors += 1
                log.exception("router: error on the I/O thread (the router keeps running)")

    def _turn(self, poller: zmq.Poller) -> None:
        for sock, _ in poller.poll(timeout=int(min(self.dead_after_s * 250, RELOAD_S * 1000))):
            if sock is self._wake_rx:
                self._wake_rx.recv()
                while not self._work.empty():
                    self._work.get_nowait()()
            elif sock is self.socket:
                self._receive()
            elif self.handshakes is not None:
                self.handshakes.drain()
        self.reap_dead_workers()
        self._ping_workers()
        if time.monotonic() - self._last_reload >= RELOAD_S:
            self._reload_keys()

    def _receive(self) -> None:
        frames = self.socket.recv_multipart(copy=False)
        if len(frames) != 2:
            self.control.num_malformed += 1
            return
        # I10: with keys, who sent it is what CURVE authenticated (ZAP's User-Id), never a field in the message
        principal = keys.principal_of(frames[1]) if self.keys is not None else ""
        self.on_frame(frames[0].bytes, frames[1].bytes, principal)

    def _reload_keys(self) -> None:
        self._last_reload = time.monotonic()
        if self.keys is None:
            return
        try:
            allowed = self.keys.allowed()
        except keys.KeyFileError as exc:  # keep the last good allowlist; the operator sees why
            log.error("cluster keys: %s; keeping the previous allowlist", exc)
            return
        if allowed != self.roles:
            log.warning("cluster keys: allowlist changed (%d keys)", len(allowed))
            self.revoke(allowed)

    def connection_counts(self) -> dict[str, int]:
        """Refused connections on the control plane: handshakes that failed (no CURVE, a wrong router key:
        `protocol`; a key not in the allowlist: `auth`), for /metrics."""
        if self.handshakes is None:
            return {}
        return dict(self.handshakes.failed)

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        return {
            **super().control_handlers(),
            control.DebugKv: self._on_answer,
            control.Checked: self._on_answer,
        }

    def _on_answer(
        self, msg: control.DebugKv | control.Checked, identity: bytes, principal: str = ""
    ) -> None:
        poll = self._polls.get(msg.nonce)
        if poll is None or identity not in poll.waiting:  # its asker stopped waiting, or not asked
            return
        with poll.lock:
            poll.answers[identity] = msg
            if poll.waiting.keys() <= poll.answers.keys():
                poll.done.set()

    def _forget(self, nonce: int) -> None:
        self._polls.pop(nonce, None)

    def _ask(self, question: Callable[[int], ControlMessage], nonce: int, poll: _Poll) -> None:
        with poll.lock:
            poll.waiting = {i: f"{w.role} worker {w.pid}" for i, w in self.workers.items()}
        if not poll.waiting:
            poll.done.set()
            return
        self._polls[nonce] = poll
        for identity in poll.waiting:
            self._send(identity, question(nonce))

    def _ping_workers(self) -> None:
        """Workers exit when their router goes silent, so a router killed with -9 leaves no orphans behind."""
        now = time.monotonic()
        if now - self._last_ping < self.dead_after_s / 3:
            return
        self._last_ping = now
        for identity in self.workers:
            self._send(identity, control.Ping())


def _fields(msg: control.Checked) -> dict[str, Any]:
    return {"ok": msg.ok, "error": msg.error, "num_pages": msg.num_pages, "num_free": msg.num_free}
