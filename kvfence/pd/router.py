"""The PD router: worker registry (I6), admission over every stage (I5), placement, and fan-in of outputs.

`RouterCore` is the decision logic, without sockets or threads: control messages and clock ticks in, control
messages out through `_send`. The deterministic simulator (kvfence/sim) drives it directly. `Router` puts it
behind a ZeroMQ ROUTER socket and one I/O thread; the HTTP front calls `submit` and `abort` from any thread and
gets outputs through a callback, and other threads hand the I/O thread work through a queue and a wake-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    last_seen: float
    pool_free: int | None = None  # from the latest heartbeat
    health: dict[str, Any] = field(default_factory=dict)  # the latest heartbeat: pool page counts, failures
    pid: int | None = None  # for operators' logs (and tests that kill a worker)


@dataclass
class _Routed:
    prompt_len: int
    prefill: bytes
    decode: bytes
    on_output: OnOutput
    done: bool = False
    # output tokens and text the client has been given (the first token may come from the prefill worker)
    sent_tokens: int = 0
    sent_text: str = ""


def _unseen(routed: _Routed, out: RequestOutput) -> RequestOutput:
    """What of `out` the client has not seen; records it as seen. The prefill worker sends the first token as
    soon as it is sampled (the time to first token is then the prefill's, not the prefill's plus the
    transfer's), and the decode worker's outputs carry it again. Tokens and logprobs already sent are dropped;
    text is cut from the cumulative text, since the decode worker's detokenizer may still hold back what the
    prefill worker's already showed (a character split across tokens)."""
    skip = max(0, routed.sent_tokens - (out.num_output_tokens - len(out.new_token_ids)))
    routed.sent_tokens = max(routed.sent_tokens, out.num_output_tokens)
    sent = routed.sent_text
    if out.text.startswith(sent):
        new_text, routed.sent_text = out.text[len(sent) :], out.text
    else:  # behind what was sent (held back), or an error's empty text
        new_text = "" if sent.startswith(out.text) else out.new_text
    if skip == 0 and new_text == out.new_text:
        return out
    return replace(
        out, new_token_ids=out.new_token_ids[skip:], new_text=new_text, logprobs=out.logprobs[skip:]
    )


class RouterCore:
    def __init__(
        self,
        dead_after_s: float = 5.0,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        tid_prefix: int | None = None,
    ) -> None:
        self.dead_after_s = dead_after_s  # no heartbeat for this long: the worker is gone
        self.faults = faults or Faults()
        self.clock = clock
        self.workers: dict[bytes, WorkerInfo] = {}
        self._routed: dict[RequestId, _Routed] = {}
        self._rr = itertools.count()
        # transfer ids: a 24-bit random prefix per router, then a counter (increasing: receivers rely on it)
        prefix = int.from_bytes(os.urandom(3), "little") if tid_prefix is None else tid_prefix
        self._tids = itertools.count((prefix << 40) + 1)
        self._last_tid = 0

    def _send(self, identity: bytes, op: str, **body: Any) -> None:
        raise NotImplementedError

    def _workers_changed(self) -> None:
        """Hook: the registry gained or lost a worker."""

    # ---- admission and placement --------------------------------------------------------------------

    def limits(self) -> tuple[Limits, Limits]:
        """(prefill, decode) limits: the smallest context and pool any worker of each role has (I6)."""
        fps = {
            role: [w.fingerprint for w in list(self.workers.values()) if w.role == role]
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

    def admit(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """I5 against every stage, before anything is sent; raises AdmissionError or NoWorkers."""
        prefill_limits, decode_limits = self.limits()
        admit(num_prompt_tokens, params, prefill_limits, prefill_only=True)
        admit(num_prompt_tokens, params, decode_limits)

    def placement(self, request_id: str) -> tuple[WorkerInfo, WorkerInfo] | None:
        """(prefill, decode) serving a live request, or None."""
        routed = self._routed.get(RequestId(request_id))
        if routed is None:
            return None
        workers = dict(self.workers)
        p, d = workers.get(routed.prefill), workers.get(routed.decode)
        return (p, d) if p is not None and d is not None else None

    def route(
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
        self._send(d.identity, "expect", transfer_id=tid, prefill_addr=p.data_addr, **body)
        self._send(p.identity, "prefill", transfer_id=tid, **body)

    def cancel(self, rid: RequestId) -> None:
        """The client went away: both sides abort the request (by request id)."""
        routed = self._routed.get(rid)
        if routed is None:
            return
        for identity in (routed.decode, routed.prefill):
            self._send(identity, "abort", request_id=rid)

    # ---- messages from workers, and time --------------------------------------------------------------

    def on_message(self, identity: bytes, msg: dict[str, Any]) -> None:
        if identity in self.workers:
            self.workers[identity].last_seen = self.clock()
        op = msg["op"]
        if op == "register":
            self._register(identity, msg)
        elif op == "output":
            self._on_output(control.output_from_json(msg), identity)
        elif op == "heartbeat":
            self._on_heartbeat(msg)
        elif op == "error":
            self._on_error(identity, RequestId(msg["request_id"]), msg["code"])

    def _on_output(self, out: RequestOutput, sender: bytes) -> None:
        routed = self._routed.get(out.request_id)
        if routed is None or routed.done:
            return
        if sender == routed.prefill and (out.finished or out.num_output_tokens != 1):
            return  # a prefill worker speaks for the first token only; the rest is decode's
        out = _unseen(routed, out)
        routed.done = out.finished
        routed.on_output(out)
        if out.finished:
            self._routed.pop(out.request_id, None)
        if out.finished and out.error_code is not None:
            # decode failed it (a refused reservation, a failed transfer): the prefill may still hold pages for
            # it. By request id, never by transfer id, which a collision could share (finding 2).
            self._send(routed.prefill, "abort", request_id=out.request_id)

    def _on_heartbeat(self, msg: dict[str, Any]) -> None:
        """Heartbeats come from each worker's own heartbeat socket and name the worker's control identity."""
        try:
            identity = bytes.fromhex(msg["worker"])
        except (KeyError, TypeError, ValueError):
            return
        worker = self.workers.get(identity)
        if worker is None:  # alive after all (or the router restarted): ask it to register again
            self._send(identity, "reregister")
            return
        worker.last_seen = self.clock()
        worker.pool_free = msg.get("pool_free")
        worker.health = {k: msg[k] for k in ("pool", "integrity_failures") if k in msg}

    def reap_dead_workers(self) -> None:
        """A worker that went silent is gone: its requests fail (503 to clients), the surviving side of each is
        told to abort (revoking its reservations), and placement skips it from now on."""
        now = self.clock()
        dead = [w for w in self.workers.values() if now - w.last_seen > self.dead_after_s]
        for w in dead:
            log.error("%s worker %s missed its heartbeats; failing its requests", w.role, w.data_addr or "")
            del self.workers[w.identity]
            self._workers_changed()
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
                self._send(identity, "refused", reason=reason)
                return
        info = WorkerInfo(
            identity, msg["role"], fp, msg.get("data_addr", ""), self.clock(), pid=msg.get("pid")
        )
        self.workers[identity] = info
        self._workers_changed()
        log.info("registered %s worker %s", msg["role"], fp)
        self._send(identity, "registered")

    def _on_error(self, identity: bytes, rid: RequestId, code: str) -> None:
        """A worker refused or failed the request: end it for the client, and stop the other side."""
        routed = self._routed.pop(rid, None)
        if routed is None or routed.done:
            return
        other = routed.decode if identity == routed.prefill else routed.prefill
        self._send(other, "abort", request_id=rid)
        routed.on_output(RequestOutput(rid, (), "", True, "error", code, routed.prompt_len, 0, "", ()))


@dataclass
class _Poll:
    """One question fanned out to every worker (a page map, an integrity audit); answers arrive on the I/O
    thread and are read by the caller."""

    waiting: dict[bytes, str] = field(default_factory=dict)  # identity -> name, for "did not answer"
    answers: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


class Router(RouterCore):
    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        ctx: zmq.Context[Any] | None = None,
        dead_after_s: float = 5.0,
        faults: Faults | None = None,
    ) -> None:
        super().__init__(dead_after_s, faults)
        self.ctx = ctx or zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
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
        self._running = True
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
        self.admit(len(prompt_ids), params)
        self._post(lambda: self.route(prompt_ids, params, RequestId(request_id), tenant, on_output))

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.cancel(RequestId(request_id)))

    def debug_kv(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every registered worker's KV page map (kvfence/dashboard), each taken between that worker's engine
        steps; waits up to `timeout` s. Returns (maps, one line per worker that did not answer in time)."""
        answers, late = self.ask("debug_kv", timeout)
        maps = [{**msg["snapshot"], "address": w.data_addr, "pid": w.pid} for w, msg in answers]
        return sorted(maps, key=lambda m: (m["role"] != "prefill", m["name"])), late

    def audit(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every worker's integrity audit (pool, engine and transfer invariants; free pages), taken between
        its engine steps. Returns (one dict per worker with role/pid/ok/error/num_pages/num_free, late)."""
        answers, late = self.ask("check", timeout)
        return [{**msg, "role": w.role, "pid": w.pid} for w, msg in answers], late

    def arm(self, identity: bytes, spec: str) -> None:
        """Arm fault knobs on one worker (debug/test only; the worker obeys only with KVFENCE_FAULT_ARMING=1)."""
        self._post(lambda: self._send(identity, "arm", spec=spec))

    def ask(self, op: str, timeout: float) -> tuple[list[tuple[WorkerInfo, dict[str, Any]]], list[str]]:
        """Send `op` to every registered worker and wait up to `timeout` s for their answers."""
        nonce, poll = next(self._nonces), _Poll()
        self._post(lambda: self._ask(op, nonce, poll))
        poll.done.wait(timeout)
        self._post(lambda: self._forget(nonce))
        with poll.lock:
            workers = dict(self.workers)
            answers = [(workers[i], msg) for i, msg in poll.answers.items() if i in workers]
            late = [f"{name} did not answer within {timeout:g} s" for i, name in poll.waiting.items()
                    if i not in poll.answers]  # fmt: skip
        return answers, late

    def shutdown(self) -> None:
        def stop() -> None:
            for identity in self.workers:
                self._send(identity, "shutdown")
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

    def _send(self, identity: bytes, op: str, **body: Any) -> None:
        self.socket.send_multipart([identity, control.pack(op, **body)])

    def _workers_changed(self) -> None:
        with self._registered:
            self._registered.notify_all()

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
                    self.on_message(identity, control.unpack(frame))
            self.reap_dead_workers()
            self._ping_workers()

    def on_message(self, identity: bytes, msg: dict[str, Any]) -> None:
        poll = self._polls.get(msg.get("nonce") or 0) if msg["op"] in ("debug_kv", "checked") else None
        if poll is None:
            super().on_message(identity, msg)
            return
        with poll.lock:
            poll.answers[identity] = msg
            if poll.waiting.keys() <= poll.answers.keys():
                poll.done.set()

    def _forget(self, nonce: int) -> None:
        self._polls.pop(nonce, None)

    def _ask(self, op: str, nonce: int, poll: _Poll) -> None:
        with poll.lock:
            poll.waiting = {i: f"{w.role} worker {w.pid}" for i, w in self.workers.items()}
        if not poll.waiting:
            poll.done.set()
            return
        self._polls[nonce] = poll
        for identity in poll.waiting:
            self._send(identity, op, nonce=nonce)

    def _ping_workers(self) -> None:
        """Workers exit when their router goes silent, so a router killed with -9 leaves no orphans behind."""
        now = time.monotonic()
        if now - self._last_ping < self.dead_after_s / 3:
            return
        self._last_ping = now
        for identity in self.workers:
            self._send(identity, "ping")
