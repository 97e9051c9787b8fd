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
from kvfence.pd import control, wire
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


def fingerprint(engine: LLMEngine) -> dict[str, Any]:
    """What the router compares across workers (I6): model identity, KV layout, limits."""
    return {
        "layout": layout_fingerprint(engine),
        "vocab_size": engine.model_config.vocab_size,
        "context_length": engine.context_length,
        "pool_pages": engine.pool.num_pages,
        "page_size": engine.pool.page_size,
    }


class Worker:
    """The process shell around a role: it is the role's `Transport`. `options` gives the transfer window and
    timeouts (kvfence/config.py's defaults when None); `config` is the worker's public configuration tree, sent
    to the router at registration."""

    preflight: PreflightReport | None = None  # this worker's I6 verdict, set by its launcher (the page map)
    _kv_map: KvMapper | None = None
    role: Role

    def __init__(
        self,
        engine: LLMEngine,
        router_addr: str,
        options: PDOptions | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        ctx: zmq.Context[Any] | None = None,
        cores: CoreShare | None = None,
    ) -> None:
        self.engine = engine
        self.options = options or PDOptions()
        self.config = dict(config or {})
        self.cores = cores  # threads per step follow the other workers on this host (kvfence/pd/cores.py)
        self.ctx = ctx or zmq.Context.instance()
        self.identity = uuid.uuid4().bytes
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 0)
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
        self.last_router_msg = time.monotonic()

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
                for sock, _ in self.poller.poll(0 if steppable else IDLE_POLL_MS):
                    self._drain(sock)  # before the silence check: pings queued during a long step count
                silence = ROUTER_SILENCE_S if self.registered else REGISTRATION_WAIT_S
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
        )

    def _register(self, _: control.Reregister | None = None) -> None:
        fp = fingerprint(self.engine)
        self.send_control(control.Register(self.role.name, fp, self.data_addr, os.getpid(), self.config))

    def _heartbeats(self) -> None:
        """Its own thread and socket, so a long forward step (a 2,000-token prefill) never looks like death."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_addr)
        stop = threading.Event()
        while self.running and not stop.wait(HEARTBEAT_S):
            sock.send(control.encode(self._beat))
        sock.close(0)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while self.running:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.control:
                self.last_router_msg = time.monotonic()
                self.role.on_control_frame(frames[0])
                continue
            peer, body = (frames[0], frames[1:]) if sock is self.data_socket() else (sock, frames)
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
        log.error("router refused %s worker: %s", self.role.name, msg.reason)
        self.running = False

    def _on_shutdown(self, msg: control.Shutdown) -> None:
        self.running = False

    def _on_registered(self, msg: control.Registered) -> None:
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

    def connect(self, data_addr: str) -> Any:
        raise NotImplementedError

    def data_socket(self) -> zmq.Socket[Any] | None:
        return None

    def close(self) -> None:
        self.control.close(0)
        if self.cores is not None:
            self.cores.close()


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
        host, _, port = data_addr.rpartition(":")
        if port == "0":  # any free port; tell the router which one
            self.data_addr = f"{host}:{self.data.bind_to_random_port(host)}"
        else:
            self.data.bind(data_addr)
            self.data_addr = data_addr
        self.poller.register(self.data, zmq.POLLIN)

    def data_socket(self) -> zmq.Socket[Any] | None:
        return self.data

    def send_data(self, peer: Any, message: Message) -> None:
        self.data.send_multipart([peer, *wire.encode(message)], copy=True)

    def close(self) -> None:
        self.data.close(0)
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
        self.peers: dict[str, zmq.Socket[Any]] = {}  # prefill data address -> our DEALER to it

    def connect(self, data_addr: str) -> Any:
        sock = self.peers.get(data_addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(data_addr)
            self.poller.register(sock, zmq.POLLIN)
            self.peers[data_addr] = sock
        return sock

    def send_data(self, peer: Any, message: Message) -> None:
        peer.send_multipart(wire.encode(message))

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
        super().close()
