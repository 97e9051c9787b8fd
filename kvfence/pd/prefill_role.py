"""The prefill side of a PD worker, without sockets (kvfence/pd/roles.py has the lifecycle of both roles).

One `_Prefill` per request, from its admission or its ticket (whichever comes first) to the release of its
pages; its transfer id outlives it as a tombstone when it ends before its transfer did, so a late ticket is
refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvfence.config import PDOptions
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import LogprobEntry, RequestOutput
from kvfence.engine.request import Request, SamplingParams
from kvfence.ids import RequestId
from kvfence.kv.integrity import Violation
from kvfence.pd import control
from kvfence.pd.control import ControlMessage
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import Abort, FrameAck, Message, PageFrame, Ticket, TransferId
from kvfence.pd.roles import Clock, Role, Routed, Transport
from kvfence.pd.sender import Action, ReleaseLocal, SendAbort, SendFinal, SendFrames, TransferSender

log = logging.getLogger("kvfence.pd.worker")
MAX_EARLY_TICKETS = 1024  # tickets held for requests the router has not yet sent here, all together
TOMBSTONES = 4096  # aborted request ids a prefill remembers, so a late ticket for one is refused


def _flip(payload: bytes) -> bytes:
    """The corrupt_frame knob: one bit flipped in every byte of the frame (exponents included), so the damage
    always changes a model's output, as a garbled frame would."""
    return bytes(x ^ 0x40 for x in payload)


@dataclass
class _Outgoing:
    peer: Any  # where the ticket came from: the decode side of this transfer
    ticket: Ticket
    since: float  # when the ticket came, then the sender's last progress (start or ack): the timeouts
    request: Request | None = None  # set once the prefill is done
    sender: TransferSender | None = None


@dataclass
class _Prefill:
    """One request's prefill-side state. Each part is None until its stage begins and again once it ends; the
    entry goes when every part is None."""

    transfer_id: TransferId | None = (
        None  # the router's, from admission to release (a tombstone if cut short)
    )
    first_logprobs: LogprobEntry | None = None  # the first token's, until the sender takes it (final frame)
    prefilled: Request | None = None  # handed off by the engine, the sender not started (no ticket yet)
    prefilled_at: float = 0.0  # when: a ticket that does not come within transfer_timeout_s ends it
    out: _Outgoing | None = None  # decode's ticket, from its arrival to release
    # I10: the decode worker the router named (set at admission; "" in a cluster without keys). Tickets that
    # come before admission wait in `unverified` until it is known.
    decode_principal: str | None = None
    unverified: list[_Outgoing] = field(default_factory=list)

    def empty(self) -> bool:
        return (
            self.transfer_id is None
            and self.first_logprobs is None
            and self.prefilled is None
            and self.out is None
            and not self.unverified
        )


