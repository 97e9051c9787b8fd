"""Fairness across tenants: virtual token counters (VTC: Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024) for who runs next, and KV page shares (a guaranteed minimum, a maximum) for who holds the pool.

Boundary: plain data over tenant names; no torch, no pages of its own. The scheduler (engine/scheduler.py) tells
it what each tenant computed and asks it: which backlogged tenant goes next (`next_tenant`), whether a tenant may
take more pages now (`may_take`), and whose running request to preempt (`victim`).

Counters. A tenant's counter is the service it received in weighted tokens: a prompt token computed costs
`PREFILL_COST`, an output token `DECODE_COST` (the paper's w_p = 1, w_q = 2), divided by the tenant's weight. The
backlogged tenant with the smallest counter is served first; prompt work goes by the counter after it (the
counter plus the piece's tokens over the weight: weighted fair queueing's finish time), so a short prompt goes
before another tenant's long chunk. A tenant that becomes backlogged again is brought within the backlogged
tenants' range: up to the smallest counter less one chunk (it cannot bank more of the service it did not ask for
while idle; the chunk lets a burst it comes back with go before the next chunk of the tenant that kept the server
busy) and down to the largest (what it got while nobody else wanted service is no debt). So two backlogged
tenants' counters stay within a bound set by one step's and one request's work and one chunk (tests assert
it). Prompt tokens make steps long, so while several tenants have work, a tenant's prefill runs only while its
counter after the piece stays within one chunk of the least served tenant's counter, a chunk per step
(`PrefillGate`); decodes run, except that while a tenant that came back from idle is the least served and
has prompt work, the others' decodes wait (the scheduler's `_decodes_held`, bounded by its credit).

Pages. `min_pages` are guaranteed: while a tenant with a guarantee is backlogged, pages it is short of it are
reserved (others may not take them), and preemption never takes a tenant below it. `max_pages` caps a tenant.
Preemption takes from the tenant furthest above its share: its weight's part of the pool among the backlogged
tenants, and never less than its guarantee.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PREFILL_COST = 1.0
DECODE_COST = 2.0


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One tenant's part of the engine (from the API keys file, kvfence/server/tenants.py)."""

    weight: float = 1.0
    min_pages: int = 0
    max_pages: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"weight must be positive, got {self.weight}")
        if self.min_pages < 0 or (self.max_pages is not None and self.max_pages < max(1, self.min_pages)):
            raise ValueError(
                f"min_pages must be >= 0 and max_pages >= max(1, min_pages), got {self.min_pages}, "
                f"{self.max_pages}"
            )


DEFAULT_SHARE = TenantShare()


class PrefillGate:
    """One step's prefill tokens per tenant while several tenants have work. Prompt tokens are what makes a step
    long (on CPU a 1,700-token prefill takes seconds; a decode step of 8 takes tens of milliseconds), and every
    running request waits for the whole step: so a tenant's prefill runs only while its counter *after* the
    piece stays within one chunk of the smallest backlogged counter, and at most `chunk` of its prompt tokens
    per step. Decodes are not gated here (the scheduler holds them only for a returning tenant's burst,
    `Scheduler._decodes_held`). The tenant furthest behind always gets its chunk (work conserving: a
    step is never left empty for fairness). Gated by the counter before the piece (sessions 17-23), a tenant a
    little ahead added a whole chunk to the step in which a returning tenant's prompt was finishing, and that
    prompt's first token waited for it (a chunk of a long prompt: 150-250 ms on 2 cores)."""

    def __init__(
        self, counters: Mapping[str, float], low: float, chunk: int, weights: Mapping[str, float]
    ) -> None:
        self._counters, self._low, self.chunk, self._weights = counters, low, chunk, weights
        self._used: dict[str, int] = {}

    def allowance(self, tenant: str, tokens: int) -> int:
        """How many of `tokens` prompt tokens `tenant` may compute in this step: none if its counter after them
        would be more than a chunk past the smallest counter, unless it is the least served itself. None, not a
        piece trimmed to fit: trimmed, a tenant ahead would still fill the step in which another tenant's
        prompt is finishing (by the counters of bench/noisy_engine.py's step log, 181 of A's tokens beside B's
        last 27), at the cost of budget left unused in such a step."""
        counter = self._counters.get(tenant, self._low)
        piece = min(tokens, max(0, self.chunk - self._used.get(tenant, 0)))
        after = counter + piece * PREFILL_COST / self._weights.get(tenant, 1.0)
        if counter > self._low and after > self._low + self.chunk * PREFILL_COST:
            return 0
        return piece

    def take(self, tenant: str, tokens: int) -> None:
        self._used[tenant] = self._used.get(tenant, 0) + tokens


