"""Continuous batching: which requests run in the next step, with how many tokens, on which pages.

Boundary: plain Python over `Request`s and the `PagePool`; never imports torch, never sees tensors.

Each step (`schedule`):
  0. (`vtc`) When the pool cannot hold the first chunk of the least served tenant's next waiting request and
     that tenant is below its share, preempt for it (below) and start it before anything else.
  1. Running requests first, oldest first: a decode needs one token, an unfinished chunked prefill the next
     chunk. If the pool cannot cover them, preempt the request at the back of the running queue (release its
     pages, recompute later) until it can. (`vtc`, several tenants with work) Decodes go first; prompt work
     goes in counter order, by the counter each tenant would have after the work (below): running prompts'
     chunks among themselves, and a running prompt's next chunk yields to a waiting request of another tenant
     that finishes first, and runs after step 2 if the step's prefill still allows it (and it was not
     preempted meanwhile).
  2. Then waiting requests while the token budget, `max_num_seqs` and free pages allow: in arrival order
     (`fcfs`), or (`vtc`, the default) the first waiting request of the backlogged tenant whose virtual token
     counter would be the smallest after its first chunk (weighted fair queueing's finish time: a short prompt
     goes before a long chunk of a tenant a little behind), skipping a tenant at its page cap
     (engine/fairness.py). Long prompts
     are cut into chunks that fit the budget (chunked prefill). New requests never preempt running ones.
     With `prefill_batch_tokens`, a step that already holds prefill tokens takes another request's prefill only
     while the step's prefill tokens stay within it: prefills that would each fill the matmuls on their own run
     one after another, so the first of a burst gets its first token after its own prefill, not after all of
     them (on 2 CPU cores, W1's time to first token: 1.06 s batched, 0.40 s serial; docs/performance.md).
(`vtc`, several tenants with work) A step holds its decodes and at most `prefill_batch_tokens` prompt tokens
(`_budget`); while a tenant back from idle is the least served and has prompt work, other tenants' decodes wait
(`_decodes_held`, bounded by the credit it came back with). A lone tenant's long step may be interrupted when
another tenant arrives (engine/llm_engine.py).
A step that the prefill gate (engine/fairness.py) would leave empty while work is queued runs ungated instead
(work conserving: the least served tenant may be unable to start, and every other tenant's piece gated).
Fairness (`vtc`): a tenant may not lease pages beyond its `max_pages`, nor the pages other backlogged tenants are
short of their `min_pages`; preemption takes the newest running request of the tenant furthest above its share,
never one that would take a tenant below its guarantee (`fcfs`: the newest running request), also to start a
waiting request of a tenant below its share when the pool is full (step 0, or later in the step among running
requests not yet scheduled; fcfs: new requests never preempt).
`postprocess` charges each tenant's counter for what the step computed, appends sampled tokens, and finishes
requests on EOS, stop ids, max_tokens or context length.
`finish` is the only way a request leaves: its pages go back to the pool (quarantine first, see kv/pool.py).

Prefix cache (kv/prefix_cache.py), when enabled: a waiting request starts from its longest cached prefix under
its own tenant (shared leases on sealed pages; `num_computed_tokens` starts after them). At least one token is
always computed, in a page of its own, so the first token can be sampled and no step writes a shared page.
After each step, pages the step filled are sealed into the cache. Releases go through the pool's reference
counts, last page first, so the LRU evicts a sequence's tail before its head.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvfence.config import SchedulerOptions
from kvfence.engine.fairness import PREFILL_COST, Fairness, PrefillGate
from kvfence.engine.plan import Plan, PlanRow
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.ids import RequestId
from kvfence.kv.pool import Lease, PagePool
from kvfence.kv.prefix_cache import CachedPage, PrefixCache


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: Request
    num_new_tokens: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerOptions,
        context_length: int,
        pool: PagePool,
        eos_token_ids: tuple[int, ...],
        cache: PrefixCache | None = None,
        fairness: Fairness | None = None,
    ) -> None:
        self.config = config
        self.fairness = fairness or Fairness({}, pool.num_pages, enabled=config.policy == "vtc")
        self.context_length = context_length  # the engine's: the model's, or lower
        self.pool = pool
        self.cache = cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.handed_off: list[Request] = []  # PD prefill: requests whose pages await a transfer
        # pages tenants hold outside the scheduler, for fairness (PD: prefilled requests awaiting their transfer,
        # decode reservations, and 0 for a tenant queued for a reservation); the PD roles set it
        self.reserved_pages: Callable[[], Mapping[str, int]] = dict
        # tenants back from idle, least served, with prompt work (_decodes_held)
        self.returning: set[str] = set()

    @property
    def chunk(self) -> int:
        """The most prompt tokens one tenant gets in a step while several have work (the prefill gate's)."""
        return self.config.prefill_batch_tokens or self.config.max_num_batched_tokens

    @property
    def piece(self) -> int:
        """The most prompt tokens one request computes in a step while several tenants have work: the unit of
        prompt work the counters rank (a chunk, within the step's budget)."""
        return min(self.chunk, self.config.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        backlogged = self.backlogged()
        if request.tenant not in backlogged:  # credit: one chunk (Fairness.activate)
            self.fairness.activate(request.tenant, backlogged, self.chunk * PREFILL_COST)
            if backlogged and self.fairness.enabled:
                self.returning.add(request.tenant)
        request.transition(RequestState.WAITING)
        self.waiting.append(request)

    def backlogged(self) -> set[str]:
        """Tenants with requests waiting or running here: the counters' order and the prefill gate (a tenant
        whose only pages await a transfer has nothing to run, and must not hold the others back)."""
        return {r.tenant for r in self.waiting} | {r.tenant for r in self.running}

    def holders(self) -> set[str]:
        """Tenants with work or pages here, in the scheduler or outside it: the page shares (guarantees,
        preemption victims)."""
        return self.backlogged() | set(self.reserved_pages())

    def held_pages(self) -> dict[str, int]:
        """Pages each tenant holds: its running requests', and its pages outside the scheduler (PD: prefilled
        requests awaiting their transfer, decode reservations). A shared prefix page counts for each holder."""
        held = dict(self.reserved_pages())
        for r in (*self.running, *self.handed_off):
            held[r.tenant] = held.get(r.tenant, 0) + len(r.pages)
        return held

    def running_per_tenant(self) -> dict[str, int]:
        """Running requests per tenant (ties of the counters go to the tenant with fewer)."""
        running: dict[str, int] = {}
        for r in self.running:
            running[r.tenant] = running.get(r.tenant, 0) + 1
        return running

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling -------------------------------------------------------------------------------------

    def schedule(self) -> list[Scheduled]:
        gate = self.fairness.prefill_gate(self.backlogged(), self.chunk)
        scheduled = self._schedule(gate)
        if not scheduled and gate is not None:
            # work conserving: the gate holds tenants back for one another, never all of them. When the least
            # served tenant cannot run (max_num_seqs, pages, its cap) and every other tenant's piece is gated,
            # the step runs them ungated rather than stand empty (the engine would wait for a new request).
            scheduled = self._schedule(None)
        return scheduled

    def _schedule(self, gate: PrefillGate | None) -> list[Scheduled]:
        held_back = self._decodes_held(gate)
        budget = self._budget(gate, held_back)
        scheduled: list[Scheduled] = []
        preempted = False
        first = self._start_below_share(budget, gate)
        if first is not None:
            scheduled.append(first)
            budget -= first.num_new_tokens
            preempted = True  # no more new requests this step: the preempted ones wait for the next
            if gate is not None:
                gate.take(first.request.tenant, first.num_new_tokens)
        queue = [r for r in self.running if first is None or r is not first.request]
        if gate is not None:  # decodes first, then prefill chunks, each by its tenant's counter after it
            piece = self.piece
            queue.sort(key=lambda r: self._running_order(r, piece))
        yielding = self._yields_to_waiting(gate) if gate is not None else None
        deferred: list[Request] = []  # prompt chunks that yield to another tenant's waiting request
        held: list[Request] = []  # decodes that wait for a returning tenant's burst (`_decodes_held`)
        while queue and budget > 0:
            request = queue.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 1 and request.tenant in held_back:
                held.append(request)  # a returning tenant's burst goes first (its pages stay)
                continue
            if gate is not None and num_new > 1:
                num_new = gate.allowance(request.tenant, num_new)
                if num_new == 0:
                    continue  # its tenant is ahead: its prompt waits, its pages stay
                if yielding is not None and yielding(request, num_new):
                    deferred.append(request)
                    continue
            while not self._grow(request, num_new):
                victim = self._victim(queue, request)
                if victim is not request:
                    queue.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(Scheduled(request, num_new))
                budget -= num_new
                if gate is not None and num_new > 1:
                    gate.take(request.tenant, num_new)
        cap = self.config.prefill_batch_tokens
        prefill = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)  # running prefills' chunks
        capped: set[str] = set()  # tenants that may not take more pages this step
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            next_request = self._next_waiting(capped, gate)
            if next_request is None:
                break
            request = next_request
            if cap and prefill and prefill + min(request.num_tokens, budget) > cap:
                break  # this step is full of prefill already; this one goes first in the next step
            allowed = (
                budget if gate is None else gate.allowance(request.tenant, min(request.num_tokens, budget))
            )
            if allowed == 0 or not self._may_take(
                request, self.pool.pages_for(min(request.num_tokens, allowed))
            ):
                capped.add(request.tenant)
                continue
            started = self._start(request, allowed)
            if started is None and self._make_room(request, allowed, scheduled):
                started = self._start(request, allowed)
            if started is None:
                break
            self.waiting.remove(request)
            request.transition(RequestState.RUNNING)
            self.running.append(request)
            scheduled.append(Scheduled(request, started))
            budget -= started
            prefill += started
            if gate is not None:
                gate.take(request.tenant, started)
        in_step = {s.request.request_id for s in scheduled}
        for request in deferred:  # what the waiting requests left of the step's prefill
            if request.state is not RequestState.RUNNING or request.request_id in in_step:
                continue  # preempted to make room for a waiting request (and perhaps started again)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if gate is not None:
                num_new = gate.allowance(request.tenant, num_new)
            if (
                num_new <= 0
                or (cap and prefill and prefill + num_new > cap)
                or not self._grow(request, num_new)
            ):
                continue  # its pages stay; it goes again next step
            scheduled.append(Scheduled(request, num_new))
            budget -= num_new
            prefill += num_new
            if gate is not None:
                gate.take(request.tenant, num_new)
        if held and not any(s.num_new_tokens > 1 and s.request.tenant in self.returning for s in scheduled):
            # the returning tenant's prompt could not start (max_num_seqs, pages, its cap): nothing goes before
            # the held decodes, which run (their budget was left out of this step's, `_budget`)
            in_step = {s.request.request_id for s in scheduled}
            room = self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
            for request in held:
                if room <= 0:
                    break
                running = request.state is RequestState.RUNNING and request.request_id not in in_step
                if running and self._grow(request, 1):
                    scheduled.append(Scheduled(request, 1))
                    room -= 1
        return scheduled

    def _budget(self, gate: PrefillGate | None, held_back: set[str]) -> int:
        """The step's tokens: `max_num_batched_tokens`; while several tenants have work (`gate`), its decodes
        and one `prefill_batch_tokens` of prompt work. A request of one tenant waits for the whole step another's
        prompt makes (on 2 cores a 2,048-token step takes about a second); with 256 prompt tokens a step takes
        0.1-0.2 s. A lone tenant keeps the whole budget (shorter steps cost its prefill a quarter of its
        throughput on a CPU with AMX); its long step stops when another tenant arrives
        (engine/llm_engine.py, `_interruptible`)."""
        budget = self.config.max_num_batched_tokens
        cap = self.config.prefill_batch_tokens
        if gate is None or not cap:
            return budget
        decodes = sum(
            1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and r.tenant not in held_back
        )  # held decodes do not make room for more prompt tokens
        return min(budget, decodes + cap)

    def _decodes_held(self, gate: PrefillGate | None) -> set[str]:
        """vtc, several tenants with work: the tenants whose decodes wait this step. While a tenant that came
        back (had no work while others did) is the least served and has prompt work, its burst is prefilled in
        steps of its own: every other tenant's decodes wait (their pages stay). On 2 cores, 16 of a flooding
        tenant's decodes at 1,700 tokens of context read ~600 MB of K/V a step, and made each step of the
        returning tenant's burst a third longer: its TTFT p99 1.2x alone instead of 1.0x (docs/fairness.md). It
        is bounded by the credit the tenant came back with: it is the least served only until one chunk of
        weighted service (`Fairness.activate`), and it is returning only until its prompt work is done or
        another tenant is less served; tenants that never go idle hold nobody back (held at every turn of two
        busy tenants, the decodes cost both 70% on their TTFT p50)."""
        if gate is None:
            self.returning.clear()  # a tenant alone (or fcfs) holds nobody back, now or later
            return set()
        if not self.returning:
            return set()
        backlogged = self.backlogged()
        counters = self.fairness.counters
        low = min(counters.get(t, 0.0) for t in backlogged)
        prompt = {r.tenant for r in self.waiting} | {
            r.tenant for r in self.running if r.num_tokens - r.num_computed_tokens > 1
        }
        self.returning &= {t for t in backlogged if counters.get(t, 0.0) <= low and t in prompt}
        if not self.returning:
            return set()
        return {t for t in backlogged if counters.get(t, 0.0) > low}

    def _running_order(self, request: Request, piece: int) -> tuple[bool, float, float]:
        """vtc, several tenants with work: where a running request goes in the step's queue. Decodes first (each
        needs one token; among them the least served tenant first), then prompt chunks by the counter their
        tenant would have after the chunk (at most `piece` tokens), as waiting requests are ranked: a tenant a
        little ahead whose prompt has a few tokens left goes before another's full chunk (ranked by the counter
        before the work, the other's chunk filled the step's prefill and the few tokens waited a step: B's
        last request of a burst, 200-450 ms on 2 cores). Ties go to the larger weight; the sort is stable, so
        one tenant's requests keep their arrival order."""
        left = request.num_tokens - request.num_computed_tokens
        work = min(left, piece) if left > 1 else 0
        return (
            left > 1,
            self.fairness.finish(request.tenant, work),
            -self.fairness.share(request.tenant).weight,
        )

    def _yields_to_waiting(self, gate: PrefillGate) -> Callable[[Request, int], bool]:
        """vtc, several tenants with work: whether a running request's next prompt chunk (of so many tokens)
        yields this step to a waiting request of another tenant that `Fairness.next_tenant` puts first, each
        tenant by the counter it would have after its piece of prompt work (at most `piece` tokens).
        Only to a tenant the gate lets prefill: one more than a chunk ahead would not start, and the chunk it
        displaced could be the least served tenant's."""
        running = self.running_per_tenant()
        first = self._first_waiting_work(gate)
        return lambda request, tokens: any(
            t != request.tenant
            and self.fairness.next_tenant({t, request.tenant}, running, {**first, request.tenant: tokens})
            == t
            for t in first
        )

    def _first_waiting_work(self, gate: PrefillGate | None) -> dict[str, int]:
        """Each waiting tenant's next piece of prompt work: its oldest waiting request's first `piece` tokens;
        only tenants the gate lets prefill this step (all without a gate)."""
        most = self.piece
        work: dict[str, int] = {}
        for r in self.waiting:
            piece = min(r.num_tokens - r.num_computed_tokens, most)
            if r.tenant not in work and (gate is None or gate.allowance(r.tenant, piece) > 0):
                work[r.tenant] = piece
        return work

    def _start_below_share(self, budget: int, gate: PrefillGate | None) -> Scheduled | None:
        """vtc, before the running requests: when the pool cannot hold the first chunk of the next waiting request
        (the least served tenant's) and its tenant is below its share, preempt the tenant furthest above its
        share (`_make_room`) and start it now. Later in the step every running request is already scheduled, so
        none could be preempted for it, and its tenant would wait for the flooder's requests to end; started
        first, the pages made for it are its own. None: nothing to do here (the usual order applies)."""
        if not self.fairness.enabled or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        request = self._next_waiting(set(), gate)
        if request is None:
            return None
        num_new = min(request.num_tokens, budget)
        num_new = num_new if gate is None else gate.allowance(request.tenant, num_new)
        need = self.pool.pages_for(num_new)
        if need == 0 or self.pool.can_allocate(need):
            return None  # nothing it may run, or room for it already: the usual order
        cap = self.fairness.cap(request.tenant)
        if cap is not None and self.held_pages().get(request.tenant, 0) + need > cap:
            return None
        if not self._make_room(request, num_new, []):
            return None
        started = self._start(request, num_new)
        if started is None:
            return None
        self.waiting.remove(request)
        request.transition(RequestState.RUNNING)
        self.running.append(request)
        return Scheduled(request, started)

    def _next_waiting(self, capped: set[str], gate: PrefillGate | None) -> Request | None:
        """The waiting request to start next: the oldest (fcfs), or (vtc) the oldest of the tenant among those not
        capped this step and let prefill by the gate that `Fairness.next_tenant` puts first, by the counter it
        would have after its first piece (at most `piece` tokens). None: no such tenant. (Ranked among gated
        tenants too, a short prompt of a tenant more than a chunk ahead came first, was refused, and its turn
        ended the step's new prefills before a request of the least served tenant.)"""
        if not self.fairness.enabled:
            return self.waiting[0]
        work = self._first_waiting_work(gate)
        tenants = set(work) - capped
        if not tenants:
            return None
        tenant = self.fairness.next_tenant(tenants, self.running_per_tenant(), work)
        return next(r for r in self.waiting if r.tenant == tenant)

    def _may_take(self, request: Request, pages: int) -> bool:
        """Fairness allows `request`'s tenant `pages` more pages now (its cap, others' guarantees)."""
        if not self.fairness.enabled or pages <= 0:
            return True
        free = self.pool.num_free
        return self.fairness.may_take(request.tenant, pages, free, self.held_pages(), self.holders())

    def _victim(self, queue: list[Request], request: Request) -> Request:
        """Whom to preempt so that `request` can grow: a running request not yet scheduled this step (`queue`)
        or `request` itself. fcfs: the newest. vtc: the newest of the tenant furthest above its share, never one
        that takes its tenant below its guarantee; `request` itself if no other may go."""
        if not self.fairness.enabled:
            return queue[-1] if queue else request
        newest: dict[str, Request] = {}
        for r in queue:
            if r.tenant not in newest or r.arrival > newest[r.tenant].arrival:
                newest[r.tenant] = r
        newest.setdefault(request.tenant, request)
        held = self.held_pages()
        tenant = self.fairness.victim(held, {t: len(r.pages) for t, r in newest.items()}, self.holders())
        return request if tenant is None else newest[tenant]

    def _make_room(self, request: Request, num_new: int, scheduled: list[Scheduled]) -> bool:
        """vtc, the pool short for a waiting request of a tenant below its share: preempt running requests not in
        this step (newest first) of the tenant furthest above its share, never below a guarantee, until the
        request's first chunk fits. True if it now does."""
        if not self.fairness.enabled:
            return False
        need = self.pool.pages_for(min(request.num_tokens, num_new))
        in_step = {s.request.request_id for s in scheduled}
        while not self.pool.can_allocate(need):
            backlogged, held = self.holders(), self.held_pages()
            if held.get(request.tenant, 0) >= self.fairness.fair_pages(request.tenant, backlogged):
                return False  # at its share already: it waits like anyone else
            newest: dict[str, Request] = {}
            for r in self.running:
                other = r.request_id not in in_step and r.tenant != request.tenant and bool(r.pages)
                if other and (r.tenant not in newest or r.arrival > newest[r.tenant].arrival):
                    newest[r.tenant] = r
            tenant = self.fairness.victim(held, {t: len(r.pages) for t, r in newest.items()}, backlogged)
            if tenant is None or held.get(tenant, 0) <= self.fairness.fair_pages(tenant, backlogged):
                return False
            self._preempt(newest[tenant])
        return True

    def _grow(self, request: Request, num_new: int) -> bool:
        """Lease the pages `request` needs to hold `num_new` more tokens; False if the pool is short or
        fairness does not let its tenant take them now."""
        need = self.pool.pages_for(request.num_computed_tokens + num_new) - len(request.pages)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need) or not self._may_take(request, need):
            return False
        request.add_leases(self.pool.allocate(need))
        return True

    def _start(self, request: Request, budget: int) -> int | None:
        """Lease what a waiting request's first chunk needs, after its longest cached prefix; the number of new
        tokens to run, or None if the pool is short (then the request holds nothing)."""
        request.num_cached_tokens = 0
        hit = self._lookup(request)
        if hit:
            num_new = min(request.num_tokens - len(hit) * self.pool.page_size, budget)
            need = self.pool.pages_for(len(hit) * self.pool.page_size + num_new) - len(hit)
            idle = sum(self.pool.is_idle(e.page) for e in hit)  # sharing them takes them off the free count
            if not self.pool.can_allocate(need + idle):
                return None
            self._reuse(request, hit)
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self._grow(request, num_new):
            self._release(request)
            request.num_computed_tokens = 0
            return None
        if self.cache is not None and request.cacheable:
            self.cache.record(request.tenant, request.num_tokens, request.num_cached_tokens)
        return num_new

    def _lookup(self, request: Request) -> list[CachedPage]:
        if self.cache is None or not request.cacheable:
            return []
        assert not request.pages and request.num_computed_tokens == 0, "a waiting request holds pages"
        if request.cache_scope is None:
            request.cache_scope = self.cache.scope_for(request.tenant, request.params.cache_salt)
        # the last token must run (to sample the next one), in a page of the request's own
        max_pages = (request.num_tokens - 1) // self.pool.page_size
        return self.cache.match(request.cache_scope, request.token_ids, request.page_keys, max_pages)

    def _reuse(self, request: Request, hit: list[CachedPage]) -> None:
        """Take shared leases on the verified part of `hit`; the prefill starts after it."""
        assert self.cache is not None
        hit = self.cache.verify(hit)
        request.add_leases(self.cache.acquire(hit))
        request.num_sealed_pages = len(hit)
        request.num_computed_tokens = request.num_cached_tokens = len(hit) * self.pool.page_size

    def _seal(self, request: Request) -> None:
        """Seal the pages the last step filled (prefix cache on): they become shared and read-only."""
        full = request.num_computed_tokens // self.pool.page_size
        if self.cache is None or request.cache_scope is None or full <= request.num_sealed_pages:
            return
        leases = [Lease(p, x) for p, x in zip(request.pages[:full], request.leases[:full], strict=True)]
        self.cache.seal(
            request.cache_scope, request.token_ids, request.page_keys, leases, request.num_sealed_pages
        )
        request.num_sealed_pages = full

    def _release(self, request: Request) -> None:
        """All of the request's pages back to the pool, last first (for the LRU: tails are evicted first)."""
        self.pool.release(reversed(request.take_leases()))
        request.num_sealed_pages = 0

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the request's K/V and pages, keep its tokens, put it at the head of the queue."""
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        request.transition(RequestState.WAITING)
        self.waiting.appendleft(request)

    def build_plan(self, scheduled: list[Scheduled], step: int) -> Plan:
        rows = []
        for item in scheduled:
            r, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            p = r.params
            sample = end == r.num_tokens
            history = tuple(r.token_ids) if sample and p.needs_history else ()
            banned = self._banned(p) if sample and r.num_output_tokens < p.min_tokens else ()
            allowed = r.grammar.bitmask() if sample and r.grammar is not None else None
            offset, targets = self._prompt_targets(r, start, end)
            rows.append(
                PlanRow(
                    request_id=r.request_id,
                    token_ids=tuple(r.token_ids[start:end]),
                    start_pos=start,
                    pages=tuple(r.pages),
                    leases=tuple(r.leases),
                    sample=sample,
                    params=p,
                    num_generated=r.num_output_tokens,
                    history=history,
                    banned=banned,
                    allowed=allowed,
                    prompt_targets=targets,
                    prompt_offset=offset,
                )
            )
        return Plan(rows=tuple(rows), step=step)

    @staticmethod
    def _prompt_targets(r: Request, start: int, end: int) -> tuple[int, tuple[int, ...]]:
        """(offset in the chunk, the prompt tokens those positions predict) for a request that wants prompt
        logprobs: positions [start, end) that predict a prompt token not already scored."""
        if r.params.prompt_logprobs is None:
            return 0, ()
        first = max(start, len(r.prompt_logprobs))
        last = min(end, r.num_prompt_tokens - 1)
        if first >= last:
            return 0, ()
        return first - start, tuple(r.token_ids[first + 1 : last + 1])

    # ---- after the step ---------------------------------------------------------------------------------

    def postprocess(self, scheduled: list[Scheduled], sampled: dict[RequestId, int]) -> list[Request]:
        """Advance each scheduled request by what the step computed; return the requests that finished."""
        finished = []
        for item in scheduled:
            request = item.request
            if request.state is not RequestState.RUNNING:
                continue  # failed or aborted while the step ran
            decode = item.num_new_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens
            self.fairness.charge(request.tenant, 0 if decode else item.num_new_tokens, 1 if decode else 0)
            request.num_computed_tokens += item.num_new_tokens
            self._seal(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.token_ids.append(token)
            if request.grammar is not None:
                request.grammar.consume(token)
            if request.prefill_only:
                self._hand_off(request)
                continue
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, RequestState.FINISHED, reason)
                finished.append(request)
        return finished

    def _hand_off(self, request: Request) -> None:
        """PD prefill: the prompt's K/V and first token are done; keep the pages for the transfer."""
        self.running.remove(request)
        request.transition(RequestState.TRANSFERRING)
        self.handed_off.append(request)

    def adopt(self, request: Request) -> None:
        """PD decode: a request whose prompt K/V arrived by transfer joins the running batch."""
        request.transition(RequestState.RUNNING)
        self.running.append(request)

    def _banned(self, params: SamplingParams) -> tuple[int, ...]:
        """What ends a request, held off until `min_tokens`: EOS (unless ignored) and the stop token ids."""
        eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
        return eos + params.stop_token_ids

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.context_length:
            return "length"
        if request.grammar is not None and request.grammar.done:
            return "stop"  # the structured output is complete (its grammar allows nothing more)
        return None

    def finish(
        self, request: Request, state: RequestState, reason: str, error_code: str | None = None
    ) -> None:
        """End a live request in `state`; its pages are released to the pool (quarantined, then freed)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            self.running.remove(request)
        request.transition(state)
        request.finish_reason, request.error_code = reason, error_code
        self._release(request)
