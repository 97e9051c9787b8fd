"""The page pool: who owns which KV page, under which lease, and when a page may be reused.

Boundary: bookkeeping only. The pool never touches KV tensors (the model runner owns those); it owns small
per-page arrays that the integrity check reads in one vectorized pass:

- `owner[p]`: the lease id the allocator last handed out for page p (`NO_TAG` when not leased or sealed).
- `tag[p]`:   the lease id of the last writer of page p. A fresh lease resets it to `NO_TAG`, so a freshly
              allocated page is unreadable until its owner writes it (I1).
- `holds[p]`: how many in-flight users (a running forward step, later a network transfer) may still read or
              write page p. A released page waits in quarantine until its holds drop to zero (I4).
- `refs[p]`:  for a sealed page, how many requests hold its shared lease (I9, the prefix cache).

Page lifecycle:

    FREE --allocate--> LEASED --release--> QUARANTINED --(holds == 0)--> FREE
                         |                      ^
                         +--seal--> SEALED -----+  (refs == 0 and evicted, or corrupt)

A sealed page is full and read-only. Its owner and tag both stay the seal lease (the lease of the request that
wrote it), and every request that reuses it records that same lease in its block table, so the I1 check needs
no special case: a sealed page passes only for holders of its shared lease. `share` takes one more reference,
`release` drops one; at zero references a cached page becomes idle, counts as free capacity and waits in LRU
order until an allocation needs its page (then it goes through quarantine like any other page, I4).

Lease ids are 64-bit, unique for the lifetime of the pool and never reused: a per-pool random 24-bit prefix
(so two pools, e.g. a prefill and a decode worker, do not hand out the same ids) and a 40-bit counter.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from kvfence import trace
from kvfence.faults import Faults
from kvfence.ids import NO_TAG, LeaseId, PageId

_COUNTER_BITS = 40


class PageState(IntEnum):
    FREE = 0
    LEASED = 1
    QUARANTINED = 2
    SEALED = 3  # full, read-only, shared by reference count; idle (evictable) at zero references


@dataclass(frozen=True, slots=True)
class Lease:
    page: PageId
    lease: LeaseId


class PoolExhausted(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages: int
    num_free: int  # allocatable now: empty pages plus idle cached pages (evicted on demand)
    num_leased: int
    num_quarantined: int
    num_held: int
    num_sealed: int = 0  # sealed pages that requests hold (shared leases)
    num_cached: int = 0  # idle sealed pages: counted in num_free, reusable until evicted
    num_evictions: int = 0  # idle cached pages evicted to make room, over the pool's life


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        lease_prefix: int | None = None,
        faults: Faults | None = None,
    ) -> None:
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.faults = faults or Faults()
        self.owner: npt.NDArray[np.uint64] = np.zeros(num_pages, dtype=np.uint64)
        self.tag: npt.NDArray[np.uint64] = np.zeros(num_pages, dtype=np.uint64)
        self.holds: npt.NDArray[np.int32] = np.zeros(num_pages, dtype=np.int32)
        self.refs: npt.NDArray[np.int32] = np.zeros(num_pages, dtype=np.int32)
        self.cached: npt.NDArray[np.bool_] = np.zeros(num_pages, dtype=np.bool_)  # sealed, in the cache
        self.state: npt.NDArray[np.uint8] = np.full(num_pages, PageState.FREE, dtype=np.uint8)
        self._free: deque[PageId] = deque(PageId(p) for p in range(num_pages))
        self._idle: OrderedDict[PageId, None] = OrderedDict()  # sealed, refs == 0: LRU first
        self.on_evict: Callable[[PageId], None] | None = None  # the prefix cache forgets the page
        self.num_evictions = 0
        if lease_prefix is None:
            lease_prefix = int.from_bytes(os.urandom(3), "little") or 1
        assert 0 < lease_prefix < (1 << 24)
        self._next_lease = (lease_prefix << _COUNTER_BITS) + 1
        self._last_leased: list[Lease] = []  # for the double_lease fault knob only

    # ---- allocation -------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Empty pages plus idle cached pages (reusable, or evicted on demand). What an allocation can get,
        except for idle pages an in-flight step still holds (see `can_allocate`)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._idle)

    def can_allocate(self, num_pages: int) -> bool:
        if num_pages <= len(self._free):
            return True
        return num_pages <= len(self._free) + sum(1 for _ in self._evictable())

    def _evictable(self) -> Iterator[PageId]:
        """Idle pages in LRU order, except those an in-flight step holds (evicting them frees nothing yet)."""
        return (page for page in self._idle if self.holds[page] == 0)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_pages: int) -> list[Lease]:
        """Lease `num_pages` free pages, evicting idle cached pages (LRU) when the free list is short. Each page
        gets a fresh lease id and an empty tag (unreadable until written)."""
        if num_pages > len(self._free):
            for page in list(itertools.islice(self._evictable(), num_pages - len(self._free))):
                self._evict(page)
        if num_pages > len(self._free):
            raise PoolExhausted(f"asked for {num_pages} pages, {len(self._free)} free")
        leases = []
        for _ in range(num_pages):
            page = self._take_page()
            lease = self._new_lease()
            self.owner[page] = lease
            self.tag[page] = NO_TAG
            self.state[page] = PageState.LEASED
            leases.append(Lease(page, lease))
            if trace.enabled:
                trace.emit("alloc", page=int(page), lease=int(lease))
        self._last_leased = leases[-1:] or self._last_leased
        return leases

    def _take_page(self) -> PageId:
        # Fault knob: recreate "free while in use" by handing out a page that a live request still leases.
        last = self._last_leased[0].page if self._last_leased else None
        if last is not None and self.state[last] == PageState.LEASED and self.faults.fire("double_lease"):
            return last
        return self._free.popleft()

    def _new_lease(self) -> LeaseId:
        lease = LeaseId(self._next_lease)
        self._next_lease += 1
        return lease

    # ---- release and quarantine (I4) --------------------------------------------------------------------

    def release(self, leases: Iterable[Lease]) -> list[Lease]:
        """Give back pages. Only the current lease holder can release a page; other releases are refused and
        returned (a stale handle must never free someone else's page). Released pages are quarantined and go
        back to the free list once no in-flight user holds them. Releasing a sealed page drops one reference;
        the last one leaves it idle in the cache (LRU: the page released last is evicted last)."""
        refused = []
        for item in leases:
            page = item.page
            ok = int(self.owner[page]) == item.lease and self.state[page] in _RELEASABLE
            if trace.enabled:
                trace.emit("release", page=int(page), lease=int(item.lease), ok=ok)
            if not ok:
                refused.append(item)
            elif self.state[page] == PageState.SEALED:
                self._unref(page)
            else:
                self._quarantine(page)
        return refused

    def hold(self, pages: Sequence[PageId] | npt.NDArray[np.int64]) -> None:
        """Mark pages as in use by an in-flight reader/writer; they cannot leave quarantine until `unhold`."""
        np.add.at(self.holds, np.asarray(pages, dtype=np.int64), 1)
        if trace.enabled:
            trace.emit("hold", pages=[int(p) for p in pages])

    def unhold(self, pages: Sequence[PageId] | npt.NDArray[np.int64]) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        np.add.at(self.holds, idx, -1)
        if trace.enabled:
            trace.emit("unhold", pages=[int(p) for p in pages])
        assert (self.holds[idx] >= 0).all(), "unhold without matching hold"
        for page in np.unique(idx[self.state[idx] == PageState.QUARANTINED]):
            self._reclaim(PageId(int(page)))

    def _quarantine(self, page: PageId) -> None:
        if trace.enabled:
            trace.emit("quarantine", page=int(page))
        self.owner[page] = NO_TAG
        self.refs[page] = 0
        self.cached[page] = False
        self.state[page] = PageState.QUARANTINED
        self._reclaim(page)

    def _reclaim(self, page: PageId) -> None:
        if self.holds[page] == 0 and self.state[page] == PageState.QUARANTINED:
            if trace.enabled:
                trace.emit("reclaim", page=int(page))
            self.state[page] = PageState.FREE
            self.tag[page] = NO_TAG
            self._free.append(page)

    # ---- sealed pages (I9) and the idle LRU -------------------------------------------------------------

    def can_seal(self, page: PageId, lease: LeaseId) -> bool:
        """Only a page leased to `lease` whose tag says `lease` wrote it can be sealed."""
        return bool(self.state[page] == PageState.LEASED and self.owner[page] == lease == self.tag[page])

    def seal(self, page: PageId, lease: LeaseId) -> bool:
        """The holder of `lease` wrote `page` full: from now on it is read-only, shared by reference count,
        with the holder's lease as its shared lease (the holder keeps its reference). Refused (False) unless
        `can_seal`."""
        if not self.can_seal(page, lease):
            return False
        self.state[page] = PageState.SEALED
        self.refs[page] = 1
        self.cached[page] = True
        if trace.enabled:
            trace.emit("seal", page=int(page), lease=int(lease))
        return True

    def share(self, page: PageId, lease: LeaseId) -> bool:
        """Take one more reference on a cached sealed page under its shared lease; False if it is not (any
        longer) cached under that lease."""
        if self.state[page] != PageState.SEALED or not self.cached[page] or self.owner[page] != lease:
            return False
        self.refs[page] += 1
        self._idle.pop(page, None)
        if trace.enabled:
            trace.emit("share", page=int(page), lease=int(lease))
        return True

    def is_idle(self, page: PageId) -> bool:
        return page in self._idle

    def idle_pages(self) -> list[PageId]:
        """Idle cached pages, least recently used first."""
        return list(self._idle)

    def uncache(self, page: PageId) -> None:
        """The prefix cache drops a sealed page (corrupt, or its entry is gone): quarantined now if idle,
        otherwise when its last holder releases it (it never becomes idle again)."""
        if self.state[page] != PageState.SEALED or not self.cached[page]:
            return
        self._forget(page)
        if self._idle.pop(page, "absent") is None:
            self._quarantine(page)

    def _unref(self, page: PageId) -> None:
        assert self.refs[page] > 0, f"sealed page {page} released with no references"
        self.refs[page] -= 1
        if self.refs[page] > 0:
            return
        if self.cached[page] and self.tag[page] == self.owner[page]:
            self._idle[page] = None
            return
        if self.cached[page]:  # a foreign write was stamped on it: never reuse it
            self._forget(page)
        self._quarantine(page)

    def _evict(self, page: PageId) -> None:
        del self._idle[page]
        self.num_evictions += 1
        self._forget(page)
        self._quarantine(page)

    def _forget(self, page: PageId) -> None:
        self.cached[page] = False
        if self.on_evict is not None:
            self.on_evict(page)

    # ---- tags (I1) --------------------------------------------------------------------------------------

    def stamp(self, pages: Sequence[PageId], leases: Sequence[LeaseId]) -> None:
        """Record that the holder of `leases[i]` wrote `pages[i]`. Called by the write path, after the write."""
        if self.faults.any_armed:
            pages, leases = self._maybe_skip_stamp(pages, leases)
        if pages:
            self.tag[np.asarray(pages, dtype=np.int64)] = np.asarray(leases, dtype=np.uint64)
            if trace.enabled:
                trace.emit("stamp", pages=[int(p) for p in pages], leases=[int(x) for x in leases])

    def _maybe_skip_stamp(
        self, pages: Sequence[PageId], leases: Sequence[LeaseId]
    ) -> tuple[Sequence[PageId], Sequence[LeaseId]]:
        """Fault knob `skip_stamp`: the first write into a fresh page leaves its tag empty."""
        fresh = [i for i, p in enumerate(pages) if self.tag[p] == NO_TAG]
        if fresh and self.faults.fire("skip_stamp"):
            i = fresh[0]
            return [*pages[:i], *pages[i + 1 :]], [*leases[:i], *leases[i + 1 :]]
        return pages, leases

    # ---- invariants -------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        counts = np.bincount(self.state, minlength=len(PageState))
        num_idle = len(self._idle)
        return PoolStats(
            num_pages=self.num_pages,
            num_free=int(counts[PageState.FREE]) + num_idle,
            num_leased=int(counts[PageState.LEASED]),
            num_quarantined=int(counts[PageState.QUARANTINED]),
            num_held=int((self.holds > 0).sum()),
            num_sealed=int(counts[PageState.SEALED]) - num_idle,
            num_cached=num_idle,
            num_evictions=self.num_evictions,
        )

    def check_integrity(self) -> None:
        """Every page is in exactly one state: free + leased + sealed + quarantined == total; the free list is
        exactly the FREE pages, each once; the idle list is exactly the sealed pages nobody references; every
        leased or sealed page has one owner lease, unique across pages, and every other page none; no free page
        is held or tagged; only sealed pages have references. Raises AssertionError."""
        counts = np.bincount(self.state, minlength=len(PageState))
        assert counts.sum() == self.num_pages
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        assert len(np.unique(free)) == len(free), "page on the free list twice"
        assert len(free) == counts[PageState.FREE] and (self.state[free] == PageState.FREE).all(), (
            "free list out of sync"
        )
        self._check_owners()
        free_mask = self.state == PageState.FREE
        assert (self.holds >= 0).all() and (self.holds[free_mask] == 0).all()
        assert (self.tag[free_mask] == NO_TAG).all(), "a free page still carries a tag"
        stuck = (self.state == PageState.QUARANTINED) & (self.holds == 0)
        assert not stuck.any(), "a quarantined page that nobody holds never went back to the free list"
        self._check_sealed()

    def _check_owners(self) -> None:
        owned = (self.state == PageState.LEASED) | (self.state == PageState.SEALED)
        assert (self.owner[owned] != NO_TAG).all() and (self.owner[~owned] == NO_TAG).all(), "owner table"
        assert len(np.unique(self.owner[owned])) == int(owned.sum()), "one lease id on two pages"

    def _check_sealed(self) -> None:
        sealed = self.state == PageState.SEALED
        assert (self.refs[~sealed] == 0).all(), "references on a page that is not sealed"
        assert not self.cached[~sealed].any(), "a cached page that is not sealed"
        idle = np.fromiter(self._idle, dtype=np.int64, count=len(self._idle))
        assert sorted(idle.tolist()) == np.flatnonzero(sealed & (self.refs == 0)).tolist(), "idle list"
        assert self.cached[idle].all(), "an idle page that is not cached"
        assert (self.tag[idle] == self.owner[idle]).all(), "an idle cached page carries a foreign tag"


_RELEASABLE = (PageState.LEASED, PageState.SEALED)
