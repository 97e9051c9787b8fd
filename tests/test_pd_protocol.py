"""The KV transfer protocol's sans-IO state machines, driven directly and over a seeded lossy network."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.ids import NO_TAG, LeaseId, PageId, RequestId
from kvfence.kv.pool import PagePool
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, FrameAck, PageFrame, TransferId
from kvfence.pd.receiver import Applied, Dropped, Failed, Ready, TransferReceiver
from kvfence.pd.sender import ReleaseLocal, SendAbort, SendFinal, SendFrames, TransferSender

LAYOUT = "tiny/f32/ps4"
PAGE_BYTES = 8


def payload(tid: int, index: int) -> bytes:
    return bytes([tid % 256, index % 256]) * (PAGE_BYTES // 2)


class Memory(dict[PageId, bytes]):
    """The receiver's KV memory: `write_page` stores the payload; `fail_on` makes one write raise."""

    fail_on: PageId | None = None

    def write(self, page: PageId, payload: bytes) -> None:
        if page == self.fail_on:
            raise OSError("injected write failure")
        self[page] = payload


def receiver(num_pages: int = 16) -> TransferReceiver:
    return TransferReceiver(PagePool(num_pages, 4, lease_prefix=9), LAYOUT, PAGE_BYTES, Memory().write)


def run_direct(rx: TransferReceiver, tx: TransferSender, window_seen: list[int]) -> Ready | Failed | None:
    """Deliver every message immediately, in order; return the receiver's verdict."""
    queue = list(tx.start())
    in_flight: set[int] = set()
    while queue:
        action = queue.pop(0)
        if isinstance(action, SendFrames):
            for i in action.indices:
                in_flight.add(i)
                window_seen.append(len(in_flight))
                verdict = rx.on_frame(tx.frame(i, payload(tx.ticket.transfer_id, i)))
                assert isinstance(verdict, Applied)
                in_flight.discard(i)
                queue += tx.on_ack(verdict.ack)
        elif isinstance(action, SendFinal):
            result = rx.on_final(action.final)
            assert isinstance(result, Ready | Failed)
            return result
        elif isinstance(action, SendAbort) and isinstance(action.abort, Abort):
            return rx.revoke(action.abort.transfer_id, action.abort.reason)
    return None


@pytest.mark.parametrize("window", [1, 3, 64])
def test_transfer_completes_with_bounded_window(window):
    rx = receiver()
    ticket = rx.reserve(TransferId(1), RequestId("r"), 5)
    tx = TransferSender(ticket, 5, LAYOUT, window)
    seen: list[int] = []
    result = run_direct(rx, tx, seen)
    assert isinstance(result, Ready) and result.request_id == "r"
    assert max(seen) <= window
    for lease in result.leases:  # the decode request adopts pages already tagged with its leases
        assert rx.pool.tag[lease.page] == lease.lease == rx.pool.owner[lease.page]
    rx.check_integrity()


def test_the_2026_incident_is_refused_by_both_sides():
    """Decode reserves 8 pages for a long prompt; prefill computed 1 (its placeholder). No side calls it done."""
    rx = receiver()
    ticket = rx.reserve(TransferId(7), RequestId("victim"), 8)
    tx = TransferSender(ticket, num_local_pages=1, layout=LAYOUT, window=4)
    actions = tx.start()
    assert isinstance(actions[0], SendAbort) and "page_count_mismatch" in actions[0].abort.reason
    assert isinstance(actions[1], ReleaseLocal)
    failed = rx.revoke(TransferId(7), actions[0].abort.reason)
    assert isinstance(failed, Failed) and failed.request_id == "victim"
    assert rx.pool.num_free == rx.pool.num_pages


def test_a_sender_that_claims_completion_early_fails_the_request():
    """The buggy path itself: one frame written, then a final frame claiming all eight."""
    rx = receiver()
    ticket = rx.reserve(TransferId(8), RequestId("victim"), 8)
    frame = PageFrame(ticket.transfer_id, 0, ticket.page_ids[0], ticket.lease_ids[0], payload(8, 0))
    assert isinstance(rx.on_frame(frame), Applied)
    result = rx.on_final(FinalFrame(ticket.transfer_id, 8, b"whatever", 0))
    assert isinstance(result, Failed) and result.reason.startswith("incomplete: 1 of 8")
    result = rx.on_final(FinalFrame(ticket.transfer_id, 1, b"whatever", 0))
    assert isinstance(result, Dropped) and result.reason == "revoked"
    assert rx.pool.num_free == rx.pool.num_pages