class Fairness:
    """Counters and shares for one engine's tenants. `enabled` False: first come, first served (the counters
    still count, for metrics; no reservation, no cap beyond the pool, preemption from the back)."""

    def __init__(self, shares: Mapping[str, TenantShare], pool_pages: int, enabled: bool = True) -> None:
        guaranteed = sum(s.min_pages for s in shares.values())
        if guaranteed > pool_pages:
            raise ValueError(f"tenants' min_pages add up to {guaranteed}, more than the pool's {pool_pages}")
        shared = sorted(t for t, s in shares.items() if s != DEFAULT_SHARE)
        if shared and not enabled:  # never accepted and ignored: fcfs knows no weights, guarantees or caps
            raise ValueError(
                f"tenants {', '.join(shared)} have weights or page shares, which --scheduling-policy fcfs would "
                "not apply (vtc does)"
            )
        self.shares = dict(shares)
        self.pool_pages = pool_pages
        self.enabled = enabled
        self.counters: dict[str, float] = {}

    def with_shares(self, shares: Mapping[str, TenantShare]) -> Fairness:
        """The same policy and counters under new shares (ValueError if their guarantees exceed the pool)."""
        fairness = Fairness(shares, self.pool_pages, self.enabled)
        fairness.counters = self.counters
        return fairness

    def share(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant, DEFAULT_SHARE)

    def cap(self, tenant: str) -> int | None:
        """The most pages `tenant` may hold here (admission refuses a request that needs more), None: the pool."""
        return self.share(tenant).max_pages if self.enabled else None

    # ---- counters -------------------------------------------------------------------------------------

    def activate(self, tenant: str, backlogged: Iterable[str], credit: float = 0.0) -> None:
        """`tenant` has work again after none: its counter is brought within the backlogged tenants' range, up to
        the smallest, or to the largest less `credit` where that is lower (it cannot bank more than that of the
        service it did not ask for while idle), and down to the largest (service it got while nobody else wanted
        any is no debt to the tenants waiting now). The scheduler gives one chunk of prompt tokens as credit: a
        tenant that comes back with a burst of short prompts gets them all before the next chunk of a tenant
        that kept the server busy meanwhile (the one chunk the prefill gate already lets tenants lead by),
        instead of seeing that chunk cut into its burst. It is bounded: only a tenant more than `credit` behind
        the others gets it, so going idle and back again does not add up; and it is counted from the largest
        counter (never below the smallest), so tenants that come back together share one credit instead of each
        landing a credit below the last."""
        others = [self.counters.get(t, 0.0) for t in backlogged if t != tenant]
        current = self.counters.get(tenant, 0.0)
        if others:  # the credit counts from the largest counter: tenants coming back together do not stack it
            floor = min(min(others), max(others) - credit)
            self.counters[tenant] = min(max(current, floor), max(others))
        else:
            self.counters[tenant] = current

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        cost = prompt_tokens * PREFILL_COST + output_tokens * DECODE_COST
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.share(tenant).weight

    def prefill_gate(self, backlogged: set[str], chunk: int) -> PrefillGate | None:
        """This step's prefill allowances (None: no limit, fcfs or a single backlogged tenant)."""
        if not self.enabled or len(backlogged) < 2:
            return None
        low = min(self.counters.get(t, 0.0) for t in backlogged)
        return PrefillGate(
            {t: self.counters.get(t, 0.0) for t in backlogged},
            low,
            chunk,
            {t: self.share(t).weight for t in backlogged},
        )

    def finish(self, tenant: str, tokens: int) -> float:
        """The counter `tenant` would have after `tokens` more prompt tokens: the virtual finish time of that
        piece of work under weighted fair queueing (its start time is the counter itself)."""
        return self.counters.get(tenant, 0.0) + tokens * PREFILL_COST / self.share(tenant).weight

    def next_tenant(
        self,
        candidates: Iterable[str],
        running: Mapping[str, int] | None = None,
        work: Mapping[str, int] | None = None,
    ) -> str:
        """The tenant to serve first among `candidates`: the smallest counter, or with `work` (each candidate's
        next piece of prompt work, in tokens) the smallest counter after it: the virtual finish time of weighted
        fair queueing, where plain VTC orders by start. A short prompt of a tenant within one piece of work of
        the smallest counter goes before a long chunk (a request's first token before another tenant's next
        200-600 ms of prefill on 2 cores), and a heavier tenant's piece weighs less; the lag this allows is one
        piece of work, which the counters' bound already covers. Ties (a tenant that just got work is lifted to
        exactly the smallest counter) go to the larger weight, then to the tenant with fewer requests
        `running`, then by name (deterministic)."""
        running, work = running or {}, work or {}
        return min(
            candidates,
            key=lambda t: (
                self.finish(t, work.get(t, 0)),
                -self.share(t).weight,
                running.get(t, 0),
                t,
            ),
        )

    # ---- pages ----------------------------------------------------------------------------------------

    def may_take(
        self, tenant: str, pages: int, free: int, held: Mapping[str, int], backlogged: set[str]
    ) -> bool:
        """Whether `tenant` may lease `pages` more now, with `free` pages free and `held` pages per tenant: within
        its cap, and leaving the pages other backlogged tenants are short of their guarantees."""
        if not self.enabled:
            return pages <= free
        cap = self.share(tenant).max_pages
        if cap is not None and held.get(tenant, 0) + pages > cap:
            return False
        reserved = sum(max(0, self.share(t).min_pages - held.get(t, 0)) for t in backlogged if t != tenant)
        return pages <= free - reserved

    def fair_pages(self, tenant: str, backlogged: set[str]) -> float:
        """The tenant's share of the pool among the backlogged tenants (by weight), at least its guarantee."""
        weights = sum(self.share(t).weight for t in backlogged | {tenant})
        return max(self.share(tenant).min_pages, self.pool_pages * self.share(tenant).weight / weights)

    def victim(
        self, held: Mapping[str, int], candidates: Mapping[str, int], backlogged: set[str]
    ) -> str | None:
        """The tenant to preempt from: among `candidates` (tenant -> pages its preemptible request would free),
        the one furthest above its share whose preemption keeps it at or above its guarantee; None if none."""
        eligible = [t for t, pages in candidates.items() if held.get(t, 0) - pages >= self.share(t).min_pages]
        if not eligible:
            return None
        return max(eligible, key=lambda t: (held.get(t, 0) - self.fair_pages(t, backlogged), t))
