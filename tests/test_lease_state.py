"""Hypothesis stateful test of the allocator / lease / quarantine API together with the decode side of the
transfer protocol (issue 5): local leases, holds, reservations, frames (valid, late, duplicate, forged), final
frames (honest, short, wrong digest) and revocations in any order. After every step: the pool's and the
receiver's own integrity checks, lease ids never reused, no held page free, and the KV bytes of every page
an active reservation has written are exactly what its own frames carried (no foreign write landed, I2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence.ids import PageId
from kvfence.kv.pool import Lease, PagePool, PageState
from kvfence.pd.digest import page_digest, transfer_digest
from kvfence.pd.messages import FinalFrame, PageFrame, Ticket, TransferId
from kvfence.pd.receiver import Applied, Dropped, Failed, Ready, TransferReceiver

PAGES = 8
PAGE_BYTES = 8


@dataclass
class Transfer:
    ticket: Ticket
    payloads: list[bytes]
    sent: set[int] = field(default_factory=set)


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(PAGES, 4, lease_prefix=7)
        self.kv: dict[int, bytes] = {p: bytes(PAGE_BYTES) for p in range(PAGES)}
        self.receiver = TransferReceiver(self.pool, "layout", PAGE_BYTES, self._write)
        self.owned: list[list[Lease]] = []  # local requests' leases (and completed transfers')
        self.released: list[list[Lease]] = []
        self.held: list[list[PageId]] = []
        self.active: dict[TransferId, Transfer] = {}
        self.ended: list[Transfer] = []
        self.leases_seen: set[int] = set()
        self.next_tid = 1
        self.counter = 0

    def _write(self, page: PageId, payload: bytes) -> None:
        self.kv[int(page)] = payload

    def _note(self, leases: list[Lease]) -> None:
        for x in leases:
            assert int(x.lease) not in self.leases_seen, "a lease id was reused"
            self.leases_seen.add(int(x.lease))

    def _payload(self) -> bytes:
        self.counter += 1
        return self.counter.to_bytes(PAGE_BYTES, "little")

    # ---- local requests -------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def allocate(self, n: int) -> None:
        if self.pool.can_allocate(n):
            leases = self.pool.allocate(n)
            self._note(leases)
            self.owned.append(leases)

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        leases = self.owned.pop(i % len(self.owned))
        assert self.pool.release(leases) == []
        self.released.append(leases)

    @precondition(lambda self: self.released)
    @rule(i=st.integers(0, 100))
    def stale_release(self, i: int) -> None:
        """A second release with old leases is refused whole, whoever holds those pages now."""
        leases = self.released[i % len(self.released)]
        assert self.pool.release(leases) == leases

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def hold(self, i: int) -> None:
        pages = [x.page for x in self.owned[i % len(self.owned)]]
        self.pool.hold(pages)
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unhold(self, i: int) -> None:
        self.pool.unhold(self.held.pop(i % len(self.held)))

    # ---- transfers --------------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def reserve(self, n: int) -> None:
        if not self.pool.can_allocate(n):
            return
        tid = TransferId(self.next_tid)
        self.next_tid += 1
        ticket = self.receiver.reserve(tid, f"r{tid}", n)
        self._note([Lease(p, x) for p, x in zip(ticket.page_ids, ticket.lease_ids, strict=True)])
        self.active[tid] = Transfer(ticket, [self._payload() for _ in range(n)])

    def _frame(self, t: Transfer, index: int, payload: bytes | None = None) -> PageFrame:
        tk = t.ticket
        return PageFrame(
            tk.transfer_id, index, tk.page_ids[index], tk.lease_ids[index], payload or t.payloads[index]
        )

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def frame(self, i: int, j: int) -> None:
        t = list(self.active.values())[i % len(self.active)]
        index = j % t.ticket.num_pages
        before = dict(self.kv)
        result = self.receiver.on_frame(self._frame(t, index))
        if index in t.sent:
            assert isinstance(result, Dropped) and result.reason == "duplicate"
            assert self.kv == before
        else:
            assert isinstance(result, Applied)
            t.sent.add(index)

    @precondition(lambda self: self.ended)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def late_frame(self, i: int, j: int) -> None:
        """A frame of a transfer that completed or was revoked: dropped, and no page's bytes change."""
        t = self.ended[i % len(self.ended)]
        before = dict(self.kv)
        result = self.receiver.on_frame(self._frame(t, j % t.ticket.num_pages, b"\xee" * PAGE_BYTES))
        assert isinstance(result, Dropped) and result.reason in {"completed", "revoked"}
        assert self.kv == before

    @precondition(lambda self: self.active and self.owned)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def forged_frame(self, i: int, j: int) -> None:
        """A frame naming an active transfer but a page leased to someone else: dropped, nothing written."""
        t = list(self.active.values())[i % len(self.active)]
        victim = self.owned[j % len(self.owned)][0]
        tk = t.ticket
        before = dict(self.kv)
        forged = PageFrame(tk.transfer_id, 0, victim.page, tk.lease_ids[0], b"\xaa" * PAGE_BYTES)
        result = self.receiver.on_frame(forged)
        assert isinstance(result, Dropped) and result.reason == "wrong_page"
        forged = PageFrame(tk.transfer_id, 0, tk.page_ids[0], victim.lease, b"\xaa" * PAGE_BYTES)
        result = self.receiver.on_frame(forged)
        assert isinstance(result, Dropped) and result.reason == "wrong_lease"
        assert self.kv == before

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100), how=st.sampled_from(["honest", "short", "bad_digest"]))
    def final(self, i: int, how: str) -> None:
        tid = list(self.active)[i % len(self.active)]
        t = self.active[tid]
        n = t.ticket.num_pages
        digest = transfer_digest([page_digest(p) for p in t.payloads])
        count = n - 1 if how == "short" else n
        digest = b"\x00" * len(digest) if how == "bad_digest" else digest
        result = self.receiver.on_final(FinalFrame(tid, count, digest, first_token=1))
        del self.active[tid]
        self.ended.append(t)
        if how == "honest" and len(t.sent) == n:
            assert isinstance(result, Ready)
            assert [self.kv[int(x.page)] for x in result.leases] == t.payloads  # I3: what prefill sent
            self.owned.append(list(result.leases))  # decode owns the pages now; released like local ones
        else:
            assert isinstance(result, Failed)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100), reason=st.sampled_from(["timeout", "client_abort", "prefill_failed"]))
    def revoke(self, i: int, reason: str) -> None:
        tid = list(self.active)[i % len(self.active)]
        assert isinstance(self.receiver.revoke(tid, reason), Failed)
        self.ended.append(self.active.pop(tid))

    # ---- invariants -----------------------------------------------------------------------------------------

    @invariant()
    def integrity_holds(self) -> None:
        self.receiver.check_integrity()  # the pool's own check too: one state per page, owners, free list
        for pages in self.held:
            assert all(self.pool.state[p] != PageState.FREE for p in pages), "a held page went free"
        for t in self.active.values():
            for index in t.sent:  # what an active reservation wrote is still its own bytes
                assert self.kv[int(t.ticket.page_ids[index])] == t.payloads[index], "a foreign write landed"
        leased = sum(len(g) for g in self.owned) + sum(t.ticket.num_pages for t in self.active.values())
        assert leased == int((self.pool.state == PageState.LEASED).sum())


LeaseMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, derandomize=True
)
test_leases_quarantine_and_transfers = LeaseMachine.TestCase
