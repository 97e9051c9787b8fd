"""What a prefill or decode worker does, without sockets: routed requests, transfers and engine steps in,
control and data messages out through a `Transport`. The ZeroMQ processes (kvfence/pd/worker.py) and the
deterministic simulator (kvfence/sim) drive these same classes.

Each role runs on one thread (its worker's loop, or the simulator's event loop). That is what makes the
receiver's frame validation, KV write and revocation atomic with respect to each other (I4), and keeps the
engine on one thread as it requires.

Prefill: admit (I5) -> prefill to the first token -> hand-off -> a ticket from decode -> TransferSender streams
         I1-checked page reads -> ReleaseLocal. Aborts and timeouts end it at any point; an abort that comes
         before the sender exists is remembered (a tombstone of its transfer id, which the router sends
         with the request), so a late ticket is refused.
Decode:  admit (I5) -> reserve leases, send the ticket -> TransferReceiver validates every frame (I2), count and
         digest (I3) -> the request adopts the pages and decodes. Timeouts and aborts revoke (I4).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvfence.engine.errors import AdmissionError
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request
from kvfence.ids import RequestId
from kvfence.kv.integrity import Violation
from kvfence.kv.pool import PoolExhausted
from kvfence.pd import control
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, FrameAck, Message, PageFrame, Ticket, TransferId
from kvfence.pd.receiver import Applied, Failed, Ready, TransferReceiver, failure_code
from kvfence.pd.sender import Action, ReleaseLocal, SendAbort, SendFinal, SendFrames, TransferSender

log = logging.getLogger("kvfence.pd.worker")
TOMBSTONES = 4096  # aborted request ids a prefill remembers, so a late ticket for one is refused
Clock = Callable[[], float]


class Transport(Protocol):
    """How a role's messages leave it. `peer` values are opaque handles the transport gave out."""

    def send_control(self, op: str, **body: Any) -> None: ...
    def send_data(self, peer: Any, message: Message) -> None: ...
    def connect(self, data_addr: str) -> Any: ...  # decode: the handle for a prefill's data address


def _flip(payload: bytes) -> bytes:
    """The corrupt_frame knob: one bit flipped in every byte of the frame (exponents included), so the damage
    always changes a model's output, as a garbled frame would."""
    return bytes(x ^ 0x40 for x in payload)


class Role:
    name = "worker"

    def __init__(self, engine: LLMEngine, transport: Transport, clock: Clock = time.monotonic) -> None:
        self.engine = engine
        self.transport = transport
        self.clock = clock

    def on_control(self, msg: dict[str, Any]) -> None:
        """A routed request or an abort from the router (registration and liveness are the transport's)."""
        if msg["op"] == "abort":
            self.on_abort(RequestId(msg["request_id"]))
        else:
            self.on_request(msg)

    def step(self) -> bool:
        """One engine step, if there is work, and what follows from it. Returns whether another step could run
        a forward now (the worker polls its sockets without waiting while it could)."""
        if self.engine.has_unfinished():
            self.on_outputs(self.engine.step())
            self.after_step()
        return self.engine.has_steppable()

    def send_error(self, request_id: str, code: str, message: str, status: int) -> None:
        self.transport.send_control("error", request_id=request_id, code=code, message=message, status=status)

    def admit(self, msg: dict[str, Any]) -> Request | None:
        """Run the engine's admission (I5) for a routed request; report a refusal to the router."""
        try:
            return self.admit_request(msg, control.params_from_json(msg["params"]))
        except AdmissionError as exc:
            self.send_error(msg["request_id"], exc.code, str(exc), 400)
        except ValueError as exc:
            self.send_error(msg["request_id"], "invalid_request_error", str(exc), 400)
        return None

    def receiver(self) -> TransferReceiver | None:
        return None

    def check_integrity(self) -> None:
        """Pool, engine and transfer invariants (AssertionError). Between steps only."""
        rx = self.receiver()
        self.engine.check_integrity(other_holders=rx.reserved_leases() if rx is not None else ())
        if rx is not None:
            rx.check_integrity()

    # hooks
    def admit_request(self, msg: dict[str, Any], params: Any) -> Request:
        raise NotImplementedError

    def on_request(self, msg: dict[str, Any]) -> None: ...
    def on_abort(self, request_id: RequestId) -> None: ...
    def on_message(self, peer: Any, message: Message) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...
    def after_step(self) -> None: ...
    def on_tick(self) -> None: ...


