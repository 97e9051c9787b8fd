"""Decode side of the KV transfer: reservations, frame validation (I2), completeness and digest (I3),
revocation (I4). Sans-IO: events in, verdicts out; the caller moves bytes, the receiver's `write_page` callback
(local memory, never the network) writes KV.

Atomicity: `on_frame` validates a frame, writes its payload through `write_page`, and only then records the
page as written and stamps its tag, all in one call; the caller runs `on_frame`, `on_final` and `revoke` on one
thread (or under one lock). Revocation therefore happens strictly before or strictly after a frame's
validate-write-stamp, so once `revoke` returns no frame for the transfer can land, and its pages can go back to
the pool at once (through quarantine). A write that raises revokes the transfer: a page is never marked
written with bytes that did not arrive.

Reservation lifecycle:  reserve -> RESERVED --all frames + final with matching count and digest--> handed over
                                       |--revoke / bad final / abort / failed write--> revoked (pages released)

Ended transfer ids are remembered (late messages for them are dropped by name) in a bounded table; ids are
issued by a router in increasing order per router prefix (the top 24 bits), so an id at or below the highest id
evicted from the table is refused as ended, which keeps memory bounded without ever accepting a reused id.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfence import trace
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId
from kvfence.kv.pool import Lease, PagePool
from kvfence.pd.digest import page_digest, transfer_digest
from kvfence.pd.messages import FinalFrame, FrameAck, PageFrame, Ticket, TransferId

log = logging.getLogger("kvfence.pd.receiver")
WritePage = Callable[[PageId, bytes], None]
ENDED_MEMORY = 4096  # ended transfer ids remembered by name; older ones are refused by the per-router floor
_PREFIX_SHIFT = 40  # transfer ids: 24-bit router prefix << 40 | counter (kvfence/pd/router.py)
INTEGRITY_REASONS = {
    "page_count_mismatch",
    "layout_mismatch",
    "incomplete",
    "digest_mismatch",
    "kv_integrity_error",
}


def failure_code(reason: str) -> str:
    """What the client sees for a failed transfer: integrity problems are `kv_integrity_error` (I8)."""
    return "kv_integrity_error" if reason.split(":")[0] in INTEGRITY_REASONS else "prefill_failed"


@dataclass(frozen=True, slots=True)
class Applied:
    """The frame was valid and its payload is written and stamped: send `ack`."""

    lease: Lease
    ack: FrameAck


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str  # unknown_transfer | revoked | completed | ended | bad_index | wrong_page | wrong_lease
    # | stale_lease | duplicate | bad_size
    ack: FrameAck | None = None  # a duplicate of an applied frame is acknowledged again, never re-applied


@dataclass(frozen=True, slots=True)
class Ready:
    """Every reserved page was written exactly once and the digest matched: the request may decode."""

    request_id: RequestId
    leases: tuple[Lease, ...]
    first_token: int
    first_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    request_id: RequestId
    reason: str


@dataclass(slots=True)
class _Reservation:
    request_id: RequestId
    leases: list[Lease]
    digests: list[bytes | None]

    @property
    def num_written(self) -> int:
        return sum(d is not None for d in self.digests)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A transfer still being received: pages reserved for it and how many frames landed (the KV page map)."""

    transfer_id: TransferId
    request_id: RequestId
    leases: tuple[Lease, ...]
    num_written: int


@dataclass
class ReceiverStats:
    applied: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)

    def count(self, table: dict[str, int], reason: str) -> None:
        table[reason] = table.get(reason, 0) + 1