def test_digest_mismatch_fails_the_request():
    rx = receiver()
    ticket = rx.reserve(TransferId(2), RequestId("r"), 2)
    tx = TransferSender(ticket, 2, LAYOUT, 2)
    (send,) = tx.start()
    assert isinstance(send, SendFrames)
    for i in send.indices:
        frame = tx.frame(i, payload(2, i))
        if i == 1:  # corrupted in flight
            frame = PageFrame(frame.transfer_id, 1, frame.page_id, frame.lease_id, b"\xff" * PAGE_BYTES)
        verdict = rx.on_frame(frame)
        assert isinstance(verdict, Applied)
        actions = tx.on_ack(verdict.ack)
    final = next(a for a in actions if isinstance(a, SendFinal)).final
    result = rx.on_final(final)
    assert isinstance(result, Failed) and result.reason == "digest_mismatch"
    assert rx.pool.num_free == rx.pool.num_pages


def test_invalid_frames_are_dropped_and_never_stamp():
    rx = receiver()
    t = rx.reserve(TransferId(3), RequestId("r"), 2)
    ok = PageFrame(t.transfer_id, 0, t.page_ids[0], t.lease_ids[0], payload(3, 0))
    cases = {
        "unknown_transfer": PageFrame(TransferId(99), 0, t.page_ids[0], t.lease_ids[0], ok.payload),
        "bad_index": PageFrame(t.transfer_id, 5, t.page_ids[0], t.lease_ids[0], ok.payload),
        "wrong_page": PageFrame(t.transfer_id, 0, t.page_ids[1], t.lease_ids[0], ok.payload),
        "wrong_lease": PageFrame(t.transfer_id, 0, t.page_ids[0], LeaseId(12345), ok.payload),
        "bad_size": PageFrame(t.transfer_id, 0, t.page_ids[0], t.lease_ids[0], b"short"),
    }
    for reason, frame in cases.items():
        verdict = rx.on_frame(frame)
        assert isinstance(verdict, Dropped) and verdict.reason == reason
        assert all(rx.pool.tag[p] == NO_TAG for p in t.page_ids)
    assert isinstance(rx.on_frame(ok), Applied)
    dup = rx.on_frame(ok)
    assert isinstance(dup, Dropped) and dup.reason == "duplicate" and dup.ack is not None


def test_late_frame_after_revoke_cannot_land_on_the_next_owner():
    """Bug 2 of the design brief: decode aborts, pages are reused, the old transfer's frame arrives."""
    rx = receiver(num_pages=2)
    old = rx.reserve(TransferId(4), RequestId("old"), 2)
    rx.revoke(old.transfer_id, "timeout")
    new = rx.reserve(TransferId(5), RequestId("new"), 2)
    assert set(new.page_ids) == set(old.page_ids)  # the very same pages, under fresh leases
    late = PageFrame(old.transfer_id, 0, old.page_ids[0], old.lease_ids[0], payload(4, 0))
    verdict = rx.on_frame(late)
    assert isinstance(verdict, Dropped) and verdict.reason == "revoked"
    assert all(rx.pool.tag[p] == NO_TAG for p in new.page_ids)
    rx.check_integrity()


def test_transfer_ids_are_never_reused():
    rx = receiver()
    rx.reserve(TransferId(6), RequestId("a"), 1)
    rx.revoke(TransferId(6), "abort")
    with pytest.raises(ValueError, match="already used"):
        rx.reserve(TransferId(6), RequestId("b"), 1)


def test_abort_from_decode_stops_the_sender():
    rx = receiver()
    ticket = rx.reserve(TransferId(10), RequestId("r"), 4)
    tx = TransferSender(ticket, 4, LAYOUT, 2)
    tx.start()
    rx.revoke(ticket.transfer_id, "client_gone")
    actions = tx.on_abort(Abort(ticket.transfer_id, "client_gone"))
    assert isinstance(actions[0], SendAbort) and isinstance(actions[0].abort, AbortAck)
    assert isinstance(actions[1], ReleaseLocal)
    assert tx.on_abort(Abort(ticket.transfer_id, "again")) == [SendAbort(AbortAck(ticket.transfer_id))]


