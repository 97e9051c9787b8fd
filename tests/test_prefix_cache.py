"""Pure tests of the prefix cache and sealed pages (I7, I9): keys, tenant scoping, shared leases under the I1
check, reference counts, LRU eviction through quarantine (I4), digests, and the write check. No model, no torch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

from kvfence.faults import Faults
from kvfence.ids import NO_TAG, LeaseId, PageId, RequestId
from kvfence.kv.integrity import ReadSet, WriteSet, check_reads, check_writes
from kvfence.kv.pool import Lease, PagePool, PageState, PoolExhausted
from kvfence.kv.prefix_cache import CachedPage, PrefixCache

P = 4  # tokens per page


class FakeKV:
    """Page contents as plain integers, so that digests are real functions of content."""

    def __init__(self, num_pages: int) -> None:
        self.content = [0] * num_pages

    def digests(self, pages: Sequence[PageId]) -> list[int]:
        return [hash(("page", self.content[p])) & (2**64 - 1) for p in pages]


def make(num_pages: int = 16, faults: Faults | None = None) -> tuple[PagePool, PrefixCache, FakeKV]:
    pool = PagePool(num_pages, P, lease_prefix=5, faults=faults)
    kv = FakeKV(num_pages)
    return pool, PrefixCache(pool, kv.digests, pool.faults), kv


def prefill(pool: PagePool, cache: PrefixCache, kv: FakeKV, tenant: str, tokens: list[int]) -> list[Lease]:
    """A request that computes all of `tokens` itself and seals its full pages (what the scheduler does)."""
    leases = pool.allocate(pool.pages_for(len(tokens)))
    for i, x in enumerate(leases):
        kv.content[x.page] = hash(tuple(tokens[: (i + 1) * P]))
    pool.stamp([x.page for x in leases], [x.lease for x in leases])
    full = len(tokens) // P
    cache.seal(cache.scope_for(tenant), tokens, [], leases[:full], 0)
    return leases


TOKENS = list(range(10, 24))  # 14 tokens: 3 full pages and a partial one


def test_full_pages_are_sealed_partial_page_is_not():
    pool, cache, kv = make()
    leases = prefill(pool, cache, kv, "a", TOKENS)
    states = [PageState(pool.state[x.page]) for x in leases]
    assert states == [PageState.SEALED] * 3 + [PageState.LEASED]
    assert len(cache) == 3
    # a sealed page keeps its writer's lease as owner and tag: the writer's own I1 check is unchanged
    table = ReadSet(RequestId("a"), [x.page for x in leases], [x.lease for x in leases], len(TOKENS))
    assert check_reads(pool, [table]) == []
    pool.check_integrity()
    cache.check_integrity()


def test_same_tenant_matches_longest_prefix_other_tenant_never():
    pool, cache, kv = make()
    prefill(pool, cache, kv, "a", TOKENS)
    same = cache.match("a", [*TOKENS[:9], 99, 98, 97], [], 2)
    assert [e.tokens for e in same] == [tuple(TOKENS[:4]), tuple(TOKENS[4:8])]
    assert cache.match("b", TOKENS, [], 3) == []
    diverged = cache.match("a", [TOKENS[0], 99, *TOKENS[2:]], [], 3)
    assert diverged == [], "a page whose prefix differs has another key"


def test_keys_chain_over_pages_and_fold_in_the_tenant():
    _, cache, _ = make()
    ka: list[bytes] = []
    cache.extend_keys("a", TOKENS, ka, 3)
    kb: list[bytes] = []
    cache.extend_keys("b", TOKENS, kb, 3)
    assert len(set(ka) | set(kb)) == 6, "every page key differs across tenants"
    longer = list(ka[:1])
    cache.extend_keys("a", TOKENS, longer, 3)
    assert longer == ka, "keys extend incrementally"
    with pytest.raises(AssertionError):
        cache.extend_keys("a", TOKENS, [], 4)  # the partial page has no key


def test_a_key_collision_still_cannot_cross_tenants():
    """Entries carry their scope, parent and tokens; a lookup compares them, so even an entry planted under
    tenant b's key (a hash collision) is not handed to b."""
    pool, cache, kv = make()
    leases = prefill(pool, cache, kv, "a", TOKENS)
    kb: list[bytes] = []
    cache.extend_keys("b", TOKENS, kb, 1)
    planted = cache._by_page[leases[0].page]
    cache._by_key[kb[0]] = planted
    assert cache.match("b", TOKENS, kb, 3) == []
    tampered = CachedPage(kb[0], None, "b", (1, 2, 3, 4), planted.page, planted.lease, planted.digest)
    cache._by_key[kb[0]] = tampered
    assert cache.match("b", TOKENS, kb, 3) == [], "tokens are compared too"