@dataclass
class _Outgoing:
    peer: Any  # where the ticket came from: the decode side of this transfer
    ticket: Ticket
    since: float  # when the ticket came, then the sender's last progress (start or ack): the timeouts
    request: Request | None = None  # set once the prefill is done
    sender: TransferSender | None = None


class PrefillRole(Role):
    name = "prefill"

    def __init__(
        self,
        engine: LLMEngine,
        transport: Transport,
        window: int = 8,
        transfer_timeout_s: float = 30.0,
        clock: Clock = time.monotonic,
        prefill_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(engine, transport, clock)
        self.window = window
        self.transfer_timeout_s = transfer_timeout_s  # no progress (ack) for this long: the transfer is over
        self.prefill_timeout_s = prefill_timeout_s  # a ticket whose prefill is not done after this long
        self.out: dict[RequestId, _Outgoing] = {}  # by request id, from ticket to release
        self.done: dict[RequestId, tuple[Request, float]] = {}  # prefilled, ticket not here yet (since when)
        self.tids: dict[RequestId, TransferId] = {}  # the transfer id the router gave each admitted request
        self.tombstones: OrderedDict[TransferId, None] = OrderedDict()  # aborted: a late ticket is refused
        self.first_logprobs: dict[RequestId, tuple[float, tuple[tuple[int, float], ...]]] = {}

    def on_request(self, msg: dict[str, Any]) -> None:
        if msg["op"] == "prefill" and self.admit(msg) is not None:
            self.tids[RequestId(msg["request_id"])] = TransferId(msg["transfer_id"])

    def admit_request(self, msg: dict[str, Any], params: Any) -> Request:
        return self.engine.add_request(
            msg["prompt_ids"], params, request_id=msg["request_id"], tenant=msg.get("tenant", "anonymous"),
            prefill_only=True,
        )  # fmt: skip

    def on_message(self, peer: Any, message: Message) -> None:
        if isinstance(message, Ticket):
            self._on_ticket(peer, message)
            return
        for rid, o in self.out.items():  # by (decode peer, transfer id): ids from a faulty router can collide
            if o.ticket.transfer_id != message.transfer_id or o.peer != peer:
                continue
            if o.sender is not None and isinstance(message, FrameAck):
                o.since = self.clock()
                self._act(rid, o.sender.on_ack(message))
            elif o.sender is not None and isinstance(message, Abort):
                self._act(rid, o.sender.on_abort(message))
            elif isinstance(message, Abort):  # decode gave up while we still compute (finding 1)
                del self.out[rid]
                self._forget(rid)
            return

    def _on_ticket(self, peer: Any, ticket: Ticket) -> None:
        rid = ticket.request_id
        if ticket.transfer_id in self.tombstones:  # aborted before its ticket came: tell decode to let go
            self.transport.send_data(peer, Abort(ticket.transfer_id, "aborted"))
        elif rid in self.out:  # a duplicate ticket never replaces a running sender
            log.warning("ignored a second ticket for request %s (transfer %s)", rid, ticket.transfer_id)
        else:
            self.out[rid] = _Outgoing(peer, ticket, self.clock())
            self._try_start(rid)

    def _forget(self, rid: RequestId) -> None:
        """The request's transfer will never happen: release its pages (or stop its prefill); tombstone it."""
        done = self.done.pop(rid, None)
        if done is not None:
            self.engine.finish_transfer(rid)
        else:
            self.engine.abort(rid)  # still prefilling: the abort lands before its next step, so no hand-off
        self._tombstone(rid)

    def _tombstone(self, rid: RequestId) -> None:
        self.first_logprobs.pop(rid, None)
        tid = self.tids.pop(rid, None)
        if tid is None:
            return
        self.tombstones[tid] = None
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def after_step(self) -> None:
        for request in self.engine.take_handoffs():
            self.done[request.request_id] = (request, self.clock())
            self._try_start(request.request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.logprobs and not out.finished:  # the first token's, for the final frame
                self.first_logprobs[out.request_id] = out.logprobs[-1]
            if not out.finished and out.new_token_ids:
                # the first token: the client sees it now, not after the transfer (the router dedupes)
                self.transport.send_control("output", **control.output_to_json(out))
            if out.finished and out.error_code is not None:  # failed in prefill: tell the client and decode
                self.send_error(out.request_id, out.error_code, "prefill failed", 500)
                o = self.out.pop(out.request_id, None)
                if o is not None:
                    self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, out.error_code))
                self._tombstone(out.request_id)  # its ticket may still be on the way

    def on_abort(self, request_id: RequestId) -> None:
        o = self.out.get(request_id)
        if o is not None and o.sender is not None:
            self._act(request_id, o.sender.fail("aborted"))
            return
        if o is not None:  # ticket here, prefill not done
            del self.out[request_id]
            self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, "aborted"))
        self._forget(request_id)

    def on_tick(self) -> None:
        """Liveness (finding 1 of docs/verification.md): a transfer without progress for `transfer_timeout_s`, a
        prefilled request whose ticket does not come as long, or a ticket whose prefill is not done after
        `prefill_timeout_s`, ends here. Safe: frames are copies, so once the sender stops nothing reads our
        pages."""
        now = self.clock()
        deadline = now - self.transfer_timeout_s
        for rid, o in list(self.out.items()):
            if o.since >= (deadline if o.sender is not None else now - self.prefill_timeout_s):
                continue
            log.warning("transfer %s for request %s timed out on prefill", o.ticket.transfer_id, rid)
            if o.sender is not None:
                self._act(rid, o.sender.fail("timeout"))
            else:  # a ticket, but the prefill never finished (decode has given up by now as well)
                del self.out[rid]
                self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, "timeout"))
                self._forget(rid)
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
        o.since = self.clock()
        self._act(rid, o.sender.start())

    def _act(self, rid: RequestId, actions: list[Action]) -> None:
        o = self.out[rid]
        assert o.sender is not None and o.request is not None
        for action in actions:
            if isinstance(action, SendFrames):
                payloads = self.engine.read_for_transfer(rid, action.indices)  # I1-checked (finding 3)
                if isinstance(payloads, Violation):
                    reason = f"kv_integrity_error: page {payloads.page} ({payloads.kind})"
                    self._act(rid, o.sender.fail(reason))
                    return
                for i, payload in zip(action.indices, payloads, strict=True):
                    frame = o.sender.frame(i, payload)
                    if self.engine.faults.fire("corrupt_frame"):  # flipped in flight, after the digest
                        frame = PageFrame(frame.transfer_id, i, frame.page_id, frame.lease_id, _flip(payload))
                    self.transport.send_data(o.peer, frame)
                    if self.engine.faults.fire("die_mid_transfer"):
                        log.error("fault die_mid_transfer: exiting after frame %d of request %s", i, rid)
                        self.die()
            elif isinstance(action, SendFinal | SendAbort):
                message = action.final if isinstance(action, SendFinal) else action.abort
                self.transport.send_data(o.peer, message)
            elif isinstance(action, ReleaseLocal):
                self.engine.finish_transfer(rid)  # copying sends: every frame is out of our pages already
                del self.out[rid]
                self.tids.pop(rid, None)

    def die(self) -> None:
        """The die_mid_transfer fault: the process ends at once (the simulator overrides this)."""
        os._exit(1)