class PrefillRole(Role):
    name = "prefill"

    def __init__(
        self, engine: LLMEngine, transport: Transport, options: PDOptions, clock: Clock = time.monotonic
    ) -> None:
        super().__init__(engine, transport, clock)
        self.window = options.transfer_window
        self.transfer_timeout_s = (
            options.transfer_timeout
        )  # no progress (ack) for this long: the transfer ends
        self.prefill_timeout_s = options.prefill_timeout  # a ticket whose prefill is not done after this long
        self.requests: dict[RequestId, _Prefill] = {}
        self.tombstones: OrderedDict[TransferId, None] = OrderedDict()  # aborted: a late ticket is refused
        engine.scheduler.reserved_pages = self._awaiting_transfer

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        return {**super().control_handlers(), control.Prefill: self.on_prefill}

    def pending(self) -> list[Any]:
        """Requests with a ticket or a finished prefill: a transfer to run, or to time out."""
        return [rid for rid, s in self.requests.items() if s.out is not None or s.prefilled is not None]

    def _awaiting_transfer(self) -> dict[str, int]:
        """Pages each tenant's prefilled requests hold until their transfer ends (the scheduler counts them as
        held: fairness, caps)."""
        held: dict[str, int] = {}
        for state in self.requests.values():
            request = state.prefilled or (state.out.request if state.out is not None else None)
            if request is not None:
                held[request.tenant] = held.get(request.tenant, 0) + len(request.pages)
        return held

    def _state(self, rid: RequestId) -> _Prefill:
        return self.requests.setdefault(rid, _Prefill())

    def _prune(self, rid: RequestId) -> None:
        state = self.requests.get(rid)
        if state is not None and state.empty():
            del self.requests[rid]

    def on_prefill(self, msg: control.Prefill) -> None:
        if self.admit(msg) is None:
            return
        state = self._state(msg.request_id)
        state.transfer_id, state.decode_principal = msg.transfer_id, msg.decode_principal
        waiting, state.unverified = state.unverified, []
        for o in waiting:  # tickets that came first: the one from the named decode worker goes ahead
            if state.out is None and self._ticket_allowed(state, o.peer, o.ticket):
                state.out = o
        if state.out is not None:
            self._try_start(msg.request_id)

    def _ticket_allowed(self, state: _Prefill, peer: Any, ticket: Ticket) -> bool:
        """I10: a transfer's pages go only to the decode worker the router named for it, as the transport
        authenticated it, and only for the transfer the router gave this request."""
        if ticket.transfer_id != state.transfer_id:
            reason = "wrong_transfer"
        elif state.decode_principal and self.transport.principal(peer) != state.decode_principal:
            reason = "not_the_named_decode_worker"
        else:
            return True
        if self.engine.faults.fire("unbound_tickets"):
            return True
        self.refused[reason] += 1
        log.warning("refused a ticket for request %s: %s", ticket.request_id, reason)
        return False

    def admit_request(self, msg: Routed, params: SamplingParams) -> Request:
        return self.engine.add_request(
            list(msg.prompt_ids), params, request_id=msg.request_id, tenant=msg.tenant, prefill_only=True
        )

    def on_message(self, peer: Any, message: Message) -> None:
        if isinstance(message, Ticket):
            self._on_ticket(peer, message)
            return
        # by (decode peer, transfer id): transfer ids from a faulty router can collide
        for rid, state in self.requests.items():
            o = state.out
            if o is None or o.ticket.transfer_id != message.transfer_id or o.peer != peer:
                continue
            if o.sender is not None and isinstance(message, FrameAck):
                o.since = self.clock()
                self._act(rid, o.sender.on_ack(message))
            elif o.sender is not None and isinstance(message, Abort):
                self._act(rid, o.sender.on_abort(message))
            elif isinstance(message, Abort):  # decode gave up while we still compute (finding 1)
                state.out = None
                self._forget(rid)
            return

    def _on_ticket(self, peer: Any, ticket: Ticket) -> None:
        rid = ticket.request_id
        state = self.requests.get(rid)
        if ticket.transfer_id in self.tombstones:  # aborted before its ticket came: tell decode to let go
            self.transport.send_data(peer, Abort(ticket.transfer_id, "aborted"))
        elif state is not None and state.out is not None:  # a duplicate never replaces a running sender
            log.warning("ignored a second ticket for request %s (transfer %s)", rid, ticket.transfer_id)
        elif state is None or state.decode_principal is None:  # before admission: checked once it comes
            if sum(len(s.unverified) for s in self.requests.values()) >= MAX_EARLY_TICKETS:
                self.refused["too_many_early_tickets"] += 1  # a peer's flood of tickets for unknown requests
                return
            self._state(rid).unverified.append(_Outgoing(peer, ticket, self.clock()))
        elif self._ticket_allowed(state, peer, ticket):
            state.out = _Outgoing(peer, ticket, self.clock())
            self._try_start(rid)

    def _forget(self, rid: RequestId) -> None:
        """The request's transfer will never happen: release its pages (or stop its prefill); tombstone it."""
        state = self.requests.get(rid)
        if state is not None and state.prefilled is not None:
            state.prefilled = None
            self.engine.finish_transfer(rid)
        else:
            self.engine.abort(rid)  # still prefilling: the abort lands before its next step, so no hand-off
        self._tombstone(rid)

    def _tombstone(self, rid: RequestId) -> None:
        state = self.requests.get(rid)
        if state is None:
            return
        tid, state.transfer_id, state.first_logprobs = state.transfer_id, None, None
        state.unverified = []
        self._prune(rid)
        if tid is None:
            return
        self.tombstones[tid] = None
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def after_step(self) -> None:
        for request in self.engine.take_handoffs():
            state = self._state(request.request_id)
            state.prefilled, state.prefilled_at = request, self.clock()
            self._try_start(request.request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.logprobs and not out.finished:  # the first token's, for the final frame
                self._state(out.request_id).first_logprobs = out.logprobs[-1]
            if not out.finished and out.new_token_ids:
                # the first token: the client sees it now, not after the transfer (the router dedupes)
                self.transport.send_control(control.Output(out))
            if out.finished and out.error_code is not None:  # failed in prefill: tell the client and decode
                self.send_error(out.request_id, out.error_code, "prefill failed", 500)
                state = self.requests.get(out.request_id)
                o = state.out if state is not None else None
                if state is not None and o is not None:
                    state.out = None
                    self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, out.error_code))
                self._tombstone(out.request_id)  # its ticket may still be on the way

    def on_abort(self, request_id: RequestId) -> None:
        state = self.requests.get(request_id)
        o = state.out if state is not None else None
        if o is not None and o.sender is not None:
            self._act(request_id, o.sender.fail("aborted"))
            return
        if state is not None and o is not None:  # ticket here, prefill not done
            state.out = None
            self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, "aborted"))
        self._forget(request_id)

    def on_tick(self) -> None:
        """Liveness (finding 1 of docs/verification.md): a transfer without progress for `transfer_timeout_s`, a
        prefilled request whose ticket does not come as long, or a ticket whose prefill is not done after
        `prefill_timeout_s`, ends here. Safe: frames are copies, so once the sender stops nothing reads our
        pages."""
        now = self.clock()
        deadline = now - self.transfer_timeout_s
        outgoing = [(rid, s, s.out) for rid, s in self.requests.items() if s.out is not None]
        for rid, state, o in outgoing:
            if o.since >= (deadline if o.sender is not None else now - self.prefill_timeout_s):
                continue
            log.warning("transfer %s for request %s timed out on prefill", o.ticket.transfer_id, rid)
            if o.sender is not None:
                self._act(rid, o.sender.fail("timeout"))
            else:  # a ticket, but the prefill never finished (decode has given up by now as well)
                state.out = None
                self.transport.send_data(o.peer, Abort(o.ticket.transfer_id, "timeout"))
                self._forget(rid)
        for rid, state in list(self.requests.items()):  # tickets for a request never admitted here
            if state.unverified and state.decode_principal is None:
                state.unverified = [o for o in state.unverified if o.since >= deadline]
                self._prune(rid)
        waiting = [
            rid for rid, s in self.requests.items() if s.prefilled is not None and s.prefilled_at < deadline
        ]
        for rid in waiting:
            log.warning("request %s: no ticket from decode after %.0f s", rid, self.transfer_timeout_s)
            self._forget(rid)

    def _try_start(self, rid: RequestId) -> None:
        state = self.requests.get(rid)
        o = state.out if state is not None else None
        if state is None or o is None or state.prefilled is None or o.sender is not None:
            return
        o.request, state.prefilled = state.prefilled, None
        first = o.request.token_ids[-1]
        num_local = 1 if self.engine.faults.fire("placeholder_prefill") else len(o.request.pages)
        layout = layout_fingerprint(self.engine)
        lp, state.first_logprobs = state.first_logprobs, None
        o.sender = TransferSender(
            o.ticket, num_local, layout, self.window, first, lp, checks=self.engine.integrity_checks
        )
        o.since = self.clock()
        self._act(rid, o.sender.start())

    def _act(self, rid: RequestId, actions: list[Action]) -> None:
        state = self.requests[rid]
        o = state.out
        assert o is not None and o.sender is not None and o.request is not None
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
                state.out, state.transfer_id = None, None
                self._prune(rid)

    def die(self) -> None:
        """The die_mid_transfer fault: the process ends at once (the simulator overrides this)."""
        os._exit(1)
