"""The decode side of a PD worker, without sockets (kvfence/pd/roles.py has the lifecycle of both roles).

A routed request waits in `queued` until the pool can spare its pages, then is reserved and waits in `incoming`
(by transfer id) until its transfer completes, fails, times out or is aborted; it is in at most one of the two.
The `TransferReceiver` owns the reservations themselves. Which queued request is reserved next is the engine's
fairness policy (engine/fairness.py): vtc takes the oldest of the tenant with the smallest virtual token
counter, within its page cap and leaving other tenants' guarantees; fcfs takes them in arrival order.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from kvfence.config import PDOptions
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request, SamplingParams
from kvfence.engine.stats import TenantSnapshot
from kvfence.ids import RequestId
from kvfence.kv.pool import PoolExhausted
from kvfence.pd import control
from kvfence.pd.control import ControlMessage
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, Message, PageFrame, TransferId
from kvfence.pd.receiver import Applied, Failed, Ready, TransferReceiver, failure_code
from kvfence.pd.roles import Clock, Role, Routed, Transport

log = logging.getLogger("kvfence.pd.worker")


@dataclass
class _Incoming:
    request_id: RequestId
    peer: Any  # the prefill we sent the ticket to: the only one whose final frame or abort counts
    tenant: str  # whose pages the reservation holds (fairness: engine/fairness.py)
    num_pages: int
    since: float  # last progress: the reservation, then each applied frame
    started: bool = False  # a frame applied yet: the timeout is transfer_timeout_s from then on


class DecodeRole(Role):
    name = "decode"

    def __init__(
        self, engine: LLMEngine, transport: Transport, options: PDOptions, clock: Clock = time.monotonic
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
        self.transfer_timeout_s = options.transfer_timeout
        self.prefill_timeout_s = options.prefill_timeout
        self.incoming: dict[TransferId, _Incoming] = {}
        # admitted, waiting for pages to reserve (in arrival order; taken in the fairness policy's), with when they
        # came: the decode pool is busy right now
        self.queued: OrderedDict[RequestId, tuple[control.Expect, float]] = OrderedDict()
        engine.scheduler.reserved_pages = self._reserved

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        return {**super().control_handlers(), control.Expect: self.on_expect}

    def receiver(self) -> TransferReceiver | None:
        return self.rx

    def pending(self) -> list[Any]:
        """Transfers under way and requests waiting for pages."""
        return [*self.incoming, *self.queued]

    def on_expect(self, msg: control.Expect) -> None:
        if self.admit(msg) is None:
            return
        holders = self.engine.scheduler.holders()  # queued, reserved, or in the engine
        if msg.tenant not in holders:
            self.engine.scheduler.fairness.activate(msg.tenant, holders)
        self.queued[msg.request_id] = (msg, self.clock())
        self._reserve_queued()

    def tenant_snapshots(self) -> dict[str, TenantSnapshot]:
        """The engine's (a queued tenant is a holder: `_reserved`), with requests queued here for pages counted as
        waiting (reservations are in pages)."""
        tenants = self.engine.tenant_snapshots()
        for msg, _ in self.queued.values():
            tenants[msg.tenant] = replace(tenants[msg.tenant], waiting=tenants[msg.tenant].waiting + 1)
        return tenants

    def _reserved(self) -> dict[str, int]:
        """Pages each tenant's reservations hold (the scheduler counts them as held: fairness, caps), and 0 for a
        tenant queued for one (its guarantee is kept for it)."""
        held: dict[str, int] = {msg.tenant: 0 for msg, _ in self.queued.values()}
        for entry in self.incoming.values():
            held[entry.tenant] = held.get(entry.tenant, 0) + entry.num_pages
        return held

    def _next_queued(self, skip: set[str]) -> RequestId | None:
        """The queued request to reserve next: the oldest (fcfs), or the oldest of the tenant with the smallest
        counter among those not in `skip` (vtc)."""
        fairness = self.engine.scheduler.fairness
        if not fairness.enabled:
            return next(iter(self.queued), None)
        tenants = {msg.tenant for msg, _ in self.queued.values()} - skip
        if not tenants:
            return None
        tenant = fairness.next_tenant(tenants, self.engine.scheduler.running_per_tenant())
        return next(rid for rid, (msg, _) in self.queued.items() if msg.tenant == tenant)

    def _reserve_queued(self) -> None:
        """Reserve pages for queued requests in the fairness policy's order, while the pool can spare them: one
        page of headroom per running request, so that reservations do not starve requests already decoding. A
        tenant at its cap, or one that would take pages other tenants are guaranteed, is passed over."""
        pool, fairness = self.engine.pool, self.engine.scheduler.fairness
        skip: set[str] = set()
        while (rid := self._next_queued(skip)) is not None:
            msg, _ = self.queued[rid]
            num_pages = pool.pages_for(len(msg.prompt_ids))
            if not pool.can_allocate(num_pages + len(self.engine.scheduler.running)):
                return
            if fairness.enabled and not fairness.may_take(
                msg.tenant,
                num_pages,
                pool.num_free,
                self.engine.scheduler.held_pages(),
                self.engine.scheduler.holders(),
            ):
                skip.add(msg.tenant)
                continue
            del self.queued[rid]
            tid = msg.transfer_id
            try:  # first: a prefill this transport cannot reach (a missing key) reserves nothing
                peer = self.transport.connect(msg.prefill_addr, msg.prefill_principal)
            except ValueError as exc:
                self._fail(rid, "worker_unavailable", str(exc))
                continue
            try:
                ticket = self.rx.reserve(tid, rid, num_pages)
            except PoolExhausted as exc:  # not after can_allocate; kept so a surprise fails one request
                self._fail(rid, "decode_unavailable", str(exc))
                continue
            except ValueError as exc:  # a reused transfer id: a metadata collision, never trusted (bug 4)
                self._fail(rid, "kv_integrity_error", str(exc))
                continue
            self.incoming[tid] = _Incoming(rid, peer, msg.tenant, num_pages, self.clock())
            self.transport.send_data(peer, ticket)

    def after_step(self) -> None:
        self._reserve_queued()

    def admit_request(self, msg: Routed, params: SamplingParams) -> Request:
        return self.engine.expect_transfer(list(msg.prompt_ids), params, msg.request_id, msg.tenant)

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
        for tid, entry in list(self.incoming.items()):
            if entry.since < (deadline if entry.started else now - self.prefill_timeout_s):
                del self.incoming[tid]
                self.rx.revoke(tid, "timeout")
                self.transport.send_data(entry.peer, Abort(tid, "timeout"))
                reason = f"no complete transfer after {self.transfer_timeout_s} s"
                self._fail(entry.request_id, "transfer_timeout", reason)

    def on_message(self, peer: Any, message: Message) -> None:
        tid = message.transfer_id
        if isinstance(message, PageFrame):
            entry = self.incoming.get(tid)
            # I10: pages only from the prefill the ticket went to
            if entry is not None and entry.peer != peer:
                self.refused["frame_from_another_prefill"] += 1
                return
            verdict = self.rx.on_frame(message)  # validate + write + stamp, on this one thread (I4)
            if isinstance(verdict, Failed):  # the write failed: revoked; tell prefill to stop
                self.transport.send_data(peer, Abort(tid, "write_failed"))
                self._finish(tid, verdict)
                return
            entry = self.incoming.get(tid)
            if isinstance(verdict, Applied) and entry is not None:
                entry.since, entry.started = self.clock(), True
            if verdict.ack is not None:
                self.transport.send_data(peer, verdict.ack)
            return
        entry = self.incoming.get(tid)
        if entry is None or entry.peer != peer:  # not ours, or not from the prefill we sent the ticket to
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
        rid = entry.request_id
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
        for tid, entry in list(self.incoming.items()):
            if entry.request_id == request_id:  # revoke first: from here on, late frames for it are dropped
                self.rx.revoke(tid, "aborted")
                self.transport.send_data(entry.peer, Abort(tid, "aborted"))
                del self.incoming[tid]
                out = self.engine.fail_transfer(request_id, "aborted")
                if out is not None:
                    self.on_outputs([out])
                return
        self.engine.abort(request_id)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.transport.send_control(control.Output(out))
