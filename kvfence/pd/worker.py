"""Prefill and decode worker processes: a role (kvfence/pd/roles.py) behind ZeroMQ sockets.

Boundary: sockets, registration, heartbeats and the event loop. What a worker does with a request, a ticket or
a frame is its role's business (sans-IO, also driven by the simulator in kvfence/sim). Each worker is one
thread: it polls its sockets, hands what arrives to its role, and steps its engine.

Sockets:  control  DEALER -> router (ROUTER)               registration, requests, aborts, outputs, errors
          data     prefill binds ROUTER; decode connects a DEALER per prefill: tickets and acks flow
                   decode -> prefill, page frames and final frames prefill -> decode.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import zmq

from kvfence.config import PDOptions
from kvfence.dashboard.snapshot import KvMapper
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.loop import IdleTrim
from kvfence.engine.preflight import PreflightReport
from kvfence.pd import control, keys, wire
from kvfence.pd.control import ControlMessage
from kvfence.pd.cores import CoreShare
from kvfence.pd.decode_role import DecodeRole
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import Message
from kvfence.pd.prefill_role import PrefillRole
from kvfence.pd.roles import Role

log = logging.getLogger("kvfence.pd.worker")
IDLE_POLL_MS = 50
HEARTBEAT_S = 0.5  # the router declares a worker dead after several missed heartbeats
HEALTH_REFRESH_S = 0.1  # how stale a heartbeat's pool counts may be
ROUTER_SILENCE_S = 15.0  # a registered worker whose router has said nothing for this long exits
REGISTRATION_WAIT_S = 600.0  # a worker no router has accepted for this long exits (its router is gone)
REGISTER_RETRY_S = 1.0  # after a "key in use" refusal
SILENT_ROUTER_HINT_S = 10.0  # unregistered and nothing heard for this long: say what may be wrong, once


def fingerprint(engine: LLMEngine) -> dict[str, Any]:
    """What the router compares across workers (I6): model identity, KV layout, limits."""
    return {
        "layout": layout_fingerprint(engine),
        "vocab_size": engine.model_config.vocab_size,
        "context_length": engine.context_length,
        "pool_pages": engine.pool.num_pages,
        "page_size": engine.pool.page_size,
        "scheduling_policy": engine.config.scheduler.policy,  # vtc applies the tenants' shares the router sends
    }


class Worker:
    """The process shell around a role: it is the role's `Transport`. `options` gives the transfer window and
    timeouts (kvfence/config.py's defaults when None); `config` is the worker's public configuration tree, sent
    to the router at registration."""

    preflight: PreflightReport | None = None  # this worker's I6 verdict, set by its launcher (the page map)
    _kv_map: KvMapper | None = None
    role: Role
    handshakes: keys.Handshakes | None = None  # failed handshakes on a prefill's data socket

    def __init__(
        self,
        engine: LLMEngine,
        router_addr: str,
        options: PDOptions | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        ctx: zmq.Context[Any] | None = None,
        cores: CoreShare | None = None,
        cluster_keys: keys.WorkerKeys | None = None,
    ) -> None:
        """`cluster_keys`: CURVE on both planes, the router proven by its public key (I10); None only with
        --insecure-cluster (and tests of the protocol itself)."""
        self.engine = engine
        self.keys = cluster_keys
        self.options = options or PDOptions()
        self.config = dict(config or {})
        self.cores = cores  # threads per step follow the other workers on this host (kvfence/pd/cores.py)
        self._own_ctx = ctx is None and cluster_keys is not None  # ZAP is per context: ours alone
        self.ctx = ctx or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.identity = uuid.uuid4().bytes
        self.control = self._router_socket()
        self.control.setsockopt(zmq.IDENTITY, self.identity)
        self.control.connect(router_addr)
        self.router_addr = router_addr
        self._beat = self._health()  # refreshed between steps, read by the heartbeat thread
        self._beat_at = time.monotonic()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.data_addr = ""
        self.running = True
        self.registered = False
        self.refusal: str | None = (
            None  # why the router would not take us (the process exits 2: configuration)
        )
        self.last_router_msg = time.monotonic()
        self._register_at: float | None = None
        self._hinted = False
        self._early: list[list[bytes]] = []  # control frames read during a step (`_arrivals`), handled next
        engine.arrivals = self._arrivals

    def serve(self) -> None:
        self._register()
        self.last_router_msg = time.monotonic()
        beat = threading.Thread(target=self._heartbeats, name="kvfence-heartbeat", daemon=True)
        beat.start()
        steppable = False
        idle = IdleTrim()
        try:
            while self.running:
                # While only transfers are outstanding, wait on the sockets: a frame or an ack wakes the poll. A
                # loop of empty steps here took a core from the other worker (docs/performance.md, session 8).
                if self._early:  # read during the last step, before anything the poll finds
                    self._drain(self.control)
                for sock, _ in self.poller.poll(0 if steppable else IDLE_POLL_MS):
                    self._drain(sock)  # before the silence check: pings queued during a long step count
                silence = ROUTER_SILENCE_S if self.registered else REGISTRATION_WAIT_S
                self._registration_chores()
                if time.monotonic() - self.last_router_msg > silence:
                    log.error(
                        "%s worker: the router has been silent for %.0f s; exiting", self.role.name, silence
                    )
                    break
                if self.cores is not None:
                    self.engine.set_step_threads(self.cores.step_threads(self.engine.has_steppable()))
                worked = self.engine.has_unfinished()  # the step below runs the engine
                steppable = self.role.step()
                if self.cores is not None:
                    self.cores.publish(steppable)
                self.role.on_tick()
                now = time.monotonic()
                if now - self._beat_at >= HEALTH_REFRESH_S:  # pool stats cost ~5% of a decode worker per step
                    self._beat, self._beat_at = self._health(), now
                idle.trim_if_due(worked, now)
        finally:  # also on an exception: the other worker must not see this one busy for good
            self.running = False
            beat.join()
            self.close()

    def _health(self) -> control.Heartbeat:
        """What every heartbeat carries: the pool's page counts and the integrity failures so far (the router's
        /metrics shows them per worker)."""
        stats = asdict(self.engine.pool.stats())
        return control.Heartbeat(
            worker=self.identity.hex(),
            pool_free=stats["num_free"],
            pool=stats,
            integrity_failures=self.engine.stats.integrity_failures,
            refused=self.refused_counts(),
            num_waiting=len(self.engine.scheduler.waiting),
            num_running=len(self.engine.scheduler.running),
            tenants=self._tenants(),
        )

    def _tenants(self) -> dict[str, dict[str, float]]:
        """Each tenant's pages, requests and counter here (no role yet, from __init__: none)."""
        if not hasattr(self, "role"):
            return {}
        return {t: asdict(s) for t, s in self.role.tenant_snapshots().items()}

    def refused_counts(self) -> dict[str, int]:
        """What this worker refused (I10), by reason: tickets from the wrong decode worker, failed handshakes
        on its data socket."""
        return dict(self.role.refused) if hasattr(self, "role") else {}  # (no role yet: from __init__)

    def _register(self, _: control.Reregister | None = None) -> None:
        fp = fingerprint(self.engine)
        self.send_control(control.Register(self.role.name, fp, self.data_addr, os.getpid(), self.config))

    def _router_socket(self) -> zmq.Socket[Any]:
        """A DEALER to the router: with keys, only a peer holding the router's secret key completes the
        handshake, so every control message this worker obeys comes from its router (I10)."""
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            keys.connect_curve(sock, self.keys.own, self.keys.router.principal)
        return sock

    def _registration_chores(self) -> None:
        now = time.monotonic()
        if self._register_at is not None and now >= self._register_at:
            self._register_at = None
            self._register()
        if not self.registered and not self._hinted and now - self.last_router_msg > SILENT_ROUTER_HINT_S:
            self._hinted = True
            log.warning(
                "%s worker: no answer from the router at %s after %.0f s. Is it up, and do both sides use "
                "the same cluster keys (or both --insecure-cluster)? A key the router does not list, or the "
                "wrong router.key, fails the handshake silently (the router counts it in /metrics).",
                self.role.name, self.router_addr, SILENT_ROUTER_HINT_S,
            )  # fmt: skip

    def _heartbeats(self) -> None:
        """Its own thread and socket, so a long forward step (a 2,000-token prefill) never looks like death.
        With keys it speaks as the same principal as the control socket, which is what the router checks."""
        sock = self._router_socket()
        sock.connect(self.router_addr)
        stop = threading.Event()
        while self.running and not stop.wait(HEARTBEAT_S):
            sock.send(control.encode(self._beat))
        sock.close(0)

    def _arrivals(self) -> list[str]:
        """Between layers of a step that may be interrupted (engine/llm_engine.py, `_interruptible`): read what
        the router has sent, keeping it in order for the loop to handle after the step, and return the tenants
        of the requests among it (the engine decides whether one stops the step). Nothing is handled mid-step."""
        tenants: list[str] = []
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return tenants
            self._early.append(frames)
            self.last_router_msg = time.monotonic()
            try:
                message = control.decode(frames[0])
            except control.ControlError:
                continue  # counted and dropped when the loop handles it
            if isinstance(message, control.Prefill):
                tenants.append(message.tenant)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while self.running:
            if sock is self.control and self._early:
                frames = self._early.pop(0)
            else:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
            if sock is self.control:
                self.last_router_msg = time.monotonic()
                self.role.on_control_frame(frames[0])
                continue
            peer, body = self.data_peer(sock, frames)
            try:
                message = wire.decode(body)
            except wire.WireError as exc:
                log.warning("dropped malformed data message: %s", exc)
                continue
            self.role.on_message(peer, message)

    # ---- control messages the worker answers itself (the role takes requests and aborts) ------------------

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        return {
            control.Refused: self._on_refused,
            control.Shutdown: self._on_shutdown,
            control.Registered: self._on_registered,
            control.Reregister: self._register,  # the router dropped us (missed heartbeats, or it restarted)
            control.DebugKv: self._on_debug_kv,
            control.Check: self._on_check,
            control.Arm: self._on_arm,
            control.Ping: control.ignore,  # only resets the silence clock, as every message from the router does
        }

    def _on_refused(self, msg: control.Refused) -> None:
        if msg.retry:  # our key's previous holder (this worker before a restart) is not reaped yet
            log.warning("router: %s; registering again in %.0f s", msg.reason, REGISTER_RETRY_S)
            self._register_at = time.monotonic() + REGISTER_RETRY_S
            return
        log.error("router refused %s worker: %s", self.role.name, msg.reason)
        self.refusal = msg.reason
        self.running = False

    def _on_shutdown(self, msg: control.Shutdown) -> None:
        self.running = False

    def _on_registered(self, msg: control.Registered) -> None:
        try:  # the router checked them against our pool; a mismatch here is a bug on one side, not ignored
            self.engine.set_tenants(msg.tenants)
        except ValueError as exc:
            log.error("%s worker: the router's tenant shares: %s", self.role.name, exc)
            self.refusal = f"the router's tenant shares: {exc}"
            self.running = False
            return
        self.registered = True

    def _on_debug_kv(self, msg: control.DebugKv) -> None:
        """The router's page map: taken here, between two engine steps."""
        self.send_control(control.DebugKv(msg.nonce, self.kv_map().snapshot()))

    def _on_check(self, msg: control.Check) -> None:
        """The router's integrity audit (tests, operators): between two engine steps."""
        self.send_control(self.audit(msg.nonce))

    def _on_arm(self, msg: control.Arm) -> None:
        """Fault injection at run time, only where the operator allowed it (tests, drills)."""
        if os.environ.get("KVFENCE_FAULT_ARMING") == "1":
            self.engine.faults.arm(msg.spec)
            log.warning("%s worker: fault knobs armed by the router: %s", self.role.name, msg.spec)
        else:
            log.error(
                "%s worker: refused to arm %s (KVFENCE_FAULT_ARMING is not 1)", self.role.name, msg.spec
            )

    def audit(self, nonce: int = 0) -> control.Checked:
        """Integrity of this worker's pool, engine and transfers, and what is still live."""
        try:
            self.role.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "AssertionError"
        stats = self.engine.pool.stats()
        return control.Checked(nonce, error is None, error, stats.num_pages, stats.num_free)

    def kv_map(self) -> KvMapper:
        if self._kv_map is None:
            name = f"{self.role.name} worker {os.getpid()}"
            self._kv_map = KvMapper(self.engine, name, self.role.name, self.preflight, self.role.receiver())
        return self._kv_map

    # ---- Transport -------------------------------------------------------------------------------------

    def send_control(self, message: ControlMessage) -> None:
        self.control.send(control.encode(message))

    def send_data(self, peer: Any, message: Message) -> None:
        raise NotImplementedError

    def connect(self, data_addr: str, principal: str = "") -> Any:
        raise NotImplementedError

    def data_socket(self) -> zmq.Socket[Any] | None:
        return None

    def data_peer(self, sock: zmq.Socket[Any], frames: list[bytes]) -> tuple[Any, list[bytes]]:
        """(the peer handle, the message's frames) of what arrived on a data socket."""
        return sock, frames

    def principal(self, peer: Any) -> str:
        return ""

    def close(self) -> None:
        self.control.close(0)
        if self.cores is not None:
            self.cores.close()
        if self._own_ctx:
            self.ctx.term()