def test_shared_lease_passes_i1_only_for_its_holders():
    pool, cache, kv = make()
    writer = prefill(pool, cache, kv, "a", TOKENS)
    hit = cache.verify(cache.match("a", TOKENS, [], 3))
    shared = cache.acquire(hit)
    own = pool.allocate(1)
    table = [*shared, *own]
    reader = ReadSet(RequestId("r"), [x.page for x in table], [x.lease for x in table], 12)
    assert check_reads(pool, [reader]) == []
    assert [x.lease for x in shared] == [x.lease for x in writer[:3]]
    assert pool.refs[shared[0].page] == 2
    # a request that claims the page under any other lease fails the owner check
    forged = ReadSet(RequestId("f"), [shared[0].page], [LeaseId(int(shared[0].lease) + 1)], 4)
    (v,) = check_reads(pool, [forged])
    assert v.kind == "owner"


def test_refcounts_idle_lru_and_eviction_through_quarantine():
    pool, cache, kv = make(num_pages=5)
    writer = prefill(pool, cache, kv, "a", TOKENS)  # 3 sealed + 1 leased
    reader = cache.acquire(cache.verify(cache.match("a", TOKENS, [], 3)))
    pool.release(reversed(writer))  # the scheduler releases the last page first
    assert pool.num_cached == 0 and pool.stats().num_sealed == 3, "the reader still holds all three"
    pool.release(reversed(reader))
    assert pool.num_cached == 3 and pool.num_free == 5 and pool.stats().num_sealed == 0
    pool.check_integrity()
    cache.check_integrity()
    # allocation evicts the tail first (released first), keeping the head of the sequence reusable
    pool.hold([writer[0].page])  # an in-flight step still reads the head: never evicted while held
    got = pool.allocate(4)
    assert {x.page for x in got} == {PageId(4), writer[3].page, writer[2].page, writer[1].page}
    assert pool.num_evictions == 2 and len(cache) == 1
    assert not pool.can_allocate(1) and pool.num_free == 1
    with pytest.raises(PoolExhausted, match="asked for 1 pages, 0 free"):
        pool.allocate(1)
    assert pool.is_idle(writer[0].page) and len(cache) == 1
    pool.unhold([writer[0].page])
    (last,) = pool.allocate(1)
    assert last.page == writer[0].page and len(cache) == 0
    pool.check_integrity()
    cache.check_integrity()


def test_stale_shared_lease_after_eviction_is_refused():
    pool, cache, kv = make(num_pages=4)
    writer = prefill(pool, cache, kv, "a", TOKENS[:8])
    pool.release(reversed(writer))
    hit = cache.match("a", TOKENS, [], 2)
    new = pool.allocate(4)  # evicts both idle pages; the same page ids now belong to someone else
    assert not pool.share(hit[0].page, hit[0].lease)
    stale = ReadSet(RequestId("s"), [hit[0].page], [hit[0].lease], 4)
    assert check_reads(pool, [stale])[0].kind == "owner"
    assert pool.release([Lease(hit[0].page, hit[0].lease)]) == [Lease(hit[0].page, hit[0].lease)]
    pool.release(new)
    pool.check_integrity()


def test_digest_mismatch_on_reuse_evicts_and_truncates_the_hit():
    pool, cache, kv = make()
    writer = prefill(pool, cache, kv, "a", TOKENS)
    pool.release(reversed(writer))
    kv.content[writer[1].page] ^= 1  # a bit flip while the page sat idle
    hit = cache.verify(cache.match("a", TOKENS, [], 3))
    assert [e.page for e in hit] == [writer[0].page]
    assert cache.digest_failures == 1 and pool.state[writer[1].page] == PageState.FREE
    assert cache.match("a", TOKENS, [], 3) == hit, "the corrupt page is gone from the index"
    pool.check_integrity()
    cache.check_integrity()


