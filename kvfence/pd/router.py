"""The PD router's core: worker registry (I6), admission over every stage (I5), placement, and fan-in of
outputs. Boundary: no HTTP; the HTTP front calls `submit` and `abort` from any thread and gets outputs through
a callback. One I/O thread owns the control socket; other threads hand it work through a queue and a wake-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvfence.engine.admission import Limits, admit
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import RequestId
from kvfence.pd import control

log = logging.getLogger("kvfence.pd.router")
OnOutput = Callable[[RequestOutput], None]


class NoWorkers(RuntimeError):
    pass


@dataclass
class WorkerInfo:
    identity: bytes
    role: str
    fingerprint: dict[str, Any]
    data_addr: str
    last_seen: float = field(default_factory=time.monotonic)
    pool_free: int | None = None  # from the latest heartbeat
    pid: int | None = None  # for operators' logs (and tests that kill a worker)


@dataclass
class _Routed:
    prompt_len: int
    prefill: bytes
    decode: bytes
    on_output: OnOutput
    done: bool = False


@dataclass
class _DebugPoll:
    """One /debug/kv request fanned out to the workers; answers arrive on the I/O thread, read by the caller."""

    waiting: dict[bytes, str] = field(default_factory=dict)  # identity -> name, for "did not answer"
    answers: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Router:
    bind: str = "tcp://127.0.0.1:0"
    ctx: zmq.Context[Any] = field(default_factory=zmq.Context.instance)
    dead_after_s: float = 5.0  # no heartbeat for this long: the worker is gone
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self.bind.endswith(":0"):
            self.addr = (
                self.bind.rsplit(":", 1)[0]
                + f":{self.socket.bind_to_random_port(self.bind.rsplit(':', 1)[0])}"
            )
        else:
            self.socket.bind(self.bind)
            self.addr = self.bind
        self._wake_addr = f"inproc://router-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        self.workers: dict[bytes, WorkerInfo] = {}
        self._routed: dict[RequestId, _Routed] = {}
        self._registered = threading.Condition()
        self._rr = itertools.count()
        self._tids = itertools.count((int.from_bytes(os.urandom(3), "little") << 40) + 1)
        self._last_tid = 0
        self._last_ping = 0.0
        self._running = True
        self._debug_polls: dict[int, _DebugPoll] = {}  # I/O thread only
        self._debug_nonces = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="kvfence-router", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------------

    def wait_for_workers(self, num_prefill: int, num_decode: int, timeout: float) -> bool:
        def ready() -> bool:
            roles = [w.role for w in self.workers.values()]
            return roles.count("prefill") >= num_prefill and roles.count("decode") >= num_decode

        with self._registered:
            return self._registered.wait_for(ready, timeout)

    def limits(self) -> tuple[Limits, Limits]:
        """(prefill, decode) limits: the smallest context and pool any worker of each role has (I6)."""
        fps = {
            role: [w.fingerprint for w in self.workers.values() if w.role == role]
            for role in ("prefill", "decode")
        }
        if not fps["prefill"] or not fps["decode"]:
            raise NoWorkers("no prefill or no decode worker registered")
        ctx = min(fp["context_length"] for fp in fps["prefill"] + fps["decode"])
        page = fps["decode"][0]["page_size"]
        return (
            Limits(ctx, min(fp["pool_pages"] for fp in fps["prefill"]), page),
            Limits(ctx, min(fp["pool_pages"] for fp in fps["decode"]), page),
        )

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str, on_output: OnOutput
    ) -> None:
        """Admit against every stage (I5) before anything is sent; raises AdmissionError or NoWorkers."""
        prefill_limits, decode_limits = self.limits()
        admit(len(prompt_ids), params, prefill_limits, prefill_only=True)
        admit(len(prompt_ids), params, decode_limits)
        self._post(lambda: self._route(prompt_ids, params, RequestId(request_id), tenant, on_output))

    def placement(self, request_id: str) -> tuple[WorkerInfo, WorkerInfo] | None:
        """(prefill, decode) serving a live request, or None."""
        routed = self._routed.get(RequestId(request_id))
        if routed is None:
            return None
        workers = dict(self.workers)
        p, d = workers.get(routed.prefill), workers.get(routed.decode)
        return (p, d) if p is not None and d is not None else None

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(RequestId(request_id)))

    def debug_kv(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every registered worker's KV page map (kvfence/dashboard), each taken between that worker's engine
        steps; waits up to `timeout` s. Returns (maps, one line per worker that did not answer in time)."""
        nonce, poll = next(self._debug_nonces), _DebugPoll()
        self._post(lambda: self._ask_debug(nonce, poll))
        poll.done.wait(timeout)
        self._post(lambda: self._forget_debug(nonce))
        with poll.lock:
            answers = sorted(poll.answers.values(), key=lambda w: (w["role"] != "prefill", w["name"]))
            late = [f"{name} did not answer within {timeout:g} s" for i, name in poll.waiting.items()
                    if i not in poll.answers]  # fmt: skip
        return answers, late

    def shutdown(self) -> None:
        def stop() -> None:
            for identity in self.workers:
                self.socket.send_multipart([identity, control.pack("shutdown")])
            self._running = False

        self._post(stop)
        self._thread.join(timeout=10)
        self.socket.close(linger=1000)  # let the shutdown messages reach the workers
        for sock in (self._wake_rx, self._wake_tx):
            sock.close(0)

    def _post(self, fn: Callable[[], None]) -> None:
        self._work.put(fn)
        with self._wake_lock:
            self._wake_tx.send(b"")

    # ---- the I/O thread ---------------------------------------------------------------------------------

    def _ask_debug(self, nonce: int, poll: _DebugPoll) -> None:
        with poll.lock:
            poll.waiting = {i: f"{w.role} worker {w.pid}" for i, w in self.workers.items()}
        if not poll.waiting:
            poll.done.set()
            return
        self._debug_polls[nonce] = poll
        for identity in poll.waiting:
            self.socket.send_multipart([identity, control.pack("debug_kv", nonce=nonce)])

    def _forget_debug(self, nonce: int) -> None:
        self._debug_polls.pop(nonce, None)

    def _on_debug_kv(self, identity: bytes, msg: dict[str, Any]) -> None:
        poll, worker = self._debug_polls.get(msg.get("nonce", 0)), self.workers.get(identity)
        if poll is None or worker is None:
            return  # late: the caller gave up on it
        with poll.lock:
            poll.answers[identity] = {**msg["snapshot"], "address": worker.data_addr, "pid": worker.pid}
            if poll.waiting.keys() <= poll.answers.keys():
                poll.done.set()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while self._running:
            for sock, _ in poller.poll(timeout=int(self.dead_after_s * 250)):
                if sock is self._wake_rx:
                    self._wake_rx.recv()
                    while not self._work.empty():
                        self._work.get_nowait()()
                else:
                    identity, frame = self.socket.recv_multipart()
                    if identity in self.workers:
                        self.workers[identity].last_seen = time.monotonic()
                    self._on_message(identity, control.unpack(frame))
            self._reap_dead_workers()
            self._ping_workers()

    def _on_message(self, identity: bytes, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "register":
            self._register(identity, msg)
        elif op == "output":
            out = control.output_from_json(msg)
            routed = self._routed.get(out.request_id)
            if routed is not None and not routed.done:
                routed.done = out.finished
                routed.on_output(out)
                if out.finished:
                    self._routed.pop(out.request_id, None)
                if out.finished and out.error_code is not None:  # decode failed it (a refused reservation,
                    # a failed transfer): the prefill may still hold pages for it. By request id, never by
                    # transfer id, which a collision could share with another request (finding 2).
                    self.socket.send_multipart(
                        [routed.prefill, control.pack("abort", request_id=out.request_id)]
                    )
        elif op == "heartbeat":
            self._on_heartbeat(msg)
        elif op == "debug_kv":
            self._on_debug_kv(identity, msg)
        elif op == "error":
            self._on_error(identity, RequestId(msg["request_id"]), msg["code"])

    def _on_heartbeat(self, msg: dict[str, Any]) -> None:
        """Heartbeats come from each worker's own heartbeat socket and name the worker's control identity."""
        try:
            identity = bytes.fromhex(msg["worker"])
        except (KeyError, TypeError, ValueError):
            return
        worker = self.workers.get(identity)
        if worker is None:  # alive after all (or the router restarted): ask it to register again
            self.socket.send_multipart([identity, control.pack("reregister")])
            return
        worker.last_seen = time.monotonic()
        worker.pool_free = msg.get("pool_free")

    def _ping_workers(self) -> None:
        """Workers exit when their router goes silent, so a router killed with -9 leaves no orphans behind."""
        now = time.monotonic()
        if now - self._last_ping < self.dead_after_s / 3:
            return
        self._last_ping = now
        for identity in self.workers:
            self.socket.send_multipart([identity, control.pack("ping")])

    def _reap_dead_workers(self) -> None:
        """A worker that went silent is gone: its requests fail (503 to clients), the surviving side of each is
        told to abort (revoking its reservations), and placement skips it from now on."""
        now = time.monotonic()
        dead = [w for w in self.workers.values() if now - w.last_seen > self.dead_after_s]
        for w in dead:
            log.error("%s worker %s missed its heartbeats; failing its requests", w.role, w.data_addr or "")
            with self._registered:
                del self.workers[w.identity]
            for rid, routed in list(self._routed.items()):
                if w.identity in (routed.prefill, routed.decode):
                    self._on_error(w.identity, rid, "worker_unavailable")

    def _register(self, identity: bytes, msg: dict[str, Any]) -> None:
        fp = msg["fingerprint"]
        for other in self.workers.values():
            if (
                other.fingerprint["layout"] != fp["layout"]
                or other.fingerprint["vocab_size"] != fp["vocab_size"]
            ):
                reason = f"fingerprint {fp} does not match registered worker {other.fingerprint}"
                log.error("refusing %s worker: %s", msg["role"], reason)
                self.socket.send_multipart([identity, control.pack("refused", reason=reason)])
                return
        with self._registered:
            self.workers[identity] = WorkerInfo(
                identity, msg["role"], fp, msg.get("data_addr", ""), pid=msg.get("pid")
            )
            self._registered.notify_all()
        log.info("registered %s worker %s", msg["role"], fp)
        self.socket.send_multipart([identity, control.pack("registered")])

    def _route(
        self, ids: list[int], params: SamplingParams, rid: RequestId, tenant: str, cb: OnOutput
    ) -> None:
        prefills = [w for w in self.workers.values() if w.role == "prefill"]
        decodes = [w for w in self.workers.values() if w.role == "decode"]
        if not prefills or not decodes:
            cb(RequestOutput(rid, (), "", True, "error", "worker_unavailable", len(ids), 0, "", ()))
            return
        n = next(self._rr)
        p, d = prefills[n % len(prefills)], decodes[n % len(decodes)]
        self._routed[rid] = _Routed(len(ids), p.identity, d.identity, cb)
        body = {
            "request_id": rid,
            "prompt_ids": ids,
            "params": control.params_to_json(params),
            "tenant": tenant,
        }
        tid = self._last_tid if self._last_tid and self.faults.fire("reuse_transfer_id") else next(self._tids)
        self._last_tid = tid
        self.socket.send_multipart(
            [d.identity, control.pack("expect", transfer_id=tid, prefill_addr=p.data_addr, **body)]
        )
        self.socket.send_multipart([p.identity, control.pack("prefill", **body)])

    def _abort(self, rid: RequestId) -> None:
        routed = self._routed.get(rid)
        if routed is None:
            return
        for identity in (routed.decode, routed.prefill):
            self.socket.send_multipart([identity, control.pack("abort", request_id=rid)])

    def _on_error(self, identity: bytes, rid: RequestId, code: str) -> None:
        """A worker refused or failed the request: end it for the client, and stop the other side."""
        routed = self._routed.pop(rid, None)
        if routed is None or routed.done:
            return
        other = routed.decode if identity == routed.prefill else routed.prefill
        self.socket.send_multipart([other, control.pack("abort", request_id=rid)])
        routed.on_output(RequestOutput(rid, (), "", True, "error", code, routed.prompt_len, 0, "", ()))