def test_a_failed_write_revokes_and_never_marks_the_page_written():
    """Finding 4 of docs/verification.md: the tag and digest are recorded only after the write succeeded."""
    memory = Memory()
    rx = TransferReceiver(PagePool(8, 4, lease_prefix=9), LAYOUT, PAGE_BYTES, memory.write)
    ticket = rx.reserve(TransferId(1), RequestId("r"), 2)
    tx = TransferSender(ticket, 2, LAYOUT, 8)
    tx.start()
    memory.fail_on = ticket.page_ids[1]
    assert isinstance(rx.on_frame(tx.frame(0, payload(1, 0))), Applied)
    failed = rx.on_frame(tx.frame(1, payload(1, 1)))
    assert isinstance(failed, Failed) and failed.reason.startswith("write_failed")
    assert rx.pool.tag[ticket.page_ids[1]] == NO_TAG and rx.num_active == 0
    retry = rx.on_frame(tx.frame(1, payload(1, 1)))  # a duplicate of the failed frame is not acked as written
    assert isinstance(retry, Dropped) and retry.reason == "revoked" and retry.ack is None
    rx.pool.check_integrity()


def test_acks_and_aborts_for_another_transfer_are_ignored():
    rx = receiver()
    ticket = rx.reserve(TransferId(1), RequestId("r"), 1)
    tx = TransferSender(ticket, 1, LAYOUT, 8)
    tx.start()
    assert tx.on_ack(FrameAck(TransferId(2), 0)) == [] and tx.on_abort(Abort(TransferId(2), "x")) == []
    assert tx.state.value == "sending"


def test_without_checks_the_sender_ships_what_it_has_and_says_done():
    """--no-integrity-checks recreates the 2026 incident's sender: 1 page computed, 3 reserved, "done"."""
    rx = receiver()
    ticket = rx.reserve(TransferId(1), RequestId("r"), 3)
    tx = TransferSender(ticket, 1, LAYOUT, 8, checks=False)
    (send,) = tx.start()
    assert isinstance(send, SendFrames) and send.indices == (0,)
    (applied,) = [rx.on_frame(tx.frame(0, payload(1, 0)))]
    assert isinstance(applied, Applied)
    final, release = tx.on_ack(applied.ack)
    assert isinstance(final, SendFinal) and isinstance(release, ReleaseLocal)
    assert isinstance(rx.on_final(final.final), Failed)  # a checking receiver still refuses it (I3)


def test_ended_transfer_ids_stay_refused_beyond_the_remembered_window(monkeypatch):
    """Finding 5(c): the table of ended ids is bounded; older ids are refused by the per-router floor."""
    import kvfence.pd.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "ENDED_MEMORY", 4)
    rx = receiver(64)
    base = 7 << 40  # one router's prefix
    for i in range(1, 11):
        rx.reserve(TransferId(base + i), RequestId(f"r{i}"), 1)
        assert rx.revoke(TransferId(base + i), "aborted") is not None
    assert len(rx._ended) == 4
    for i in range(1, 11):
        with pytest.raises(ValueError):
            rx.reserve(TransferId(base + i), RequestId("again"), 1)
    frame = PageFrame(TransferId(base + 1), 0, PageId(0), LeaseId(1), payload(1, 0))
    assert rx.on_frame(frame) == Dropped("ended")
    rx.reserve(TransferId(base + 11), RequestId("next"), 1)  # new ids from the same router still work
    rx.reserve(TransferId((8 << 40) + 1), RequestId("other-router"), 1)


# ---- a seeded lossy network: drops, duplicates, reordering, timeouts ------------------------------------