class TransferReceiver:
    def __init__(
        self,
        pool: PagePool,
        layout: str,
        page_bytes: int,
        write_page: WritePage,
        checks: bool = True,
        faults: Faults | None = None,
    ) -> None:
        self.pool = pool
        self.layout = layout
        self.page_bytes = page_bytes
        self.write_page = write_page
        # Debug/test only: with checks off, frames are not checked against the pool's current lease and a final
        # frame is trusted as "done" without count or digest: the historical behaviour the fault tests recreate.
        self.checks = checks
        self.faults = faults or Faults()
        self._active: dict[TransferId, _Reservation] = {}
        self._ended: OrderedDict[TransferId, str] = OrderedDict()  # "completed" | "revoked", bounded
        self._floor: dict[int, int] = {}  # router prefix -> highest id evicted from `_ended`
        self.stats = ReceiverStats()

    def reserve(self, transfer_id: TransferId, request_id: RequestId, num_pages: int) -> Ticket:
        """Lease pages for a transfer and return the ticket to send to prefill. Raises PoolExhausted."""
        used = transfer_id in self._active or self._ended_reason(transfer_id) is not None
        if used and self.checks:
            raise ValueError(f"transfer id {transfer_id} was already used")
        # (checks off, debug only: a reused id silently replaces the reservation, the metadata collision of
        # bug 4; the earlier reservation's pages are orphaned and its request never completes)
        leases = self.pool.allocate(num_pages)
        self._active[transfer_id] = _Reservation(request_id, leases, [None] * num_pages)
        return Ticket(
            transfer_id,
            request_id,
            tuple(x.page for x in leases),
            tuple(x.lease for x in leases),
            self.layout,
        )

    def on_frame(self, frame: PageFrame) -> Applied | Dropped | Failed:
        """I2: apply a frame only if it matches the reservation and the page's current lease, exactly once;
        write it, then record and stamp it (a failed write revokes the transfer: `Failed`)."""
        res = self._active.get(frame.transfer_id)
        if res is None:
            return self._drop(self._ended_reason(frame.transfer_id) or "unknown_transfer")
        if not 0 <= frame.index < len(res.leases):
            return self._drop("bad_index")
        lease = res.leases[frame.index]
        if frame.page_id != lease.page:
            return self._drop("wrong_page")
        if frame.lease_id != lease.lease:
            return self._drop("wrong_lease")
        if self.checks and int(self.pool.owner[lease.page]) != lease.lease:
            return self._drop("stale_lease")
        ack = FrameAck(frame.transfer_id, frame.index)
        if res.digests[frame.index] is not None:
            return self._drop("duplicate", ack)
        if len(frame.payload) != self.page_bytes:
            return self._drop("bad_size")
        if trace.enabled:
            trace.emit("apply", tid=int(frame.transfer_id), page=int(lease.page), lease=int(lease.lease))
        try:
            self.write_page(lease.page, frame.payload)
        except Exception as exc:  # the page may hold part of the payload: never mark it written
            log.error("transfer %s: writing page %s failed: %r; revoking", frame.transfer_id, lease.page, exc)
            return self._fail(frame.transfer_id, f"write_failed: {exc!r}")
        res.digests[frame.index] = page_digest(frame.payload)
        self.pool.stamp([lease.page], [lease.lease])
        self.stats.applied += 1
        return Applied(lease, ack)

    def on_final(self, final: FinalFrame) -> Ready | Failed | Dropped:
        """I3: decodable only with every page written once, the count the ticket reserved, and equal digests."""
        res = self._active.get(final.transfer_id)
        if res is None:
            return self._drop(self._ended_reason(final.transfer_id) or "unknown_transfer")
        if not self.checks:  # debug: trust the sender's "done"
            return self._complete(final, res)
        if final.num_pages != len(res.leases):
            return self._fail(final.transfer_id, f"page_count_mismatch: reserved {len(res.leases)}, "
                              f"prefill reports {final.num_pages}")  # fmt: skip
        if res.num_written != len(res.leases):
            return self._fail(
                final.transfer_id, f"incomplete: {res.num_written} of {len(res.leases)} pages written"
            )
        digests = [d for d in res.digests if d is not None]
        if transfer_digest(digests) != final.digest:
            return self._fail(final.transfer_id, "digest_mismatch")
        return self._complete(final, res)

    def _complete(self, final: FinalFrame, res: _Reservation) -> Ready:
        del self._active[final.transfer_id]
        self._remember(final.transfer_id, "completed")
        self.stats.completed += 1
        return Ready(res.request_id, tuple(res.leases), final.first_token, final.first_logprobs)

    def revoke(self, transfer_id: TransferId, reason: str) -> Failed | None:
        """Abort a transfer (timeout, client gone, prefill error). From now on its frames are dropped on arrival,
        so its pages can be released at once. Returns None if the transfer is not active."""
        if transfer_id not in self._active:
            return None
        if reason == "timeout" and self.faults.fire("free_on_timeout"):
            # Fault knob: the historical bug. Free the pages on a timeout but leave the transfer open, so frames
            # still in flight are accepted and land wherever those pages went next.
            res = self._active[transfer_id]
            self.pool.release(res.leases)
            return Failed(res.request_id, reason)
        return self._fail(transfer_id, reason)

    def _fail(self, transfer_id: TransferId, reason: str) -> Failed:
        res = self._active.pop(transfer_id)
        self._remember(transfer_id, "revoked")
        refused = self.pool.release(res.leases)
        if refused:  # only reachable with the free_on_timeout fault armed: the pages went back already
            log.error(
                "transfer %s: pool refused release of %s (not leased to it any more)", transfer_id, refused
            )
            self.stats.count(self.stats.dropped, "release_refused")
        self.stats.count(self.stats.failed, reason.split(":")[0])
        return Failed(res.request_id, reason)

    def _remember(self, transfer_id: TransferId, how: str) -> None:
        self._ended[transfer_id] = how
        while len(self._ended) > ENDED_MEMORY:
            old, _ = self._ended.popitem(last=False)
            prefix = old >> _PREFIX_SHIFT
            self._floor[prefix] = max(self._floor.get(prefix, 0), old)

    def _ended_reason(self, transfer_id: TransferId) -> str | None:
        if transfer_id in self._ended:
            return self._ended[transfer_id]
        floor = self._floor.get(transfer_id >> _PREFIX_SHIFT)
        return "ended" if floor is not None and transfer_id <= floor else None

    def _drop(self, reason: str, ack: FrameAck | None = None) -> Dropped:
        self.stats.count(self.stats.dropped, reason)
        return Dropped(reason, ack)

    def reserved_leases(self) -> list[Lease]:
        """Every lease held by an active reservation (for the engine's integrity check)."""
        return [x for res in self._active.values() for x in res.leases]

    def in_flight(self) -> list[InFlight]:
        """Every active reservation and its progress, for observers (same thread as the other events)."""
        return [
            InFlight(tid, res.request_id, tuple(res.leases), res.num_written)
            for tid, res in self._active.items()
        ]

    @property
    def num_active(self) -> int:
        return len(self._active)

    def check_integrity(self) -> None:
        """Every page of every active reservation is leased to it in the pool."""
        self.pool.check_integrity()
        for tid, res in self._active.items():
            for lease in res.leases:
                assert int(self.pool.owner[lease.page]) == lease.lease, (
                    f"transfer {tid} lost page {lease.page}"
                )