class DecodeRole(Role):
    name = "decode"

    def __init__(
        self,
        engine: LLMEngine,
        transport: Transport,
        transfer_timeout_s: float = 30.0,
        clock: Clock = time.monotonic,
        prefill_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(engine, transport, clock)
        cache = engine.runner.cache
        self.rx = TransferReceiver(
            engine.pool,
            layout_fingerprint(engine),
            cache.page_bytes(),
            cache.write_page,
            checks=engine.integrity_checks,  # --no-integrity-checks turns both layers off (debug only)
            faults=engine.faults,
        )
        # Timeouts: until the first frame the prefill is computing (`prefill_timeout_s`: a 2,000-token prompt on
        # a busy CPU takes tens of seconds); after it, `transfer_timeout_s` without a frame ends the transfer.
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        # request, prefill peer, last progress (the reservation, then each applied frame), frames applied yet
        self.incoming: dict[TransferId, tuple[RequestId, Any, float, bool]] = {}
        # admitted, waiting for pages to reserve (FIFO), with when they came: the decode pool is busy right now
        self.queued: OrderedDict[RequestId, tuple[dict[str, Any], float]] = OrderedDict()

    def receiver(self) -> TransferReceiver | None:
        return self.rx

    def on_request(self, msg: dict[str, Any]) -> None:
        if msg["op"] != "expect" or self.admit(msg) is None:
            return
        self.queued[RequestId(msg["request_id"])] = (msg, self.clock())
        self._reserve_queued()

    def _reserve_queued(self) -> None:
        """Reserve pages for queued requests in arrival order, while the pool can spare them: one page of
        headroom per running request, so that reservations do not starve requests already decoding."""
        pool = self.engine.pool
        while self.queued:
            rid, (msg, _) = next(iter(self.queued.items()))
            num_pages = pool.pages_for(len(msg["prompt_ids"]))
            if not pool.can_allocate(num_pages + len(self.engine.scheduler.running)):
                return
            del self.queued[rid]
            tid = TransferId(msg["transfer_id"])
            try:
                ticket = self.rx.reserve(tid, rid, num_pages)
            except PoolExhausted as exc:  # not after can_allocate; kept so a surprise fails one request
                self._fail(rid, "decode_unavailable", str(exc))
                continue
            except ValueError as exc:  # a reused transfer id: a metadata collision, never trusted (bug 4)
                self._fail(rid, "kv_integrity_error", str(exc))
                continue
            peer = self.transport.connect(msg["prefill_addr"])
            self.incoming[tid] = (rid, peer, self.clock(), False)
            self.transport.send_data(peer, ticket)

    def after_step(self) -> None:
        self._reserve_queued()

    def admit_request(self, msg: dict[str, Any], params: Any) -> Request:
        return self.engine.expect_transfer(
            msg["prompt_ids"], params, msg["request_id"], msg.get("tenant", "anonymous")
        )

    def on_tick(self) -> None:
        """Liveness: a transfer that does not complete in time is revoked (never a bare free, I4) and fails; a
        request that waited as long for decode pages fails too (by then prefill has let go of it as well)."""
        now = self.clock()
        deadline = now - self.transfer_timeout_s
        for rid, (_, since) in list(self.queued.items()):
            if since < deadline:
                del self.queued[rid]
                self._fail(rid, "decode_unavailable", f"no decode pages for {self.transfer_timeout_s} s")
        self._reserve_queued()  # aborts and failures free pages between steps too
        for tid, (rid, peer, since, started) in list(self.incoming.items()):
            if since < (deadline if started else now - self.prefill_timeout_s):
                del self.incoming[tid]
                self.rx.revoke(tid, "timeout")
                self.transport.send_data(peer, Abort(tid, "timeout"))
                self._fail(rid, "transfer_timeout", f"no complete transfer after {self.transfer_timeout_s} s")

    def on_message(self, peer: Any, message: Message) -> None:
        tid = message.transfer_id
        if isinstance(message, PageFrame):
            verdict = self.rx.on_frame(message)  # validate + write + stamp, on this one thread (I4)
            if isinstance(verdict, Failed):  # the write failed: revoked; tell prefill to stop
                self.transport.send_data(peer, Abort(tid, "write_failed"))
                self._finish(tid, verdict)
                return
            if isinstance(verdict, Applied) and tid in self.incoming:
                self.incoming[tid] = (*self.incoming[tid][:2], self.clock(), True)
            if verdict.ack is not None:
                self.transport.send_data(peer, verdict.ack)
            return
        entry = self.incoming.get(tid)
        if entry is None or entry[1] != peer:  # not ours, or not from the prefill we sent the ticket to
            return
        if isinstance(message, FinalFrame):
            self._finish(tid, self.rx.on_final(message))
        elif isinstance(message, Abort):
            self._finish(tid, self.rx.revoke(tid, message.reason))
        elif isinstance(message, AbortAck):
            self._finish(tid, self.rx.revoke(tid, "prefill_failed"))

    def _finish(self, tid: TransferId, result: Ready | Failed | object) -> None:
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
        if self.queued.pop(request_id, None) is not None:
            out = self.engine.fail_transfer(request_id, "aborted")
            if out is not None:
                self.on_outputs([out])
            return
        for tid, (rid, peer, *_) in list(self.incoming.items()):
            if rid == request_id:  # revoke first: from here on, late frames for it are dropped on arrival
                self.rx.revoke(tid, "aborted")
                self.transport.send_data(peer, Abort(tid, "aborted"))
                del self.incoming[tid]
                out = self.engine.fail_transfer(rid, "aborted")
                if out is not None:
                    self.on_outputs([out])
                return
        self.engine.abort(request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.transport.send_control("output", **control.output_to_json(out))
