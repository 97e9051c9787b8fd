"""Prefill and decode worker processes: an engine, the transfer state machines, and ZeroMQ sockets.

Boundary: moves bytes between sockets and the sans-IO protocol cores (kvfence/pd/sender.py, receiver.py); all
protocol decisions are made there. Each worker is one thread: it polls its sockets, applies what arrives, and
steps its engine. That single thread is what makes the receiver's frame validation, KV write and revocation
atomic with respect to each other (I4), and keeps the engine on one thread as it requires.

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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvfence.dashboard.snapshot import KvMapper
from kvfence.engine.errors import AdmissionError
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request
from kvfence.ids import RequestId
from kvfence.kv.integrity import Violation
from kvfence.kv.pool import PoolExhausted
from kvfence.pd import control, wire
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, FrameAck, Message, PageFrame, Ticket, TransferId
from kvfence.pd.receiver import Failed, Ready, TransferReceiver, failure_code
from kvfence.pd.sender import Action, ReleaseLocal, SendAbort, SendFinal, SendFrames, TransferSender
from kvfence.server.preflight import PreflightReport

log = logging.getLogger("kvfence.pd.worker")
IDLE_POLL_MS = 50
HEARTBEAT_S = 0.5  # the router declares a worker dead after several missed heartbeats
ROUTER_SILENCE_S = 15.0  # a registered worker whose router has said nothing for this long exits
TOMBSTONES = 4096  # aborted request ids a prefill worker remembers, so a late ticket for one is refused


def fingerprint(engine: LLMEngine) -> dict[str, Any]:
    """What the router compares across workers (I6): model identity, KV layout, limits."""
    return {
        "layout": layout_fingerprint(engine),
        "vocab_size": engine.model_config.vocab_size,
        "context_length": engine.context_length,
        "pool_pages": engine.pool.num_pages,
        "page_size": engine.pool.page_size,
    }


def _flip(payload: bytes) -> bytes:
    return bytes([payload[0] ^ 0x01]) + payload[1:]


class Worker:
    role = "worker"
    preflight: PreflightReport | None = None  # this worker's I6 verdict, set by its launcher (the page map)
    _kv_map: KvMapper | None = None

    def __init__(self, engine: LLMEngine, router_addr: str, ctx: zmq.Context[Any] | None = None) -> None:
        self.engine = engine
        self.ctx = ctx or zmq.Context.instance()
        self.identity = uuid.uuid4().bytes
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.IDENTITY, self.identity)
        self.control.connect(router_addr)
        self.router_addr = router_addr
        self._pool_free = engine.pool.num_free  # refreshed between steps, read by the heartbeat thread
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.data_addr = ""
        self.running = True
        self.registered = False
        self.last_router_msg = time.monotonic()

    def serve(self) -> None:
        self.send_control(
            "register", role=self.role, fingerprint=fingerprint(self.engine), data_addr=self.data_addr,
            pid=os.getpid(),
        )  # fmt: skip
        self.last_router_msg = time.monotonic()
        beat = threading.Thread(target=self._heartbeats, name="kvfence-heartbeat", daemon=True)
        beat.start()
        while self.running:
            busy = self.engine.has_unfinished()
            for sock, _ in self.poller.poll(0 if busy else IDLE_POLL_MS):
                self._drain(sock)  # before the silence check: pings queued during a long step count
            if self.registered and time.monotonic() - self.last_router_msg > ROUTER_SILENCE_S:
                log.error(
                    "%s worker: the router has been silent for %.0f s; exiting", self.role, ROUTER_SILENCE_S
                )
                break
            if self.engine.has_unfinished():
                self.on_outputs(self.engine.step())
                self.after_step()
            self.on_tick()
            self._pool_free = self.engine.pool.num_free
        self.running = False
        beat.join()
        self.close()

    def _heartbeats(self) -> None:
        """Its own thread and socket, so a long forward step (a 2,000-token prefill) never looks like death."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_addr)
        stop = threading.Event()
        while self.running and not stop.wait(HEARTBEAT_S):
            beat = {"worker": self.identity.hex(), "pool_free": self._pool_free}
            sock.send(control.pack("heartbeat", **beat))
        sock.close(0)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while self.running:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.control:
                self.last_router_msg = time.monotonic()
                self.on_control(control.unpack(frames[0]))
            else:
                self.on_data(sock, frames)

    def on_control(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "refused":
            log.error("router refused %s worker: %s", self.role, msg.get("reason"))
            self.running = False
        elif op == "shutdown":
            self.running = False
        elif op == "abort":
            self.on_abort(RequestId(msg["request_id"]))
        elif op == "registered":
            self.registered = True
        elif op == "reregister":  # the router dropped us (missed heartbeats, or it restarted): join again
            self.send_control(
                "register", role=self.role, fingerprint=fingerprint(self.engine), data_addr=self.data_addr,
                pid=os.getpid(),
            )  # fmt: skip
        elif op == "debug_kv":  # the router's page map: taken here, between two engine steps
            self.send_control("debug_kv", nonce=msg.get("nonce"), snapshot=self.kv_map().snapshot())
        elif op != "ping":
            self.on_request(msg)

    def kv_map(self) -> KvMapper:
        if self._kv_map is None:
            name = f"{self.role} worker {os.getpid()}"
            self._kv_map = KvMapper(self.engine, name, self.role, self.preflight, self.kv_receiver())
        return self._kv_map

    def kv_receiver(self) -> TransferReceiver | None:
        return None

    def send_control(self, op: str, **body: Any) -> None:
        self.control.send(control.pack(op, **body))

    def send_error(self, request_id: str, code: str, message: str, status: int) -> None:
        self.send_control("error", request_id=request_id, code=code, message=message, status=status)

    def admit(self, msg: dict[str, Any], **kw: Any) -> Request | None:
        """Run the engine's admission (I5) for a routed request; report a refusal to the router."""
        try:
            return self.admit_request(msg, control.params_from_json(msg["params"]), **kw)
        except AdmissionError as exc:
            self.send_error(msg["request_id"], exc.code, str(exc), 400)
        except ValueError as exc:
            self.send_error(msg["request_id"], "invalid_request_error", str(exc), 400)
        return None

    def close(self) -> None:
        self.control.close(0)

    # subclass hooks
    def admit_request(self, msg: dict[str, Any], params: Any, **kw: Any) -> Request:
        raise NotImplementedError

    def on_request(self, msg: dict[str, Any]) -> None: ...
    def on_abort(self, request_id: RequestId) -> None: ...
    def on_data(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...
    def after_step(self) -> None: ...
    def on_tick(self) -> None: ...


@dataclass
class _Outgoing:
    peer: bytes  # the decode worker's identity on our data socket
    ticket: Ticket
    request: Request | None = None  # set once the prefill is done
    sender: TransferSender | None = None
    since: float = field(default_factory=time.monotonic)  # when the sender started (for the prefill timeout)


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(
        self,
        engine: LLMEngine,
        router_addr: str,
        data_addr: str,
        window: int = 8,
        transfer_timeout_s: float = 30.0,
        **kw: Any,
    ) -> None:
        super().__init__(engine, router_addr, **kw)
        self.window = window
        self.transfer_timeout_s = transfer_timeout_s
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        host, _, port = data_addr.rpartition(":")
        if port == "0":  # any free port; tell the router which one
            self.data_addr = f"{host}:{self.data.bind_to_random_port(host)}"
        else:
            self.data.bind(data_addr)
            self.data_addr = data_addr
        self.poller.register(self.data, zmq.POLLIN)
        self.out: dict[RequestId, _Outgoing] = {}  # by request id, from ticket to release
        self.done: dict[RequestId, tuple[Request, float]] = {}  # prefilled, ticket not here yet (since when)
        self.tombstones: OrderedDict[RequestId, None] = OrderedDict()  # aborted: a late ticket is refused
        self.first_logprobs: dict[RequestId, tuple[float, tuple[tuple[int, float], ...]]] = {}

    def on_request(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "prefill":
            self.admit(msg)

    def admit_request(self, msg: dict[str, Any], params: Any, **kw: Any) -> Request:
        return self.engine.add_request(
            msg["prompt_ids"], params, request_id=msg["request_id"], tenant=msg.get("tenant", "anonymous"),
            prefill_only=True,
        )  # fmt: skip

    def on_data(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            message = wire.decode(body)
        except wire.WireError as exc:
            log.warning("dropped malformed data message: %s", exc)
            return
        if isinstance(message, Ticket):
            self._on_ticket(peer, message)
            return
        for rid, o in self.out.items():
            if o.ticket.transfer_id != message.transfer_id:
                continue
            if o.sender is not None and isinstance(message, FrameAck | Abort):
                self._act(
                    rid,
                    o.sender.on_ack(message) if isinstance(message, FrameAck) else o.sender.on_abort(message),
                )
            elif isinstance(
                message, Abort
            ):  # decode gave up while we still compute: stop, remember (finding 1)
                del self.out[rid]
                self._forget(rid)
            return

    def _on_ticket(self, peer: bytes, ticket: Ticket) -> None:
        rid = ticket.request_id
        if rid in self.tombstones:  # the request was aborted before its ticket came: tell decode to let go
            self._send(peer, Abort(ticket.transfer_id, "aborted"))
        elif rid in self.out:  # a duplicate ticket never replaces a running sender
            log.warning("ignored a second ticket for request %s (transfer %s)", rid, ticket.transfer_id)
        else:
            self.out[rid] = _Outgoing(peer, ticket)
            self._try_start(rid)

    def _forget(self, rid: RequestId) -> None:
        """The request's transfer will never happen: release its pages (or stop its prefill) and tombstone it."""
        done = self.done.pop(rid, None)
        if done is not None:
            self.engine.finish_transfer(rid)
        else:
            self.engine.abort(rid)  # still prefilling: the abort lands before its next step, so no hand-off
        self.first_logprobs.pop(rid, None)
        self.tombstones[rid] = None
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def after_step(self) -> None:
        for request in self.engine.take_handoffs():
            self.done[request.request_id] = (request, time.monotonic())
            self._try_start(request.request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.logprobs and not out.finished:  # the first token's, for the final frame
                self.first_logprobs[out.request_id] = out.logprobs[-1]
            if out.finished and out.error_code is not None:  # failed in prefill: tell the client and decode
                self.send_error(out.request_id, out.error_code, "prefill failed", 500)
                o = self.out.pop(out.request_id, None)
                if o is not None:
                    self._send(o.peer, Abort(o.ticket.transfer_id, out.error_code))

    def on_abort(self, request_id: RequestId) -> None:
        o = self.out.pop(request_id, None)
        if o is not None and o.sender is not None:
            self.out[request_id] = o
            self._act(request_id, o.sender.fail("aborted"))
            return
        if o is not None:  # ticket here, prefill not done: decode has been told by the router as well
            self._send(o.peer, Abort(o.ticket.transfer_id, "aborted"))
        self._forget(request_id)

    def on_tick(self) -> None:
        """Liveness (finding 1): a transfer that does not finish in time, or a prefilled request whose ticket
        never comes, ends here. Safe: frames are copies, so once the sender stops nothing reads our pages."""
        deadline = time.monotonic() - self.transfer_timeout_s
        for rid, o in list(self.out.items()):
            if o.sender is not None and o.since < deadline:
                log.warning("transfer %s for request %s timed out on prefill", o.ticket.transfer_id, rid)
                self._act(rid, o.sender.fail("timeout"))
        for rid, (_, since) in list(self.done.items()):
            if since < deadline:
                log.warning("request %s: no ticket from decode after %.0f s", rid, self.transfer_timeout_s)
                self._forget(rid)

    def _try_start(self, rid: RequestId) -> None:
        o = self.out.get(rid)
        if o is None or rid not in self.done or o.sender is not None:
            return
        o.request = self.done.pop(rid)[0]
        first = o.request.token_ids[-1]
        num_local = 1 if self.engine.faults.fire("placeholder_prefill") else len(o.request.pages)
        layout = layout_fingerprint(self.engine)
        lp = self.first_logprobs.pop(rid, None)
        o.sender = TransferSender(
            o.ticket, num_local, layout, self.window, first, lp, checks=self.engine.integrity_checks
        )
        o.since = time.monotonic()
        self._act(rid, o.sender.start())

    def _act(self, rid: RequestId, actions: list[Action]) -> None:
        o = self.out[rid]
        assert o.sender is not None and o.request is not None
        for action in actions:
            if isinstance(action, SendFrames):
                payloads = self.engine.read_for_transfer(rid, action.indices)  # I1-checked reads (finding 3)
                if isinstance(payloads, Violation):
                    self._act(
                        rid, o.sender.fail(f"kv_integrity_error: page {payloads.page} ({payloads.kind})")
                    )
                    return
                for i, payload in zip(action.indices, payloads, strict=True):
                    frame = o.sender.frame(i, payload)
                    if self.engine.faults.fire("corrupt_frame"):  # flipped in flight, after the digest
                        frame = PageFrame(frame.transfer_id, i, frame.page_id, frame.lease_id, _flip(payload))
                    self._send(o.peer, frame)
                    if self.engine.faults.fire("die_mid_transfer"):
                        log.error("fault die_mid_transfer: exiting after frame %d of request %s", i, rid)
                        os._exit(1)
            elif isinstance(action, SendFinal | SendAbort):
                self._send(o.peer, action.final if isinstance(action, SendFinal) else action.abort)
            elif isinstance(action, ReleaseLocal):
                self.engine.finish_transfer(rid)  # copying sends: every frame is out of our pages already
                del self.out[rid]

    def _send(self, peer: bytes, message: Message) -> None:
        self.data.send_multipart([peer, *wire.encode(message)], copy=True)

    def close(self) -> None:
        self.data.close(0)
        super().close()


class DecodeWorker(Worker):
    role = "decode"

    def __init__(
        self, engine: LLMEngine, router_addr: str, transfer_timeout_s: float = 30.0, **kw: Any
    ) -> None:
        super().__init__(engine, router_addr, **kw)
        self.receiver = TransferReceiver(
            engine.pool,
            layout_fingerprint(engine),
            engine.runner.cache.page_bytes(),
            engine.runner.cache.write_page,
            checks=engine.integrity_checks,  # --no-integrity-checks turns both layers off (debug only)
            faults=engine.faults,
        )
        self.transfer_timeout_s = transfer_timeout_s
        self.started: dict[TransferId, float] = {}
        self.peers: dict[str, zmq.Socket[Any]] = {}  # prefill data address -> our DEALER to it
        self.incoming: dict[TransferId, tuple[RequestId, zmq.Socket[Any]]] = {}

    def kv_receiver(self) -> TransferReceiver | None:
        return self.receiver

    def on_request(self, msg: dict[str, Any]) -> None:
        if msg["op"] != "expect" or self.admit(msg) is None:
            return
        rid, tid = RequestId(msg["request_id"]), TransferId(msg["transfer_id"])
        sock = self._peer(msg["prefill_addr"])
        try:
            ticket = self.receiver.reserve(tid, rid, self.engine.pool.pages_for(len(msg["prompt_ids"])))
        except PoolExhausted as exc:
            self._fail(rid, "decode_unavailable", str(exc))
            return
        except ValueError as exc:  # a reused transfer id: a metadata collision, never trusted (bug 4)
            self._fail(rid, "kv_integrity_error", str(exc))
            return
        self.incoming[tid] = (rid, sock)
        self.started[tid] = time.monotonic()
        sock.send_multipart(wire.encode(ticket))

    def on_tick(self) -> None:
        """Liveness: a transfer that does not complete in time is revoked (never a bare free, I4) and fails."""
        now = time.monotonic()
        for tid, t0 in list(self.started.items()):
            if now - t0 > self.transfer_timeout_s and tid in self.incoming:
                rid, sock = self.incoming.pop(tid)
                self.receiver.revoke(tid, "timeout")
                sock.send_multipart(wire.encode(Abort(tid, "timeout")))
                self._fail(rid, "transfer_timeout", f"no complete transfer after {self.transfer_timeout_s} s")
            if tid not in self.incoming:
                del self.started[tid]

    def admit_request(self, msg: dict[str, Any], params: Any, **kw: Any) -> Request:
        return self.engine.expect_transfer(
            msg["prompt_ids"], params, msg["request_id"], msg.get("tenant", "anonymous")
        )

    def on_data(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        try:
            message = wire.decode(frames)
        except wire.WireError as exc:
            log.warning("dropped malformed data message: %s", exc)
            return
        if isinstance(message, PageFrame):
            verdict = self.receiver.on_frame(message)  # validate + write + stamp, on this one thread (I4)
            if isinstance(verdict, Failed):  # the write failed: revoked; tell prefill to stop
                sock.send_multipart(wire.encode(Abort(message.transfer_id, "write_failed")))
                self._finish(message.transfer_id, verdict)
            elif verdict.ack is not None:
                sock.send_multipart(wire.encode(verdict.ack))
        elif isinstance(message, FinalFrame):
            self._finish(message.transfer_id, self.receiver.on_final(message))
        elif isinstance(message, Abort):
            self._finish(message.transfer_id, self.receiver.revoke(message.transfer_id, message.reason))
        elif isinstance(message, AbortAck):
            self._finish(message.transfer_id, self.receiver.revoke(message.transfer_id, "prefill_failed"))

    def _finish(self, tid: TransferId, result: object) -> None:
        entry = self.incoming.pop(tid, None)
        if entry is None:
            return
        rid = entry[0]
        if isinstance(result, Ready):
            self.engine.complete_transfer(rid, result.leases, result.first_token, result.first_logprobs)
        elif isinstance(result, Failed):
            self._fail(rid, failure_code(result.reason), result.reason)

    def _fail(self, rid: RequestId, code: str, reason: str) -> None:
        out = self.engine.fail_transfer(rid, code, reason)
        if out is not None:
            self.on_outputs([out])
        log.warning("request %s failed: %s (%s)", rid, code, reason)

    def on_abort(self, request_id: RequestId) -> None:
        for tid, (rid, sock) in list(self.incoming.items()):
            if rid == request_id:  # revoke first: from here on, late frames for it are dropped on arrival
                self.receiver.revoke(tid, "aborted")
                sock.send_multipart(wire.encode(Abort(tid, "aborted")))
                del self.incoming[tid]
                out = self.engine.fail_transfer(rid, "aborted")
                if out is not None:
                    self.on_outputs([out])
                return
        self.engine.abort(request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.send_control("output", **control.output_to_json(out))

    def _peer(self, addr: str) -> zmq.Socket[Any]:
        sock = self.peers.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self.poller.register(sock, zmq.POLLIN)
            self.peers[addr] = sock
        return sock

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
        super().close()
