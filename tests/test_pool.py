"""Pure tests of the page pool and the I1 read check: leases, tags, quarantine (I4), fault knobs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.faults import Faults
from kvfence.ids import NO_TAG, PageId, RequestId
from kvfence.kv.integrity import ReadSet, StepReads, check_reads
from kvfence.kv.pool import PagePool, PageState


def read_set(rid: str, leases, written_tokens: int) -> ReadSet:
    return ReadSet(RequestId(rid), [x.page for x in leases], [x.lease for x in leases], written_tokens)


def test_leases_are_unique_and_pages_start_unreadable():
    pool = PagePool(8, 4, lease_prefix=7)
    a = pool.allocate(3)
    b = pool.allocate(2)
    ids = [x.lease for x in a + b]
    assert len(set(ids)) == 5 and all(x >> 40 == 7 for x in ids)
    assert all(pool.tag[x.page] == NO_TAG for x in a + b)
    pool.release(a)
    c = pool.allocate(3)
    assert not set(x.lease for x in c) & set(ids), "lease ids are never reused"
    pool.check_integrity()


def test_check_passes_for_owner_and_fails_for_foreign_tag():
    pool = PagePool(8, 4, lease_prefix=1)
    a = pool.allocate(2)
    assert check_reads(pool, [read_set("a", a, 0)]) == []
    pool.stamp([a[0].page], [a[0].lease])
    assert check_reads(pool, [read_set("a", a, 3)]) == []
    # page 0 written by a stranger
    pool.tag[a[0].page] = 12345
    (v,) = check_reads(pool, [read_set("a", a, 3)])
    assert (v.kind, v.page, v.expected, v.found) == ("tag", a[0].page, a[0].lease, 12345)


def test_unwritten_page_must_carry_no_tag():
    """A late write into a page its new owner has not written yet shows up as a foreign tag."""
    pool = PagePool(4, 4, lease_prefix=1)
    a = pool.allocate(1)
    pool.stamp([a[0].page], [999])
    (v,) = check_reads(pool, [read_set("a", a, 0)])
    assert v.kind == "tag" and v.expected == NO_TAG


def test_written_page_without_stamp_fails():
    pool = PagePool(4, 4, lease_prefix=1, faults=Faults(skip_stamp=1))
    a = pool.allocate(1)
    pool.stamp([a[0].page], [a[0].lease])  # skipped by the fault knob
    (v,) = check_reads(pool, [read_set("a", a, 2)])
    assert v.kind == "tag" and v.found == NO_TAG


def test_double_lease_fault_is_caught_as_owner_mismatch():
    pool = PagePool(8, 4, lease_prefix=1, faults=Faults(double_lease=1))
    victim = pool.allocate(2)
    pool.stamp([x.page for x in victim], [x.lease for x in victim])
    thief = pool.allocate(1)
    assert thief[0].page == victim[1].page
    violations = check_reads(pool, [read_set("v", victim, 5), read_set("t", thief, 0)])
    assert [(v.request_id, v.kind) for v in violations] == [("v", "owner")]
    # the victim's release of the stolen page is refused: the thief keeps it
    refused = pool.release(victim)
    assert refused == [victim[1]]
    pool.check_integrity()


def test_owner_check_alone_catches_a_stolen_page_nobody_wrote_yet():
    """Neither side has written the doubly leased page, so both tags are as expected (none): only the owner
    half of I1 can see that the victim's block table lists a page the allocator gave to someone else."""
    pool = PagePool(8, 4, lease_prefix=1, faults=Faults(double_lease=1))
    victim = pool.allocate(2)
    thief = pool.allocate(1)
    assert thief[0].page == victim[1].page
    violations = check_reads(pool, [read_set("v", victim, 0), read_set("t", thief, 0)])
    assert [(v.request_id, v.kind, v.page_index) for v in violations] == [("v", "owner", 1)]


def test_release_is_quarantined_while_held():
    pool = PagePool(4, 4, lease_prefix=1)
    a = pool.allocate(2)
    pool.hold([x.page for x in a])
    pool.release(a)
    assert pool.stats().num_quarantined == 2 and pool.num_free == 2
    pool.check_integrity()
    pool.unhold([x.page for x in a])
    assert pool.stats().num_quarantined == 0 and pool.num_free == 4
    pool.check_integrity()


def test_stale_release_cannot_free_a_reused_page():
    pool = PagePool(1, 4, lease_prefix=1)
    old = pool.allocate(1)
    pool.release(old)
    new = pool.allocate(1)
    assert pool.release(old) == old  # refused
    assert pool.state[new[0].page] == PageState.LEASED
    pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "release", "hold", "unhold"]), st.integers(1, 4)), max_size=60
    )
)
def test_random_operations_keep_the_pool_consistent(ops):
    pool = PagePool(10, 4, lease_prefix=3)
    owned: list = []
    held: list = []
    for op, n in ops:
        if op == "alloc" and pool.can_allocate(n):
            owned.append(pool.allocate(n))
        elif op == "release" and owned:
            assert pool.release(owned.pop(n % len(owned))) == []
        elif op == "hold" and owned:
            pages = [x.page for x in owned[n % len(owned)]]
            pool.hold(pages)
            held.append(pages)
        elif op == "unhold" and held:
            pool.unhold(held.pop())
        pool.check_integrity()
    leased_pages = sorted(int(x.page) for group in owned for x in group)
    assert leased_pages == sorted(np.flatnonzero(pool.state == PageState.LEASED).tolist())


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_step_reads_agree_with_check_reads(data):
    """The engine's fast path (arrays built once per step, checked before and after the forward pass) returns
    exactly what `check_reads` returns, untouched or after foreign writes, missing stamps and stolen pages."""
    pool = PagePool(32, 4, lease_prefix=3)
    rows = []
    for i in range(data.draw(st.integers(1, 5))):
        leases = pool.allocate(data.draw(st.integers(1, 5)))
        done = data.draw(st.integers(0, 4 * len(leases)))  # tokens written before the step
        new = data.draw(st.integers(0, 4 * len(leases) - done))  # and by it
        written = pool.pages_for(done + new)
        pool.stamp([x.page for x in leases[:written]], [x.lease for x in leases[:written]])
        rows.append((read_set(f"r{i}", leases, done), read_set(f"r{i}", leases, done + new)))
    pages = [p for before, _ in rows for p in before.pages]
    for _ in range(data.draw(st.integers(0, 3))):  # tampering
        page = data.draw(st.sampled_from(pages))
        if data.draw(st.booleans()):
            pool.tag[page] = data.draw(st.sampled_from([NO_TAG, 12345]))
        else:
            pool.owner[page] = 777
    before, after = [b for b, _ in rows], [a for _, a in rows]
    reads = StepReads(pool, before, after)
    assert reads.check(pool, after_step=False) == check_reads(pool, before)
    assert reads.check(pool, after_step=True) == check_reads(pool, after)


def test_core_modules_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvfence.kv.pool, kvfence.kv.integrity, kvfence.engine.scheduler, kvfence.engine.request\n"
        "import kvfence.engine.admission, kvfence.engine.plan\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert PageId(1) == 1