class PrefillWorker(Worker):
    def __init__(
        self,
        engine: LLMEngine,
        router_addr: str,
        data_addr: str,
        options: PDOptions | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(engine, router_addr, options, **kw)
        self.role = PrefillRole(engine, self, self.options)
        self.data: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.gate: keys.Gate | None = None
        if self.keys is not None:  # only decode workers' keys connect (re-read per connection: revocation)
            self.gate = keys.Gate(self.ctx)
            self.gate.accept(keys.DATA_DOMAIN, self.keys.decode_allowed)
            keys.serve_curve(self.data, self.keys.own, keys.DATA_DOMAIN)
            self.handshakes = keys.Handshakes(self.data)
            self.poller.register(self.handshakes.monitor, zmq.POLLIN)
        host, _, port = data_addr.rpartition(":")
        if port == "0":  # any free port; tell the router which one
            self.data_addr = f"{host}:{self.data.bind_to_random_port(host)}"
        else:
            self.data.bind(data_addr)
            self.data_addr = data_addr
        self.poller.register(self.data, zmq.POLLIN)

    def data_socket(self) -> zmq.Socket[Any] | None:
        return self.data

    def data_peer(self, sock: zmq.Socket[Any], frames: list[bytes]) -> tuple[Any, list[bytes]]:
        return frames[0], frames[1:]

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        if self.handshakes is not None and sock is self.handshakes.monitor:
            self.handshakes.drain()
        elif sock is self.data and self.keys is not None:
            self._drain_authenticated()
        else:
            super()._drain(sock)

    def _drain_authenticated(self) -> None:
        """Data messages with the principal CURVE authenticated for their connection: the peer handle is
        (routing id, principal), and a ticket is honoured only from the decode worker the router named."""
        while self.running:
            try:
                frames = self.data.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = (frames[0].bytes, keys.principal_of(frames[-1]))
            try:
                message = wire.decode([f.bytes for f in frames[1:]])
            except wire.WireError as exc:
                log.warning("dropped malformed data message: %s", exc)
                continue
            self.role.on_message(peer, message)

    def principal(self, peer: Any) -> str:
        return str(peer[1]) if isinstance(peer, tuple) else ""

    def send_data(self, peer: Any, message: Message) -> None:
        route = peer[0] if isinstance(peer, tuple) else peer
        self.data.send_multipart([route, *wire.encode(message)], copy=True)

    def refused_counts(self) -> dict[str, int]:
        counts = super().refused_counts()
        if self.handshakes is not None:
            counts.update({f"handshake_{k}": v for k, v in self.handshakes.failed.items()})
        return counts

    def close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        self.data.close(0)
        if self.gate is not None:
            self.gate.stop()
        super().close()


class DecodeWorker(Worker):
    def __init__(
        self,
        engine: LLMEngine,
        router_addr: str,
        options: PDOptions | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(engine, router_addr, options, **kw)
        self.role = DecodeRole(engine, self, self.options)
        # (prefill data address, its public key) -> our DEALER to it
        self.peers: dict[tuple[str, str], zmq.Socket[Any]] = {}

    def connect(self, data_addr: str, principal: str = "") -> Any:
        """Our socket to a prefill's data address. With keys, the router names the prefill's public key and
        the handshake proves the other end holds its secret: KV comes only from the prefill the router chose."""
        if self.keys is not None and len(principal) != 40:
            raise ValueError(f"no valid public key for the prefill worker at {data_addr}")
        sock = self.peers.get((data_addr, principal))
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.keys is not None:
                keys.connect_curve(sock, self.keys.own, principal)
            try:
                sock.connect(data_addr)
            except zmq.ZMQError as exc:  # the router checks the address's shape; zmq may still refuse it
                sock.close(0)
                raise ValueError(f"cannot connect to the prefill worker at {data_addr!r}: {exc}") from exc
            self.poller.register(sock, zmq.POLLIN)
            self.peers[(data_addr, principal)] = sock
        return sock

    def send_data(self, peer: Any, message: Message) -> None:
        peer.send_multipart(wire.encode(message))

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
        super().close()
