"""The prefix cache (I7, I9): full KV pages, sealed and shared read-only, found by a tenant-scoped hash chain.

Boundary: bookkeeping only, torch-free. The pool (kv/pool.py) owns page states and reference counts; this module
owns the index from content keys to sealed pages and each page's content digest. Digests come from a callable
the engine passes in (the model runner reads the KV bytes), so this module never sees a tensor.

Keys. Page i of a sequence (tokens [i*P, (i+1)*P)) is named by a hash chain

    key_0 = H(H(scope) || tokens_0),   key_i = H(key_{i-1} || tokens_i)        H = BLAKE2b-128

where the scope is the tenant of the authenticated API key (never a request field). Only full pages have keys,
so a partial last page is never shared. An entry also stores its scope, parent key and tokens, and a hit
compares all three: not even a hash collision can hand one tenant's page to another (I7).

Lifecycle of a cached page:
  1. `seal`: a step filled the page and passed I1. Its digest (xxh3-64 over its K/V bytes) is taken, the pool
     marks it SEALED (read-only, the writer keeps one reference) and the index records it. If the key is
     already indexed (two requests computed the same prefix at once), the page stays an ordinary leased page.
  2. `match` -> `verify` -> `acquire`: a new request's longest cached prefix is looked up under its own scope.
     Pages that sat idle (no references) are re-verified against their digest first: a bit flip or a stray
     write while nobody looked ends the hit there, and the page is evicted through quarantine (the request
     recomputes it). Then each page gets one more reference under its shared lease.
  3. release (pool): references drop; at zero the page is idle, counts as free, and waits in LRU order.
  4. eviction: an allocation that needs the page (pool, LRU), a digest failure, or a canary failure.
`canary` re-verifies a few cached pages round-robin, every `--kv-canary-interval` steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfence.faults import Faults
from kvfence.ids import LeaseId, PageId
from kvfence.kv.pool import Lease, PagePool

DigestFn = Callable[[Sequence[PageId]], list[int]]
integrity_log = logging.getLogger("kvfence.integrity")
_KEY_VERSION = b"kvfence/prefix-cache/v1\0"


@dataclass(frozen=True, slots=True)
class CachedPage:
    key: bytes
    parent: bytes | None  # the previous page's key; None for a sequence's first page
    scope: str  # the tenant whose requests may reuse it (and its cache salt, after a NUL: `scope_for`)

    @property
    def tenant(self) -> str:
        return self.scope.split("\x00", 1)[0]

    tokens: tuple[int, ...]
    page: PageId
    lease: LeaseId  # the shared lease: the page's owner and tag while it is sealed
    digest: int  # xxh3-64 of the page's K/V bytes, taken at sealing


@dataclass(frozen=True, slots=True)
class DigestFailure:
    entry: CachedPage
    found: int
    where: str  # "reuse" or "canary"
    in_use: bool  # requests hold the page: the engine fails them

    def as_log(self) -> dict[str, object]:
        return {
            "event": "kv_digest_mismatch",
            "page": int(self.entry.page),
            "lease": f"{int(self.entry.lease):#018x}",
            "tenant": self.entry.tenant,
            "expected_digest": f"{self.entry.digest:#018x}",
            "found_digest": f"{self.found:#018x}",
            "where": self.where,
            "in_use": self.in_use,
        }


@dataclass(slots=True)
class TenantCacheStats:
    queried_tokens: int = 0  # tokens of the sequences looked up (each time a prefill starts)
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    num_cached_pages: int  # sealed pages in the index (in use or idle)
    num_idle_pages: int  # of those, pages nobody references (evictable)
    evictions: int  # idle pages evicted to make room
    digest_failures: int
    pages_verified: int  # digests re-checked, on reuse and by the canary
    seal_seconds: float  # time spent taking digests at sealing
    verify_seconds: float  # time spent re-checking digests
    tenants: dict[str, TenantCacheStats] = field(default_factory=dict)


def root_key(scope: str) -> bytes:
    return hashlib.blake2b(_KEY_VERSION + scope.encode(), digest_size=16).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, pool: PagePool, digest_of: DigestFn, faults: Faults | None = None) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.digest_of = digest_of
        self.faults = faults or Faults()
        self._by_key: dict[bytes, CachedPage] = {}
        self._by_page: dict[PageId, CachedPage] = {}
        self._canary_next = 0  # the page id the next canary check starts from
        self.tenants: dict[str, TenantCacheStats] = {}
        self.digest_failures = 0
        self.pages_verified = 0
        self.seal_seconds = 0.0
        self.verify_seconds = 0.0
        pool.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._by_page)

    # ---- keys -------------------------------------------------------------------------------------------

    def scope_for(self, tenant: str, salt: str = "") -> str:
        """The cache scope of a request: its tenant, narrowed by its `cache_salt` when it sends one (a salt
        never widens sharing: the scope still holds the tenant; tenants and salts hold no NUL, so the two
        parts cannot be confused). Fault knob `shared_prefix_cache` drops the tenant (the historical
        cross-tenant bug): the request's pages are found by, and find, every tenant's."""
        if self.faults.fire("shared_prefix_cache"):
            return ""
        return f"{tenant}\x00{salt}" if salt else tenant

    def extend_keys(self, scope: str, token_ids: Sequence[int], keys: list[bytes], num_pages: int) -> None:
        """Extend `keys` (a request's chain so far, mutated) to cover its first `num_pages` full pages."""
        P = self.page_size
        assert num_pages * P <= len(token_ids)
        parent = keys[-1] if keys else root_key(scope)
        for i in range(len(keys), num_pages):
            parent = chain_key(parent, token_ids[i * P : (i + 1) * P])
            keys.append(parent)

    # ---- reuse ------------------------------------------------------------------------------------------

    def match(
        self, scope: str, token_ids: Sequence[int], keys: list[bytes], max_pages: int
    ) -> list[CachedPage]:
        """The longest run of cached pages, from the first, that this scope may reuse for `token_ids`, at most
        `max_pages`. Changes nothing but `keys` (extended)."""
        P = self.page_size
        self.extend_keys(scope, token_ids, keys, max_pages)
        hit: list[CachedPage] = []
        parent = None
        for i in range(max_pages):
            entry = self._by_key.get(keys[i])
            if entry is None or entry.scope != scope or entry.parent != parent:
                break
            if entry.tokens != tuple(token_ids[i * P : (i + 1) * P]):
                break
            hit.append(entry)
            parent = entry.key
        return hit

    def verify(self, hit: list[CachedPage]) -> list[CachedPage]:
        """Re-check the digest of every idle page of `hit` (it sat unreferenced, so no I1 check looked at it).
        Returns the part of `hit` before the first corrupt page; corrupt pages are evicted (quarantine)."""
        idle = [e for e in hit if self.pool.is_idle(e.page)]
        if not idle:
            return hit
        failures = self._check(idle, "reuse")
        if not failures:
            return hit
        first_bad = min(hit.index(f.entry) for f in failures)
        return hit[:first_bad]

    def acquire(self, hit: Sequence[CachedPage]) -> list[Lease]:
        """Take a reference on each page of `hit` (from `match`/`verify`, with nothing evicted since); the
        caller puts the returned shared leases in its block table and releases them through the pool."""
        for e in hit:
            ok = self.pool.share(e.page, e.lease)
            assert ok, f"page {e.page} left the cache between match and acquire"
        return [Lease(e.page, e.lease) for e in hit]

    def record(self, tenant: str, queried_tokens: int, hit_tokens: int) -> None:
        stats = self.tenants.setdefault(tenant, TenantCacheStats())
        stats.queried_tokens += queried_tokens
        stats.hit_tokens += hit_tokens

    # ---- sealing ----------------------------------------------------------------------------------------

    def seal(
        self,
        scope: str,
        token_ids: Sequence[int],
        keys: list[bytes],
        leases: Sequence[Lease],
        start: int,
    ) -> None:
        """Seal and index pages [start, len(leases)) of a request's block table, which its steps filled (and
        I1 verified). Pages the pool refuses (not written by their holder) and keys already indexed are left
        as ordinary leased pages."""
        P, end = self.page_size, len(leases)
        self.extend_keys(scope, token_ids, keys, end)
        todo = [i for i in range(start, end) if keys[i] not in self._by_key]
        todo = [i for i in todo if self.pool.can_seal(leases[i].page, leases[i].lease)]
        if not todo:
            return
        t0 = time.perf_counter()
        digests = self.digest_of([leases[i].page for i in todo])
        self.seal_seconds += time.perf_counter() - t0
        for i, digest in zip(todo, digests, strict=True):
            page, lease = leases[i].page, leases[i].lease
            assert self.pool.seal(page, lease)
            parent = keys[i - 1] if i else None
            entry = CachedPage(
                keys[i], parent, scope, tuple(token_ids[i * P : (i + 1) * P]), page, lease, digest
            )
            self._by_key[entry.key] = entry
            self._by_page[page] = entry

    # ---- digests ----------------------------------------------------------------------------------------

    def canary(self, num_pages: int) -> list[DigestFailure]:
        """Re-verify up to `num_pages` cached pages, round-robin over page ids. Corrupt pages leave the cache
        (idle ones at once, through quarantine; held ones when released). Failures of held pages are returned
        with `in_use`: their holders read corrupt K/V and must fail."""
        cached = np.flatnonzero(self.pool.cached)
        if not len(cached) or num_pages < 1:
            return []
        start = int(np.searchsorted(cached, self._canary_next))
        picked = np.roll(cached, -start)[:num_pages]
        self._canary_next = int(picked[-1]) + 1
        return self._check([self._by_page[PageId(int(p))] for p in picked], "canary")

    def _check(self, entries: list[CachedPage], where: str) -> list[DigestFailure]:
        t0 = time.perf_counter()
        found = self.digest_of([e.page for e in entries])
        self.verify_seconds += time.perf_counter() - t0
        self.pages_verified += len(entries)
        failures = []
        for e, digest in zip(entries, found, strict=True):
            if digest == e.digest:
                continue
            failure = DigestFailure(e, digest, where, in_use=not self.pool.is_idle(e.page))
            integrity_log.error(json.dumps(failure.as_log()))
            self.digest_failures += 1
            self.pool.uncache(e.page)
            failures.append(failure)
        return failures

    # ---- bookkeeping ------------------------------------------------------------------------------------

    def _forget(self, page: PageId) -> None:
        """Pool callback: `page` left the cache (evicted, uncached, or found with a foreign tag)."""
        entry = self._by_page.pop(page, None)
        if entry is not None and self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_cached_pages=len(self._by_page),
            num_idle_pages=self.pool.num_cached,
            evictions=self.pool.num_evictions,
            digest_failures=self.digest_failures,
            pages_verified=self.pages_verified,
            seal_seconds=self.seal_seconds,
            verify_seconds=self.verify_seconds,
            tenants={t: TenantCacheStats(s.queried_tokens, s.hit_tokens) for t, s in self.tenants.items()},
        )

    def check_integrity(self) -> None:
        """The index holds exactly the pool's cached pages, each under its current owner lease, one entry
        per key and per page. Raises AssertionError."""
        cached = set(np.flatnonzero(self.pool.cached).tolist())
        assert set(self._by_page) == cached, "index and pool disagree on which pages are cached"
        assert len(self._by_key) == len(self._by_page), "two entries for one key, or a stale key"
        for page, entry in self._by_page.items():
            assert entry.page == page and self._by_key.get(entry.key) is entry
            assert int(self.pool.owner[page]) == entry.lease, f"cached page {page} under a foreign lease"
