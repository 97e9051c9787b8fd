"""Prometheus metrics and the one structured log line per request.

Boundary: observes; never changes what is served. `ServerMetrics` is the `AsyncEngine` observer (called on
the engine thread; prometheus-client is thread-safe) and counts rejections reported by the HTTP layer. Engine
gauges (running, waiting, KV pages, integrity counters, prefix cache) come from an `EngineSnapshot` taken
between steps at scrape time, so they are consistent with each other.

Log line (logger `kvfence.requests`, JSON): request id, tenant, the client's `user` field (a label the client
chose, kept apart from the authenticated tenant), outcome, reason, token counts, pages checked by I1 over the
request's life and the integrity result (`ok`, `failed`, or `unchecked` when it never ran).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.stats import EngineSnapshot
from kvfence.kv.prefix_cache import PrefixCacheStats, TenantCacheStats
from kvfence.server.async_engine import RequestEnd

request_log = logging.getLogger("kvfence.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def outcome_of(end: RequestEnd) -> tuple[str, str]:
    out = end.output
    if out.finish_reason == "abort":
        return "aborted", "abort"
    if out.error_code is not None:
        return "failed", out.error_code
    return "finished", out.finish_reason or "unknown"


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "kvfence_requests",
            "Engine requests that ended, by outcome (finished, rejected, failed, aborted) and reason",
            ["outcome", "reason", "tenant"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "kvfence_admission_rejections",
            "Requests rejected before anything was allocated, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Submission to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tenant_ttft = Histogram(
            "kvfence_tenant_time_to_first_token_seconds",
            "Submission to first token, per tenant (queueing included: what a noisy neighbour costs)",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvfence_inter_token_latency_seconds",
            "Time between two outputs of one request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.tenant_tokens = Counter(
            "kvfence_tenant_tokens",
            "Tokens served per tenant (requests that ended), prompt or completion",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self._usage: dict[str, dict[str, int]] = {}  # tenant -> its own counters (GET /v1/usage)
        self._usage_lock = threading.Lock()

    def usage_of(self, tenant: str, cache: PrefixCacheStats | None) -> dict[str, Any]:
        """One tenant's own counters (GET /v1/usage), nothing of another's: requests that ended in the engine
        (finished, failed or aborted) with their prompt and completion tokens; and from `cache` (the engine's
        prefix-cache statistics, taken between steps), the tenant's looked-up and hit tokens; None without a
        prefix cache here (the engine runs without one, or this is a PD router: its prefill workers hold it)."""
        with self._usage_lock:
            counts = dict(
                self._usage.get(tenant, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
            )
        own = None if cache is None else cache.tenants.get(tenant, TenantCacheStats())
        hits = None if own is None else {"queried_tokens": own.queried_tokens, "hit_tokens": own.hit_tokens}
        return {**counts, "prefix_cache": hits}

    def _count_usage(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)
        with self._usage_lock:
            u = self._usage.setdefault(tenant, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
            u["requests"] += 1
            u["prompt_tokens"] += prompt_tokens
            u["completion_tokens"] += completion_tokens

    # ---- the AsyncEngine observer (engine thread) -------------------------------------------------------

    def on_first_token(self, seconds: float, tenant: str) -> None:
        self.ttft.observe(seconds)
        self.tenant_ttft.labels(tenant).observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_request_end(self, end: RequestEnd) -> None:
        outcome, reason = outcome_of(end)
        self.requests.labels(outcome, reason, end.tenant).inc()
        out = end.output
        self._count_usage(end.tenant, out.num_prompt_tokens, out.num_output_tokens)
        integrity = (
            "failed"
            if out.error_code == "kv_integrity_error"
            else ("ok" if end.num_pages_checked else "unchecked")
        )
        _log(
            request_id=end.request_id,
            tenant=end.tenant,
            user=end.user,
            outcome=outcome,
            reason=reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            pages_checked=end.num_pages_checked,
            integrity=integrity,
            ttft_s=None if end.ttft_s is None else round(end.ttft_s, 6),
            duration_s=round(end.duration_s, 6),
        )

    # ---- the HTTP layer ---------------------------------------------------------------------------------

    def on_rejected(
        self, request_id: str, tenant: str, reason: str, status: int, user: str | None = None
    ) -> None:
        """A request refused before reaching the engine (admission, queue full, bad parameters)."""
        self.requests.labels("rejected", reason, tenant).inc()
        if status == 400:
            self.rejections.labels(reason).inc()
        _log(
            request_id=request_id, tenant=tenant, user=user, outcome="rejected", reason=reason, status=status
        )

    def on_client_gone(self, tenant: str) -> None:
        """A client that disconnected before it had sent its whole body: aborted, nothing reached the engine."""
        self.requests.labels("aborted", "client_disconnect", tenant).inc()
        _log(request_id="-", tenant=tenant, outcome="aborted", reason="client_disconnect")

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)


def _log(**fields: object) -> None:
    request_log.info(json.dumps(fields, sort_keys=False))


class _EngineCollector(Collector):
    """Engine gauges and counters from the snapshot taken for this scrape."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield _gauge("kvfence_requests_running", "Requests in the running batch", s.num_running)
        yield _gauge("kvfence_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        pages = GaugeMetricFamily("kvfence_kv_pages", "KV pool pages by state", labels=["state"])
        pages.add_metric(["free"], s.pool.num_free - s.pool.num_cached)
        pages.add_metric(["leased"], s.pool.num_leased)
        pages.add_metric(["quarantined"], s.pool.num_quarantined)
        pages.add_metric(["sealed"], s.pool.num_sealed)  # prefix-cache pages that requests hold
        pages.add_metric(["cached"], s.pool.num_cached)  # idle prefix-cache pages: reusable, evictable
        yield pages
        yield _gauge("kvfence_kv_pages_total", "KV pool size in pages", s.pool.num_pages)
        yield _counter("kvfence_integrity_checks", "Per-request I1 checks performed", s.integrity_checks)
        yield _counter("kvfence_integrity_pages_checked", "Pages verified by I1 checks", s.pages_checked)
        yield _counter("kvfence_integrity_failures", "Requests failed by an I1 check", s.integrity_failures)
        if s.steps_interrupted is not None:
            yield _counter(
                "kvfence_steps_interrupted",
                "Long steps stopped between layers for a request of a tenant with no work (docs/fairness.md)",
                s.steps_interrupted,
            )
        if s.prefix_cache is not None:
            yield from _prefix_cache_metrics(s.prefix_cache)
        if s.tenants:
            yield from _tenant_metrics(s)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _prefix_cache_metrics(c: PrefixCacheStats) -> Iterator[Metric]:
    yield _gauge(
        "kvfence_prefix_cache_pages", "Sealed pages in the prefix cache (held or idle)", c.num_cached_pages
    )
    yield _counter("kvfence_prefix_cache_evictions", "Idle cached pages evicted to make room", c.evictions)
    failures = "Cached pages whose K/V no longer matched their digest"
    yield _counter("kvfence_prefix_cache_digest_failures", failures, c.digest_failures)
    yield _counter(
        "kvfence_prefix_cache_pages_verified", "Digests re-checked (reuse, canary)", c.pages_verified
    )
    queried = CounterMetricFamily(
        "kvfence_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache", labels=["tenant"]
    )
    hits = CounterMetricFamily(
        "kvfence_prefix_cache_hit_tokens", "Looked-up tokens whose K/V came from the cache", labels=["tenant"]
    )
    rate = GaugeMetricFamily(
        "kvfence_prefix_cache_hit_rate", "Hit tokens / queried tokens, per tenant", labels=["tenant"]
    )
    for tenant, t in sorted(c.tenants.items()):
        queried.add_metric([tenant], t.queried_tokens)
        hits.add_metric([tenant], t.hit_tokens)
        rate.add_metric([tenant], t.hit_tokens / t.queried_tokens if t.queried_tokens else 0.0)
    yield from (queried, hits, rate)


def _tenant_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "pages": GaugeMetricFamily("kvfence_tenant_kv_pages", "KV pages a tenant's running requests hold",
                                   labels=["tenant"]),
        "running": GaugeMetricFamily("kvfence_tenant_requests_running", "A tenant's requests in the running batch",
                                     labels=["tenant"]),
        "waiting": GaugeMetricFamily("kvfence_tenant_requests_waiting", "A tenant's requests waiting to run",
                                     labels=["tenant"]),
        "virtual_tokens": CounterMetricFamily(
            "kvfence_tenant_virtual_tokens", "A tenant's virtual token counter: weighted service received "
            "(prompt tokens x1, output tokens x2, divided by its weight; docs/fairness.md)", labels=["tenant"]),
    }  # fmt: skip
    for tenant, t in s.tenants.items():
        for key, family in families.items():
            family.add_metric([tenant], getattr(t, key))
    yield from families.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