def simulate(seed: int, num_transfers: int, pool_pages: int, p_drop: float, p_dup: float) -> None:
    rng = random.Random(seed)
    memory = Memory()
    rx = TransferReceiver(PagePool(pool_pages, 4, lease_prefix=9), LAYOUT, PAGE_BYTES, memory.write)
    senders: dict[int, TransferSender] = {}
    outcome: dict[int, str] = {}
    wire: list[tuple[str, object]] = []  # (direction, message) in flight, delivered in random order
    owned_payload: dict[PageId, bytes] = {}  # what the receiver's KV holds per page (the simulated KV write)

    def send(direction: str, message: object) -> None:
        if rng.random() < p_drop:
            return
        wire.append((direction, message))
        if rng.random() < p_dup:
            wire.append((direction, message))

    def sender_actions(tx: TransferSender, actions: list) -> None:
        for a in actions:
            if isinstance(a, SendFrames):
                for i in a.indices:
                    send("to_decode", tx.frame(i, payload(tx.ticket.transfer_id, i)))
            elif isinstance(a, SendFinal):
                send("to_decode", a.final)
            elif isinstance(a, SendAbort):
                send("to_decode", a.abort)

    next_tid = 1
    steps = 0
    while (len(outcome) < num_transfers or wire) and steps < 5000:
        steps += 1
        start_new = next_tid <= num_transfers and (not wire or rng.random() < 0.3)
        if start_new:
            n = rng.randint(1, 4)
            if rx.pool.can_allocate(n):
                ticket = rx.reserve(TransferId(next_tid), RequestId(f"r{next_tid}"), n)
                senders[next_tid] = TransferSender(ticket, n, LAYOUT, rng.choice([1, 2, 8]))
                send("to_prefill", ticket)
            else:
                outcome[next_tid] = "rejected"
            next_tid += 1
        elif wire:
            direction, msg = wire.pop(rng.randrange(len(wire)))
            if direction == "to_prefill":
                tx = senders[msg.transfer_id]
                if isinstance(msg, type(tx.ticket)):
                    sender_actions(tx, tx.start() if tx._next == 0 and tx.state.value == "sending" else [])
                elif isinstance(msg, Abort):
                    sender_actions(tx, tx.on_abort(msg))
                else:
                    sender_actions(tx, tx.on_ack(msg))
            elif isinstance(msg, PageFrame):
                verdict = rx.on_frame(msg)
                if isinstance(verdict, Applied):
                    assert verdict.lease.lease == msg.lease_id == rx.pool.owner[verdict.lease.page]  # I2
                    assert memory[verdict.lease.page] == msg.payload  # written before it was acknowledged
                    owned_payload[verdict.lease.page] = msg.payload
                if verdict.ack is not None:
                    send("to_prefill", verdict.ack)
            elif isinstance(msg, FinalFrame):
                result = rx.on_final(msg)
                if isinstance(result, Ready):
                    tid = msg.transfer_id
                    for i, lease in enumerate(result.leases):  # I3: the request reads exactly its own data
                        assert owned_payload[lease.page] == payload(tid, i)
                        assert rx.pool.tag[lease.page] == lease.lease
                    rx.pool.release(result.leases)  # the decode request finishes at once
                    outcome[tid] = "ready"
                elif isinstance(result, Failed):
                    outcome[msg.transfer_id] = "failed"
            elif (
                isinstance(msg, Abort | AbortAck) and rx.revoke(msg.transfer_id, "prefill_abort") is not None
            ):
                outcome[msg.transfer_id] = "failed"
        else:
            # Nothing in flight: every stuck transfer times out at the receiver (revocation, never a bare free)
            for tid in range(1, next_tid):
                if tid not in outcome and rx.revoke(TransferId(tid), "timeout") is not None:
                    outcome[tid] = "timeout"
                    send("to_prefill", Abort(TransferId(tid), "timeout"))
        rx.check_integrity()
    assert len(outcome) == num_transfers and not wire
    assert rx.num_active == 0 and rx.pool.num_free == rx.pool.num_pages


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0.0, 0.05, 0.3]), st.sampled_from([0.0, 0.2]))
def test_lossy_network_never_breaks_the_invariants(seed, p_drop, p_dup):
    simulate(seed, num_transfers=12, pool_pages=10, p_drop=p_drop, p_dup=p_dup)


@pytest.mark.parametrize(
    "frames",
    [
        [b"Z", b'{"version":1,"transfer_id":1,"num_pages":1,"digest":"00","first_token":1,'
               b'"first_logprobs":[' + b"9" * 400 + b",[]]}"],  # beyond a float: OverflowError
        [b"Z", b'{"version":1,"transfer_id":1,"num_pages":1,"digest":"00","first_token":1,'
               b'"first_logprobs":[NaN,[]]}'],  # json takes NaN; the client's JSON would not
        [b"T", b'{"version":1,"transfer_id":1,"request_id":"r","page_ids":[1,2],"lease_ids":[5],"layout":"l"}'],
        [b"T", b'{"version":1,"transfer_id":1,"request_id":"r","page_ids":[4294967296],"lease_ids":[5],'
               b'"layout":"l"}'],  # a page id the 32-bit frame header cannot carry
        [b"T", b'{"version":1,"transfer_id":1,"request_id":"r","page_ids":[1],"lease_ids":[' + b"1" * 30 + b'],'
               b'"layout":"l"}'],
        [b"A", b'{"version":1,"transfer_id":' + b"7" * 30 + b',"index":0}'],
    ],
)  # fmt: skip
def test_a_peers_data_frame_out_of_range_is_a_wire_error(frames):
    """Every malformed data-plane message is a WireError (the worker drops and counts it); before, these raised
    OverflowError, IndexError or struct.error further on, which ended the worker's process."""
    from kvfence.pd import wire

    with pytest.raises(wire.WireError):
        wire.decode(frames)
