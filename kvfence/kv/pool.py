"""The page pool: who owns which KV page, under which lease, and when a page may be reused.

Boundary: bookkeeping only. The pool never touches KV tensors (the model runner owns those); it owns three small
per-page arrays that the integrity check reads in one vectorized pass:

- `owner[p]`: the lease id the allocator last handed out for page p (`NO_TAG` when not leased).
- `tag[p]`:   the lease id of the last writer of page p. A fresh lease resets it to `NO_TAG`, so a freshly
              allocated page is unreadable until its owner writes it (I1).
- `holds[p]`: how many in-flight users (a running forward step, later a network transfer) may still read or
              write page p. A released page waits in quarantine until its holds drop to zero (I4).

Page lifecycle:  FREE --allocate--> LEASED --release--> QUARANTINED --(holds == 0)--> FREE

Lease ids are 64-bit, unique for the lifetime of the pool and never reused: a per-pool random 24-bit prefix
(so two pools, e.g. a prefill and a decode worker, do not hand out the same ids) and a 40-bit counter.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from kvfence.faults import Faults
from kvfence.ids import NO_TAG, LeaseId, PageId

_COUNTER_BITS = 40


class PageState(IntEnum):
    FREE = 0
    LEASED = 1
    QUARANTINED = 2


@dataclass(frozen=True, slots=True)
class Lease:
    page: PageId
    lease: LeaseId


class PoolExhausted(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages: int
    num_free: int
    num_leased: int
    num_quarantined: int
    num_held: int


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
        self.state: npt.NDArray[np.uint8] = np.full(num_pages, PageState.FREE, dtype=np.uint8)
        self._free: deque[PageId] = deque(PageId(p) for p in range(num_pages))
        if lease_prefix is None:
            lease_prefix = int.from_bytes(os.urandom(3), "little") or 1
        assert 0 < lease_prefix < (1 << 24)
        self._next_lease = (lease_prefix << _COUNTER_BITS) + 1
        self._last_leased: list[Lease] = []  # for the double_lease fault knob only

    # ---- allocation -------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_pages: int) -> list[Lease]:
        """Lease `num_pages` free pages. Each gets a fresh lease id and an empty tag (unreadable until written)."""
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
        back to the free list once no in-flight user holds them."""
        refused = []
        for item in leases:
            page = item.page
            if self.state[page] != PageState.LEASED or int(self.owner[page]) != item.lease:
                refused.append(item)
                continue
            self.owner[page] = NO_TAG
            self.state[page] = PageState.QUARANTINED
            self._reclaim(page)
        return refused

    def hold(self, pages: Sequence[PageId] | npt.NDArray[np.int64]) -> None:
        """Mark pages as in use by an in-flight reader/writer; they cannot leave quarantine until `unhold`."""
        np.add.at(self.holds, np.asarray(pages, dtype=np.int64), 1)

    def unhold(self, pages: Sequence[PageId] | npt.NDArray[np.int64]) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        np.add.at(self.holds, idx, -1)
        assert (self.holds[idx] >= 0).all(), "unhold without matching hold"
        for page in np.unique(idx[self.state[idx] == PageState.QUARANTINED]):
            self._reclaim(PageId(int(page)))

    def _reclaim(self, page: PageId) -> None:
        if self.holds[page] == 0 and self.state[page] == PageState.QUARANTINED:
            self.state[page] = PageState.FREE
            self.tag[page] = NO_TAG
            self._free.append(page)

    # ---- tags (I1) --------------------------------------------------------------------------------------

    def stamp(self, pages: Sequence[PageId], leases: Sequence[LeaseId]) -> None:
        """Record that the holder of `leases[i]` wrote `pages[i]`. Called by the write path, after the write."""
        if self.faults.any_armed:
            pages, leases = self._maybe_skip_stamp(pages, leases)
        if pages:
            self.tag[np.asarray(pages, dtype=np.int64)] = np.asarray(leases, dtype=np.uint64)

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
        counts = np.bincount(self.state, minlength=3)
        return PoolStats(
            num_pages=self.num_pages,
            num_free=int(counts[PageState.FREE]),
            num_leased=int(counts[PageState.LEASED]),
            num_quarantined=int(counts[PageState.QUARANTINED]),
            num_held=int((self.holds > 0).sum()),
        )

    def check_integrity(self) -> None:
        """free + leased + quarantined == total; the free list is exactly the FREE pages, each once; every leased
        page has one owner and every other page none; no free page is held. Raises AssertionError."""
        s = self.stats()
        assert s.num_free + s.num_leased + s.num_quarantined == s.num_pages
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        assert len(np.unique(free)) == len(free), "page on the free list twice"
        assert len(free) == s.num_free and (self.state[free] == PageState.FREE).all(), "free list out of sync"
        leased = self.state == PageState.LEASED
        assert (self.owner[leased] != NO_TAG).all() and (self.owner[~leased] == NO_TAG).all(), "owner table"
        assert len(np.unique(self.owner[leased])) == s.num_leased, "one lease id on two pages"
        assert (self.holds >= 0).all() and (self.holds[self.state == PageState.FREE] == 0).all()
        free_mask = self.state == PageState.FREE
        assert (self.tag[free_mask] == NO_TAG).all(), "a free page still carries a tag"
        stuck = (self.state == PageState.QUARANTINED) & (self.holds == 0)
        assert not stuck.any(), "a quarantined page that nobody holds never went back to the free list"