def test_canary_round_robin_and_corrupt_page_in_use():
    pool, cache, kv = make()
    writer = prefill(pool, cache, kv, "a", TOKENS)
    assert cache.canary(2) == [] and cache.canary(2) == [] and cache.pages_verified == 4
    kv.content[writer[0].page] ^= 1
    (failure,) = cache.canary(3)
    assert failure.in_use and failure.where == "canary"
    # still held by its writer: it stays sealed (readable by the holder until the engine fails it), leaves
    # the cache at once and is quarantined, not made idle, when released
    assert pool.state[writer[0].page] == PageState.SEALED and not pool.cached[writer[0].page]
    assert cache.match("a", TOKENS, [], 3) == []
    pool.release(reversed(writer))
    assert pool.state[writer[0].page] == PageState.FREE and pool.num_cached == 2
    pool.check_integrity()
    cache.check_integrity()


def test_foreign_write_on_a_sealed_page_keeps_it_out_of_the_cache():
    pool, cache, kv = make()
    writer = prefill(pool, cache, kv, "a", TOKENS)
    pool.stamp([writer[0].page], [LeaseId(0xBAD)])  # a stray late write lands on a sealed page
    table = ReadSet(RequestId("a"), [x.page for x in writer], [x.lease for x in writer], 14)
    assert check_reads(pool, [table])[0].kind == "tag"
    pool.release(reversed(writer))
    assert pool.state[writer[0].page] == PageState.FREE and len(cache) == 2
    pool.check_integrity()
    cache.check_integrity()


def test_write_check_refuses_sealed_pages():
    pool, cache, kv = make()
    writer = prefill(pool, cache, kv, "a", TOKENS)
    pages, leases = [x.page for x in writer], [x.lease for x in writer]
    assert check_writes(pool, [WriteSet(RequestId("a"), pages, leases, 3)]) == []
    (v,) = check_writes(pool, [WriteSet(RequestId("a"), pages, leases, 1)])
    assert (v.kind, v.page, v.page_index) == ("sealed", pages[1], 1)


def test_seal_refuses_unwritten_and_foreign_pages():
    pool, cache, _ = make()
    leases = pool.allocate(2)
    assert not pool.seal(leases[0].page, leases[0].lease), "not written: tag is NO_TAG"
    pool.stamp([leases[1].page], [leases[1].lease])
    assert not pool.seal(leases[1].page, LeaseId(7)), "someone else's lease"
    assert pool.seal(leases[1].page, leases[1].lease)
    assert pool.tag[leases[0].page] == NO_TAG
    cache.seal("a", list(range(8)), [], leases, 0)  # page 0 unwritten: left alone; page 1 already sealed
    assert len(cache) == 0


def test_duplicate_prefix_stays_an_ordinary_leased_page():
    pool, cache, kv = make()
    first = prefill(pool, cache, kv, "a", TOKENS)
    second = prefill(pool, cache, kv, "a", TOKENS)  # computed concurrently: same keys already indexed
    assert all(pool.state[x.page] == PageState.LEASED for x in second)
    pool.release(reversed(second))
    pool.release(reversed(first))
    assert pool.num_cached == 3 and pool.num_free == 16
    pool.check_integrity()
    cache.check_integrity()


def test_shared_prefix_cache_knob_drops_the_tenant_from_keys():
    pool, cache, kv = make(faults=Faults(shared_prefix_cache=2))
    prefill(pool, cache, kv, "a", TOKENS)  # first shot: tenant a's pages go in unscoped
    scope_b = cache.scope_for("b")  # second shot: tenant b looks up unscoped
    assert len(cache.match(scope_b, TOKENS, [], 3)) == 3
    assert cache.match(cache.scope_for("b"), TOKENS, [], 3) == [], "knob spent: scoped again"


def test_prefix_cache_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\nimport kvfence.kv.prefix_cache, kvfence.engine.scheduler\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
