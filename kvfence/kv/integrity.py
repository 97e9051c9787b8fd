"""I1, read isolation: the check that runs before (and after) every forward step.

For every page in every scheduled request's block table, two facts must hold:

1. the allocator still lists the request's lease as the page's owner (nobody else was handed the page), and
2. the page's tag matches what the request has done to it: its own lease id for every page it has written,
   `NO_TAG` for pages it has not written yet (so a late write by anyone else shows up as a foreign tag).

Shared prefix-cache pages need no special case: a sealed page keeps its seal lease as owner and tag, and a
request reusing it records that same lease in its block table (kv/pool.py), so it passes only for holders of
its shared lease.

The check is one vectorized pass over the concatenated block tables of the whole batch (a few microseconds for
a batch of 64). A violation fails only the request it belongs to; the caller quarantines that request's pages.

`check_writes` (I9) runs before a step too: the pages a step is about to write must be leased, never sealed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfence.ids import NO_TAG, LeaseId, PageId, RequestId
from kvfence.kv.pool import PagePool, PageState


@dataclass(frozen=True, slots=True)
class ReadSet:
    """The pages a request is about to read, and how many of its tokens should already be in them."""

    request_id: RequestId
    pages: Sequence[PageId]
    leases: Sequence[LeaseId]
    num_written_tokens: int


@dataclass(frozen=True, slots=True)
class Violation:
    request_id: RequestId
    page: PageId
    page_index: int  # position in the request's block table
    kind: str  # "owner": allocator lists another lease; "tag": last writer is not who it should be;
    # "sealed": a step was about to write a sealed (shared, read-only) page
    expected: int
    found: int

    def as_log(self) -> dict[str, object]:
        return {
            "event": "kv_integrity_error",
            "request_id": self.request_id,
            "page": int(self.page),
            "page_index": self.page_index,
            "kind": self.kind,
            "expected_tag": f"{self.expected:#018x}",
            "found_tag": f"{self.found:#018x}",
        }


def check_reads(pool: PagePool, read_sets: Sequence[ReadSet]) -> list[Violation]:
    """Return at most one violation per request whose block table fails I1; empty when all is well."""
    if not read_sets:
        return []
    # Flat lists first, then two arrays: a step's few hundred pages cost a handful of numpy calls. This runs twice
    # per step, the second time right after the forward pass, when every numpy call starts from cold caches
    # (about 100 us for 8 rows of 15 pages, against 15 us warm), so the common path makes as few as it can:
    # expected tags are the leases themselves except for the unwritten tails, and the failure path alone
    # works out which page failed how.
    pages_l: list[int] = []
    leases_l: list[int] = []
    unwritten: list[tuple[int, int]] = []  # [start, end) of each row's pages not written yet
    for rs in read_sets:
        n = len(rs.pages)
        written = max(0, min(pool.pages_for(rs.num_written_tokens), n))  # the first `written` carry its tag
        if written < n:
            unwritten.append((len(pages_l) + written, len(pages_l) + n))
        pages_l += rs.pages
        leases_l += rs.leases
    pages = np.array(pages_l, dtype=np.int64)
    leases = np.array(leases_l, dtype=np.uint64)
    expected_tag = leases
    if unwritten:
        expected_tag = leases.copy()
        for begin, end in unwritten:
            expected_tag[begin:end] = NO_TAG
    owner = pool.owner[pages]
    tag = pool.tag[pages]
    if (owner == leases).all() and (tag == expected_tag).all():
        return []
    bad = (owner != leases) | (tag != expected_tag)
    violations: dict[int, Violation] = {}
    bad_at = set(np.flatnonzero(bad).tolist())
    start = 0
    for row, rs in enumerate(read_sets):  # the first bad page of each failing row
        for index in range(len(rs.pages)):
            i = start + index
            if i not in bad_at:
                continue
            owner_bad = owner[i] != leases[i]
            violations[row] = Violation(
                request_id=rs.request_id,
                page=PageId(int(pages[i])),
                page_index=index,
                kind="owner" if owner_bad else "tag",
                expected=int(leases[i] if owner_bad else expected_tag[i]),
                found=int(owner[i] if owner_bad else tag[i]),
            )
            break
        start += len(rs.pages)
    return list(violations.values())


class StepReads:
    """One step's block tables as arrays, built once for both of its checks: before the forward pass, and after
    it (when the pages the step wrote must carry their writer's tag). Nothing changes a block table during a
    step, so only the expected tags differ between the two. The check after the pass runs on caches the pass
    has just emptied, where each Python and numpy call costs several times its warm price; with the arrays
    ready it is two gathers and two byte comparisons (148 to 32 us for 8 rows of 15 pages,
    docs/performance.md). A mismatch falls back to `check_reads`, which finds the failing page of each row."""

    __slots__ = ("_expected", "after", "before", "leases", "pages")

    def __init__(self, pool: PagePool, before: Sequence[ReadSet], after: Sequence[ReadSet]) -> None:
        self.before, self.after = before, after
        pages_l: list[int] = []
        leases_l: list[int] = []
        unwritten: list[tuple[int, int, int]] = []  # [start, end) not written before, [mid, end) nor after
        for b, a in zip(before, after, strict=True):
            n, base = len(b.pages), len(pages_l)
            first = max(0, min(pool.pages_for(b.num_written_tokens), n))
            then = max(first, min(pool.pages_for(a.num_written_tokens), n))
            if first < n:
                unwritten.append((base + first, base + then, base + n))
            pages_l += b.pages
            leases_l += b.leases
        self.pages = np.array(pages_l, dtype=np.int64)
        self.leases = np.array(leases_l, dtype=np.uint64)
        tags_before, tags_after = self.leases.copy(), self.leases.copy()
        for start, mid, end in unwritten:
            tags_before[start:end] = NO_TAG
            tags_after[mid:end] = NO_TAG
        self._expected = (self.leases.tobytes(), tags_before.tobytes(), tags_after.tobytes())

    def check(self, pool: PagePool, after_step: bool) -> list[Violation]:
        owners, tags_before, tags_after = self._expected
        if pool.owner[self.pages].tobytes() == owners and pool.tag[self.pages].tobytes() == (
            tags_after if after_step else tags_before
        ):
            return []
        return check_reads(pool, self.after if after_step else self.before)


@dataclass(frozen=True, slots=True)
class WriteSet:
    """The pages a request's next step writes: its block table from index `first` on."""

    request_id: RequestId
    pages: Sequence[PageId]
    leases: Sequence[LeaseId]
    first: int


def check_writes(pool: PagePool, write_sets: Sequence[WriteSet]) -> list[Violation]:
    """I9: no step may write a sealed page. At most one violation per request about to write one."""
    counts = [len(ws.pages) - ws.first for ws in write_sets]
    pages = np.fromiter(
        (p for ws in write_sets for p in ws.pages[ws.first :]), dtype=np.int64, count=sum(counts)
    )
    sealed = pool.state[pages] == PageState.SEALED
    if not sealed.any():
        return []
    row_of = np.repeat(np.arange(len(write_sets)), counts)
    violations: dict[int, Violation] = {}
    for i in np.flatnonzero(sealed):
        row = int(row_of[i])
        ws = write_sets[row]
        index = ws.first + int(i) - sum(counts[:row])
        violations.setdefault(
            row,
            Violation(
                ws.request_id, ws.pages[index], index, "sealed", ws.leases[index], int(pool.owner[pages[i]])
            ),
        )
    return list(violations.values())
