"""Allocator integrity under random interleavings of cache hits, evictions, aborts, preemptions, bit flips and
canary checks: the real scheduler, pool and prefix cache, over a fake model whose "K/V" at a position is a hash of
the sequence up to it. Every step checks that each request reads exactly its own sequence's K/V (never another
tenant's, never a corrupt page), that I1 and the write check (I9) pass, and every pool and cache invariant."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence.config import SchedulerOptions
from kvfence.engine.plan import Plan
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.engine.scheduler import Scheduler
from kvfence.ids import PageId, RequestId
from kvfence.kv.integrity import ReadSet, WriteSet, check_reads, check_writes
from kvfence.kv.pool import PagePool, PageState
from kvfence.kv.prefix_cache import PrefixCache

P = 4
NUM_PAGES = 10
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 11, 12, 13, 14], [21, 22, 23, 24, 25]]


def kv_value(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[: pos + 1]))


class FakeModel:
    """Slots hold the hash of the sequence they were computed for; digests hash whole pages."""

    def __init__(self) -> None:
        self.slots = [0] * (NUM_PAGES * P)

    def digests(self, pages: list[PageId]) -> list[int]:
        return [hash(tuple(self.slots[p * P : (p + 1) * P])) & (2**64 - 1) for p in pages]

    def run(self, plan: Plan, requests: dict[RequestId, Request]) -> dict[RequestId, int]:
        sampled = {}
        for row in plan.rows:
            tokens = requests[row.request_id].token_ids
            for pos in range(row.start_pos):  # what attention reads: must be this sequence's own K/V
                got = self.slots[row.pages[pos // P] * P + pos % P]
                assert got == kv_value(tokens, pos), f"{row.request_id} read foreign or corrupt K/V at {pos}"
            for pos in range(row.start_pos, row.context_len):
                self.slots[row.pages[pos // P] * P + pos % P] = kv_value(tokens, pos)
            if row.sample:
                sampled[row.request_id] = 30 + kv_value(tokens, row.context_len - 1) % 20
        return sampled


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(NUM_PAGES, P, lease_prefix=9)
        self.model = FakeModel()
        self.cache = PrefixCache(self.pool, self.model.digests)
        config = SchedulerOptions(max_num_seqs=4, max_num_batched_tokens=10)
        self.scheduler = Scheduler(config, 64, self.pool, (), self.cache)
        self.requests: dict[RequestId, Request] = {}
        self.count = 0
        self.flipped = 0

    @rule(
        tenant=st.sampled_from(["a", "b"]),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(40, 45), max_size=6),
        max_tokens=st.integers(1, 10),
    )
    def add(self, tenant: str, prefix: list[int], suffix: list[int], max_tokens: int) -> None:
        rid = RequestId(f"r{self.count}")
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request = Request(rid, [*prefix, *suffix], params, tenant=tenant)
        self.scheduler.add(request)
        self.requests[rid] = request

    @rule(n=st.integers(1, 4))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def step(self) -> None:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return
        reads = [ReadSet(s.request.request_id, s.request.pages, s.request.leases, s.request.num_computed_tokens)
                 for s in scheduled]  # fmt: skip
        assert check_reads(self.pool, reads) == []
        writes = [WriteSet(r.request_id, r.pages, r.leases, r.num_computed_tokens // P)
                  for r in (s.request for s in scheduled)]  # fmt: skip
        assert check_writes(self.pool, writes) == []
        plan = self.scheduler.build_plan(scheduled, 0)
        sampled = self.model.run(plan, self.requests)
        for row in plan.rows:
            written = range(row.start_pos // P, (row.context_len - 1) // P + 1)
            self.pool.stamp([row.pages[i] for i in written], [row.leases[i] for i in written])
        for request in self.scheduler.postprocess(scheduled, sampled):
            del self.requests[request.request_id]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.scheduler.finish(self.requests.pop(rid), RequestState.ABORTED, "abort")

    @precondition(lambda self: self.pool.num_cached > 0)
    @rule(data=st.data())
    def flip_a_bit_in_an_idle_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.pool.idle_pages()))
        self.model.slots[page * P] ^= 1
        self.flipped += 1

    @rule(n=st.integers(1, 4))
    def canary(self, n: int) -> None:
        for failure in self.cache.canary(n):
            assert not failure.in_use, "only idle pages are ever corrupted here"

    @invariant()
    def pool_and_cache_are_consistent(self) -> None:
        self.pool.check_integrity()
        self.cache.check_integrity()
        refs: Counter[int] = Counter(p for r in self.requests.values() for p in r.pages)
        for page in range(NUM_PAGES):
            if self.pool.state[page] == PageState.SEALED:
                assert self.pool.refs[page] == refs[page]
            elif self.pool.state[page] == PageState.LEASED:
                assert refs[page] == 1
            else:
                assert refs[page] == 0
        for r in self.requests.values():
            assert len(r.pages) == 0 or r.state is RequestState.RUNNING
            for page in r.pages[: r.num_sealed_pages]:
                if self.pool.cached[page]:
                    assert self.cache._by_page[page].scope == r.tenant, "a page shared across tenants"
        assert self.cache.digest_failures <= self.flipped

    def teardown(self) -> None:
        for request in list(self.requests.values()):
            self.scheduler.finish(request, RequestState.ABORTED, "abort")
        stats = self.pool.stats()
        assert stats.num_free == NUM_PAGES, stats
        self.pool.check_integrity()
        self.cache.check_integrity()


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_prefix_cache_under_random_interleavings = CacheMachine.TestCase
