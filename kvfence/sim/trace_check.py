"""Check a recorded page-event trace (kvfence/trace.py) against the isolation invariants.

The trace can come from the simulator or from real processes (`KVFENCE_TRACE=DIR`, one file per process). The
checker replays it on a shadow of each node's pool, built only from the events, and reports every step that
breaks an invariant:

- I1  a step reads a page that is not leased (or sealed) under the reader's lease, or that the reader should
      have written and the last stamp on it is not the reader's;
- I2  a transfer frame lands on a page that its transfer's lease no longer owns; a stamp by a non-owner;
- I4  a page is leased again before it went back to the free list, or freed while a step holds it;
- leases are never reused within a pool;
- pool consistency: releases, seals, shares and quarantines happen only from the states that allow them.

Shadow states: free (the default), leased, sealed (shared, with a reference count), quarantined.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FREE, LEASED, SEALED, QUARANTINED = "free", "leased", "sealed", "quarantined"


@dataclass
class _Pool:
    state: dict[int, str] = field(default_factory=lambda: defaultdict(lambda: FREE))
    owner: dict[int, int] = field(default_factory=dict)
    tag: dict[int, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    holds: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    leases: set[int] = field(default_factory=set)


@dataclass
class TraceReport:
    events: int = 0
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def ok(self) -> bool:
        return not self.violations


class TraceChecker:
    def __init__(self) -> None:
        self.pools: dict[str, _Pool] = defaultdict(_Pool)
        self.report = TraceReport()

    def check(self, events: Iterable[dict[str, Any]]) -> TraceReport:
        for event in events:
            self.feed(event)
        return self.report

    def feed(self, e: dict[str, Any]) -> None:
        self.report.events += 1
        self.report.counts[e["ev"]] += 1
        handler = getattr(self, f"_on_{e['ev']}", None)
        if handler is not None:
            handler(self.pools[e.get("node", "")], e)

    def _bad(self, e: dict[str, Any], what: str) -> None:
        where = f"event {self.report.events} ({e['ev']} on {e.get('node') or '?'})"
        self.report.violations.append(f"{where}: {what}")

    # ---- the pool --------------------------------------------------------------------------------------

    def _on_alloc(self, pool: _Pool, e: dict[str, Any]) -> None:
        page, lease = e["page"], e["lease"]
        if pool.state[page] != FREE:
            self._bad(e, f"I4: page {page} leased while {pool.state[page]}")
        if lease in pool.leases:
            self._bad(e, f"lease {lease:#x} handed out twice")
        pool.leases.add(lease)
        pool.state[page], pool.owner[page], pool.tag[page] = LEASED, lease, 0

    def _on_stamp(self, pool: _Pool, e: dict[str, Any]) -> None:
        for page, lease in zip(e["pages"], e["leases"], strict=True):
            if pool.state[page] != LEASED or pool.owner.get(page) != lease:
                self._bad(
                    e, f"I2: page {page} stamped by lease {lease:#x}, owned by {pool.owner.get(page, 0):#x}"
                )
            pool.tag[page] = lease

    def _on_seal(self, pool: _Pool, e: dict[str, Any]) -> None:
        page, lease = e["page"], e["lease"]
        if pool.state[page] != LEASED or pool.owner.get(page) != lease or pool.tag.get(page) != lease:
            self._bad(e, f"page {page} sealed by {lease:#x} while {pool.state[page]}, not written by it")
        pool.state[page], pool.refs[page] = SEALED, 1

    def _on_share(self, pool: _Pool, e: dict[str, Any]) -> None:
        page, lease = e["page"], e["lease"]
        if pool.state[page] != SEALED or pool.owner.get(page) != lease:
            self._bad(e, f"page {page} shared under {lease:#x} while {pool.state[page]}")
        pool.refs[page] += 1

    def _on_release(self, pool: _Pool, e: dict[str, Any]) -> None:
        page, lease = e["page"], e["lease"]
        owned = pool.owner.get(page) == lease and pool.state[page] in (LEASED, SEALED)
        if owned != e["ok"]:
            self._bad(e, f"pool {'released' if e['ok'] else 'refused'} page {page} for lease {lease:#x} "
                      f"while it is {pool.state[page]} under {pool.owner.get(page, 0):#x}")  # fmt: skip
        if e["ok"] and pool.state[page] == SEALED:
            pool.refs[page] -= 1
            if pool.refs[page] < 0:
                self._bad(e, f"sealed page {page} released more often than shared")

    def _on_quarantine(self, pool: _Pool, e: dict[str, Any]) -> None:
        page = e["page"]
        if pool.state[page] not in (LEASED, SEALED) or (pool.state[page] == SEALED and pool.refs[page] > 0):
            self._bad(
                e, f"page {page} quarantined while {pool.state[page]} with {pool.refs[page]} references"
            )
        pool.state[page], pool.owner[page], pool.refs[page] = QUARANTINED, 0, 0

    def _on_reclaim(self, pool: _Pool, e: dict[str, Any]) -> None:
        page = e["page"]
        if pool.state[page] != QUARANTINED:
            self._bad(e, f"page {page} freed while {pool.state[page]}")
        if pool.holds[page] > 0:
            self._bad(e, f"I4: page {page} freed while {pool.holds[page]} step(s) hold it")
        pool.state[page] = FREE

    def _on_hold(self, pool: _Pool, e: dict[str, Any]) -> None:
        for page in e["pages"]:
            pool.holds[page] += 1

    def _on_unhold(self, pool: _Pool, e: dict[str, Any]) -> None:
        for page in e["pages"]:
            pool.holds[page] -= 1

    # ---- readers and writers ---------------------------------------------------------------------------

    def _on_read(self, pool: _Pool, e: dict[str, Any]) -> None:
        """A step (or a transfer's frame reads) is about to read these pages; the first `written` must hold
        the reader's own K/V."""
        for i, (page, lease) in enumerate(zip(e["pages"], e["leases"], strict=True)):
            if pool.state[page] not in (LEASED, SEALED) or pool.owner.get(page) != lease:
                self._bad(e, f"I1: {e['request_id']} reads page {page} ({pool.state[page]}, owner "
                          f"{pool.owner.get(page, 0):#x}) under lease {lease:#x}")  # fmt: skip
                return
            if i < e["written"] and pool.tag.get(page) != lease:
                self._bad(e, f"I1: {e['request_id']} reads page {page} last written by "
                          f"{pool.tag.get(page, 0):#x}, not by its lease {lease:#x}")  # fmt: skip
                return

    def _on_apply(self, pool: _Pool, e: dict[str, Any]) -> None:
        page, lease = e["page"], e["lease"]
        if pool.state[page] != LEASED or pool.owner.get(page) != lease:
            self._bad(e, f"I2: frame of transfer {e['tid']} lands on page {page} ({pool.state[page]}, owner "
                      f"{pool.owner.get(page, 0):#x}) under lease {lease:#x}")  # fmt: skip


def read_events(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Events of one or more trace files, in file order (each file is one process; their pools are separate,
    so the order between files does not matter)."""
    for path in paths:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def check_files(paths: Iterable[Path]) -> TraceReport:
    return TraceChecker().check(read_events(paths))


def main(argv: list[str] | None = None) -> int:
    """python -m kvfence.sim.trace_check DIR|FILE...: exit 1 and list the violations, 0 when clean."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvfence.sim.trace_check", description=main.__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="trace files, or directories of *.jsonl")
    args = p.parse_args(argv)
    files = [f for path in args.paths for f in (sorted(path.glob("*.jsonl")) if path.is_dir() else [path])]
    report = check_files(files)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
    print(f"{len(files)} file(s), {report.events} events ({counts})")
    for line in report.violations[:50]:
        print(f"VIOLATION {line}")
    print("clean" if report.ok else f"{len(report.violations)} violation(s)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
